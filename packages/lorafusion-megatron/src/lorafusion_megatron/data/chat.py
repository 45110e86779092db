"""Chat records: turns rendered with the tokenizer's chat template, the loss on assistant turns only.

A chat is a list of ``{"role": ..., "content": ...}`` turns (OpenAI style). The template renders
the whole conversation as one text; to find the assistant's part of it, the conversation is also
rendered cut before each assistant turn (with the generation prompt, as at inference) and right
after it. For the turns ``[u0, a0, u1, a1]``::

    render([u0], gen)   render([u0, a0])   render([u0, a0, u1], gen)   render([u0, a0, u1, a1])
    |-- masked ---------|-- trained -------|-- masked ------------------|-- trained -------------|

Each piece is tokenised on its own and the pieces' tokens are concatenated, which is how the model
meets them at inference: the rendered prompt is tokenised, the reply is produced token by token.
A trained piece holds the reply and the template's end-of-turn text, so the model learns to stop;
every other token gets label -100. This needs a template under which the first turns of a chat
render as a prefix of the whole chat, as common templates do; one that rewrites earlier turns
(e.g. drops past reasoning) is refused with a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.data.samples import Sample
from lorafusion_megatron.errors import TrainerError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TRAINED_ROLE", "no_chat_template_message", "tokenize_chats"]

TRAINED_ROLE = "assistant"
"""The role whose turns the loss counts; every other role's tokens are masked."""

Piece = tuple[str, bool]
"""A slice of a rendered chat and whether its tokens are trained."""


def no_chat_template_message(source: str, tokenizer: str) -> str:
    """Why dataset ``source`` cannot train with ``tokenizer`` (named for the message), and what to change."""
    return (
        f"dataset {source} holds chats, but the tokenizer ({tokenizer}) has no chat template: use a tokenizer "
        "that has one (a `chat_template` in its tokenizer_config.json or a chat_template.jinja file; see "
        "base_model.tokenizer_name_or_path), or give the records prompt/response fields"
    )


def _turns(chat: Any, where: str) -> list[dict[str, Any]]:
    """``chat`` checked to be a non-empty list of turns with text ``role`` and ``content``."""
    if not isinstance(chat, list) or not chat:
        raise TrainerError(f"{where}: the chat is {chat!r}, expected a non-empty list of {{role, content}} turns")
    for number, turn in enumerate(chat, start=1):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise TrainerError(f"{where}, turn {number}: {turn!r} needs a text `role` and a text `content`")
    return chat


def _render(
    tokenizer: PreTrainedTokenizerBase, turns: list[dict[str, Any]], *, generation_prompt: bool, where: str
) -> str:
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError) as exc:  # a template rejects a chat with raise_exception (a TemplateError)
        raise TrainerError(f"{where}: the tokenizer's chat template refused the chat: {exc}") from None
    assert isinstance(text, str)
    return text


def _pieces(tokenizer: PreTrainedTokenizerBase, turns: list[dict[str, Any]], where: str) -> list[Piece]:
    """The rendered chat cut into masked and trained pieces (empty pieces left out)."""
    whole = _render(tokenizer, turns, generation_prompt=False, where=where)
    pieces: list[Piece] = []
    done = 0  # characters of `whole` already in pieces
    for index, turn in enumerate(turns):
        if turn["role"] != TRAINED_ROLE:
            continue
        if index == 0:
            raise TrainerError(
                f"{where}: the chat starts with an {TRAINED_ROLE} turn, so there is no prompt to render before it; "
                "put a system or user turn first"
            )
        reply_start = _render(tokenizer, turns[:index], generation_prompt=True, where=where)
        reply_end = _render(tokenizer, turns[: index + 1], generation_prompt=False, where=where)
        if not (
            whole.startswith(reply_start) and whole.startswith(reply_end) and done <= len(reply_start) <= len(reply_end)
        ):
            raise TrainerError(
                f"{where}: the tokenizer's chat template does not render the turns before and up to {TRAINED_ROLE} "
                f"turn {index + 1} as a prefix of the whole chat (it rewrites earlier turns), so the {TRAINED_ROLE} "
                "tokens cannot be located; use a template that renders turns in place, or prompt/response fields"
            )
        pieces.extend([(whole[done : len(reply_start)], False), (whole[len(reply_start) : len(reply_end)], True)])
        done = len(reply_end)
    pieces.append((whole[done:], False))
    return [(text, trained) for text, trained in pieces if text]


def tokenize_chats(chats: Sequence[Any], tokenizer: PreTrainedTokenizerBase, *, source: str) -> list[Sample]:
    """Render and tokenise chats; only the ``assistant`` turns (and their end-of-turn text) are trained.

    Args:
        chats: One list of ``{role, content}`` turns per record.
        tokenizer: The base model's tokenizer; it must have a chat template. The template writes any
            BOS itself, so no special tokens are added.
        source: Dataset name for error messages.

    Returns:
        One sample per chat, in order (a chat without an assistant turn has no target).

    Raises:
        TrainerError: The tokenizer has no chat template, a chat is malformed, or the template
            refuses it or does not render its turns in place.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or "a byte-level tokenizer"
        raise TrainerError(no_chat_template_message(source, name))
    per_chat = []
    for number, chat in enumerate(chats, start=1):
        where = f"dataset {source} record {number} of {len(chats)}"
        per_chat.append(_pieces(tokenizer, _turns(chat, where), where))
    texts = [text for pieces in per_chat for text, _ in pieces]
    encoded: list[list[int]] = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    samples = []
    cursor = 0
    for pieces in per_chat:
        ids: list[int] = []
        trained: list[bool] = []
        for _, is_trained in pieces:
            ids.extend(encoded[cursor])
            trained.extend([is_trained] * len(encoded[cursor]))
            cursor += 1
        samples.append(Sample.from_trained_mask(ids, trained))
    return samples
