"""Tokenizers: the base model's own, or one built locally (presets and the demo have none).

Presets are random-weight architectures with no tokenizer to download, so text datasets on them
are tokenised as UTF-8 bytes (259 ids fit any vocabulary). The demo trains a small byte-level BPE
on its own generated text and saves it next to the model, as a real checkpoint would ship it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from lorafusion_megatron.errors import TrainerError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from lorafusion_megatron.config import BaseModelConfig

__all__ = [
    "SPECIAL_TOKENS",
    "byte_level_tokenizer",
    "declares_chat_template",
    "load_tokenizer",
    "tokenizer_folder",
    "train_bpe_tokenizer",
]

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


def tokenizer_folder(config: BaseModelConfig) -> str | None:
    """The folder the tokenizer is loaded from: the configured one, else the model's; None for a preset (bytes)."""
    if config.tokenizer_name_or_path is not None or config.is_preset:
        return config.tokenizer_name_or_path
    return config.model_name_or_path


def declares_chat_template(folder: str | Path | None) -> bool:
    """Whether the tokenizer in ``folder`` comes with a chat template, judged from its files alone.

    transformers 5 takes a tokenizer's templates from ``chat_template.jinja``, from
    ``additional_chat_templates/*.jinja``, or from ``chat_template`` in ``tokenizer_config.json``;
    this reads the same files without importing it (``validate`` runs without it). A
    ``tokenizer_config.json`` that cannot be read counts as declaring one: loading the tokenizer
    will say what is wrong with it. ``None`` (a preset's byte-level tokenizer) has none.
    """
    if folder is None:
        return False
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file() or any((folder / "additional_chat_templates").glob("*.jinja")):
        return True
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    return not isinstance(tokenizer_config, dict) or tokenizer_config.get("chat_template") is not None


def load_tokenizer(config: BaseModelConfig, vocab_size: int) -> PreTrainedTokenizerBase:
    """The tokenizer for ``config``'s model: its folder's, the configured one, or bytes for presets.

    Args:
        config: The base model section.
        vocab_size: The model's vocabulary size; every token id must be below it.

    Raises:
        TrainerError: No tokenizer can be loaded, or its ids do not fit the model's vocabulary.
    """
    from transformers import AutoTokenizer

    path = tokenizer_folder(config)
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
