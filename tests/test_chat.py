"""Chat templates (datasets/chat/templates.py): two public models' templates render a
chat to the text their tokenizers make, the assistant's spans marked; each bad
template or chat is one line."""

import json

import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from datasets.chat.templates import CHATML, ChatTemplate, check_chat
from tests.support.chats import ZEPHYR, ZEPHYR_MARKED
from trainer import UserError

CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Add two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "And «é»?"},
    {"role": "assistant", "content": "'é'"},
]


def test_chatml_renders_the_text_and_marks_each_answer_with_its_end():
    rendered = ChatTemplate(CHATML).render(CHAT)
    assert rendered.text == (
        "<|im_start|>system\nYou write Python.<|im_end|>\n"
        "<|im_start|>user\nAdd two numbers.<|im_end|>\n"
        "<|im_start|>assistant\ndef add(a, b):\n    return a + b<|im_end|>\n"
        "<|im_start|>user\nAnd «é»?<|im_end|>\n"
        "<|im_start|>assistant\n'é'<|im_end|>\n"
    )
    assert rendered.assistant() == [
        "def add(a, b):\n    return a + b<|im_end|>\n",
        "'é'<|im_end|>\n",
    ]
    prompt = ChatTemplate(CHATML).render(CHAT[:2], add_generation_prompt=True, where="p")
    assert prompt.text.endswith(
        "<|im_start|>user\nAdd two numbers.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_zephyr_from_a_model_directory_with_its_end_token(tmp_path):
    """A Hugging Face-layout directory: tokenizer_config.json's chat_template and its
    eos_token (as the config keeps it, a dict with its content)."""
    config = {"chat_template": ZEPHYR_MARKED, "eos_token": {"content": "</s>", "lstrip": False}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = ChatTemplate.from_directory(str(tmp_path)).render(CHAT)
    assert rendered.text == (
        "<|system|>\nYou write Python.</s>\n"
        "<|user|>\nAdd two numbers.</s>\n"
        "<|assistant|>\ndef add(a, b):\n    return a + b</s>\n"
        "<|user|>\nAnd «é»?</s>\n"
        "<|assistant|>\n'é'</s>\n"
    )
    assert rendered.assistant() == ["def add(a, b):\n    return a + b</s>", "'é'</s>"]
    shipped = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    as_shipped = shipped.from_string(ZEPHYR).render(messages=CHAT, eos_token="</s>")
    assert rendered.text == as_shipped  # the marks change no character
    (tmp_path / "chat_template.jinja").write_text(CHATML)  # the newer layout wins
    assert ChatTemplate.from_directory(str(tmp_path)).render(CHAT).text.startswith("<|im_start|>")


def test_a_template_as_shipped_without_a_generation_span_is_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ZEPHYR}))
    with pytest.raises(UserError, match=r"tokenizer_config\.json: the chat template marks no "):
        ChatTemplate.from_directory(str(tmp_path))
    with pytest.raises(UserError, match=r"^t\.jinja:1: the chat template does not parse \("):
        ChatTemplate("{% for m in messages %}{{ m }}", "t.jinja")
    with pytest.raises(UserError, match=r": no chat template \(neither chat_template\.jinja"):
        ChatTemplate.from_directory(str(tmp_path / ".."))


@pytest.mark.parametrize(
    "chat, expected",
    [
        (CHAT[1:2] + CHAT[1:3], r"turn 2 is 'user' where 'assistant' comes: roles go"),
        (CHAT[2:3], r"turn 1 is 'assistant' where 'user' comes"),
        (CHAT[:2] + [{"role": "assistant", "content": "  "}], r"turn 3 \(assistant\) is empty"),
        ([], r"a chat is a non-empty list"),
    ],
)
def test_chats_out_of_order_or_with_an_empty_answer_are_one_line(chat, expected):
    with pytest.raises(UserError, match=rf"^chats\.jsonl:7: {expected}"):
        check_chat(chat, "chats.jsonl:7")


def test_a_template_that_raises_or_leaves_an_answer_unmarked_is_one_line():
    raising = CHATML.replace(
        "{% for message in messages %}",
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}"
        "{% endif %}{% for message in messages %}",
    )
    with pytest.raises(UserError, match=r"^c1: chat template refused it: no system turns$"):
        ChatTemplate(raising).render(CHAT, where="c1")
    unmarked = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% generation %}{% endgeneration %}"
    )
    with pytest.raises(UserError, match=r"^c2: t rendered the assistant's answer 'def add"):
        ChatTemplate(unmarked, "t").render(CHAT, where="c2")


def test_the_assistant_mask_of_bytes_and_of_tokens_that_straddle_a_span():
    """Over the bytes tokenizer's ids, exactly the answers' bytes (their end marks too);
    non-ASCII text counted in bytes, not characters. A token that straddles a span's
    edge is the assistant's, as Hugging Face marks it."""
    rendered = ChatTemplate(CHATML).render(CHAT)
    ids, mask = rendered.bytes_and_mask()
    assert bytes(int(i) - 1 for i in ids).decode() == rendered.text
    marked = bytes(int(i) - 1 for i in ids[mask]).decode()
    assert marked == "def add(a, b):\n    return a + b<|im_end|>\n'é'<|im_end|>\n"
    data = rendered.text.encode()
    (first, _), (second, end) = rendered.byte_spans().tolist()
    assert data[second:end] == "'é'<|im_end|>\n".encode() and end == len(data)
    starts = np.asarray([0, first - 2, first + 3, end - 1])
    ends = np.asarray([first - 2, first + 1, first + 5, end])
    assert rendered.token_mask(starts, ends).tolist() == [False, True, True, True]
