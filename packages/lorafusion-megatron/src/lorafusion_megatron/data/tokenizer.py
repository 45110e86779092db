"""Tokenizers: the base model's own, or one built locally (presets and the demo have none).

Presets are random-weight architectures with no tokenizer to download, so text datasets on them
are tokenised as UTF-8 bytes (259 ids fit any vocabulary). The demo trains a small byte-level BPE
on its own generated text and saves it next to the model, as a real checkpoint would ship it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from lorafusion_megatron.errors import TrainerError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from lorafusion_megatron.config import BaseModelConfig

__all__ = ["SPECIAL_TOKENS", "byte_level_tokenizer", "load_tokenizer", "train_bpe_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
"""Padding, beginning-of-sequence and end-of-sequence tokens (ids 0, 1, 2) of the local tokenizers."""


def _wrap(backend: object) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    assert isinstance(backend, Tokenizer)
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (deterministic for the same texts).

    Args:
        texts: Training text.
        vocab_size: Target vocabulary size, special tokens and the 256 bytes included.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return _wrap(backend)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer that maps text to its UTF-8 bytes (plus three special tokens), no merges."""
    return train_bpe_tokenizer([], vocab_size=len(SPECIAL_TOKENS) + 256)


def load_tokenizer(config: BaseModelConfig, vocab_size: int) -> PreTrainedTokenizerBase:
    """The tokenizer for ``config``'s model: its folder's, the configured one, or bytes for presets.

    Args:
        config: The base model section.
        vocab_size: The model's vocabulary size; every token id must be below it.

    Raises:
        TrainerError: No tokenizer can be loaded, or its ids do not fit the model's vocabulary.
    """
    from transformers import AutoTokenizer

    path = config.tokenizer_name_or_path
    if path is None and not config.is_preset:
        path = config.model_name_or_path
    tokenizer: PreTrainedTokenizerBase
    if path is None:
        tokenizer = byte_level_tokenizer()
    else:
        if not Path(path).is_dir():
            raise TrainerError(f"tokenizer folder {path} does not exist: set base_model.tokenizer_name_or_path")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise TrainerError(
                f"cannot load a tokenizer from {path} ({exc}); set base_model.tokenizer_name_or_path"
            ) from None
    if len(tokenizer) > vocab_size:
        raise TrainerError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only {vocab_size}: "
            "use the model's own tokenizer (base_model.tokenizer_name_or_path)"
        )
    return tokenizer
