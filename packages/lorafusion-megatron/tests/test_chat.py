"""Chat datasets: turns rendered by the tokenizer's chat template, the loss on assistant turns only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.data.chat import tokenize_chats
from lorafusion_megatron.data.job_data import load_job_data
from lorafusion_megatron.data.samples import IGNORE_INDEX, tokenize_records
from lorafusion_megatron.data.tokenizer import byte_level_tokenizer, load_tokenizer
from lorafusion_megatron.errors import TrainerError

# ChatML-like, on the byte-level tokenizer's special tokens: "<s>role\ncontent</s>\n" per turn.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture
def chat_tokenizer():
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_only_assistant_turns_carry_labels(chat_tokenizer) -> None:
    [sample] = tokenize_chats([CHAT], chat_tokenizer, source="t")
    text = chat_tokenizer.decode(sample.input_ids.tolist())
    assert text == chat_tokenizer.apply_chat_template(CHAT, tokenize=False)
    # targets[t] is token t+1 where that token is trained: the trained tokens, in order, are the
    # assistant replies with their end-of-turn text; the role headers and other turns are not.
    trained = [int(t) for t in sample.targets if t != IGNORE_INDEX]
    assert chat_tokenizer.decode(trained) == "hello</s>\n4</s>\n"
    assert sample.num_targets == len(trained)
    assert sample.targets[-1] == IGNORE_INDEX


def test_messages_field_is_chosen_first_and_can_be_renamed(chat_tokenizer) -> None:
    records = [{"turns": CHAT[1:3], "text": "ignored"}]
    [sample] = tokenize_records(
        records,
        chat_tokenizer,
        prompt_field="prompt",
        response_field="response",
        text_field="text",
        messages_field="turns",
        source="t",
    )
    assert chat_tokenizer.decode([int(t) for t in sample.targets if t != IGNORE_INDEX]) == "hello</s>\n"


def test_a_chat_without_an_assistant_turn_has_no_target(chat_tokenizer) -> None:
    [sample] = tokenize_chats([CHAT[:2]], chat_tokenizer, source="t")
    assert sample.num_targets == 0


def test_a_tokenizer_without_a_chat_template_is_refused() -> None:
    with pytest.raises(
        TrainerError,
        match=r"the tokenizer \(a byte-level tokenizer\) has no chat template: use a tokenizer that has one",
    ):
        tokenize_chats([CHAT], byte_level_tokenizer(), source="t")


@pytest.mark.parametrize(
    ("chat", "message"),
    [
        ("hi", "record 1 of 1: the chat is 'hi', expected a non-empty list"),
        ([], "expected a non-empty list"),
        ([{"role": "user"}], r"record 1 of 1, turn 1: \{'role': 'user'\} needs a text `role` and a text `content`"),
        ([{"role": "assistant", "content": "x"}], "starts with an assistant turn"),
    ],
)
def test_malformed_chats_are_refused(chat_tokenizer, chat, message: str) -> None:
    with pytest.raises(TrainerError, match=message):
        tokenize_chats([chat], chat_tokenizer, source="t")


def test_a_template_that_rewrites_earlier_turns_is_refused(chat_tokenizer) -> None:
    # Renders the last turn's content upper-cased: a shorter chat is then no prefix of the whole.
    chat_tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n"
        "{% if loop.last %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    with pytest.raises(TrainerError, match="does not render the turns before and up to assistant turn 3 as a prefix"):
        tokenize_chats([CHAT], chat_tokenizer, source="t")


def test_template_errors_name_the_record(chat_tokenizer) -> None:
    chat_tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TrainerError, match="record 1 of 1: the tokenizer's chat template refused the chat: roles must"):
        tokenize_chats([CHAT], chat_tokenizer, source="t")


def test_a_job_trains_on_a_chat_dataset_with_its_tokenizer(config_dict, chat_tokenizer, tmp_path: Path) -> None:
    chat_tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": CHAT[: 3 + 2 * i]}) + "\n" for i in range(2)))
    base = {"model_name_or_path": "tiny", "tokenizer_name_or_path": str(tmp_path / "tokenizer"), "dtype": "float32"}
    config = parse_config(config_dict(base_model=base, jobs=[{"name": "chat", "dataset": {"path": str(path)}}]))
    tokenizer = load_tokenizer(config.base_model, vocab_size=512)
    data = load_job_data(config, config.jobs[0], tokenizer, 512)
    replies = [chat_tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("hello</s>\n", "4</s>\n")]
    assert sorted(s.num_targets for s in data.samples) == [len(replies[0]), len(replies[0]) + len(replies[1])]


def test_declares_chat_template_reads_the_files_as_transformers_does(tmp_path: Path) -> None:
    """validate judges from the files (without transformers); loading the tokenizer must agree."""
    from transformers import AutoTokenizer

    from lorafusion_megatron.data.tokenizer import declares_chat_template

    plain = tmp_path / "plain"
    byte_level_tokenizer().save_pretrained(plain)
    saved = tmp_path / "saved"
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(saved)
    legacy = tmp_path / "legacy"  # older tokenizers keep the template in tokenizer_config.json
    byte_level_tokenizer().save_pretrained(legacy)
    config = json.loads((legacy / "tokenizer_config.json").read_text())
    (legacy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    named = tmp_path / "named"  # only named templates
    byte_level_tokenizer().save_pretrained(named)
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "tool_use.jinja").write_text(TEMPLATE)
    expected = {plain: False, saved: True, legacy: True, named: True}
    for folder, declared in expected.items():
        assert declares_chat_template(folder) is declared, folder.name
        assert (AutoTokenizer.from_pretrained(folder).chat_template is not None) is declared, folder.name
    assert declares_chat_template(None) is False  # a preset's byte-level tokenizer
