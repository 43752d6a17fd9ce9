"""Chat templates as Hugging Face tokenizers keep them, rendered with the assistant's spans.

A model's chat template is Jinja: ``chat_template`` in its ``tokenizer_config.json``
(a string, or a list of named templates of which ``default`` is used), or the file
``chat_template.jinja`` beside it. It turns a chat, ``[{role, content}, ...]``, into
the text the model reads. A template made for training marks the assistant's part
with ``{% generation %}...{% endgeneration %}``: what a loss over the assistant's
tokens alone counts. ``ChatTemplate.render`` returns the text and those spans (character
offsets), found as the template renders: each span starts where the text rendered so
far ends.

Templates are run in Jinja's immutable sandbox, with what Hugging Face gives them:
``raise_exception``, a ``tojson`` that keeps non-ASCII text, ``loopcontrols``,
``trim_blocks`` and ``lstrip_blocks``, and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables.

Refused in one line each: a template that does not parse (its line), one with no
generation span, a chat whose roles are out of order (a system turn first if any,
then user and assistant by turns), an assistant turn with no content, and a template
that raises (its own message).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trainer import UserError

CONFIG, JINJA = "tokenizer_config.json", "chat_template.jinja"
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")  # variables a template may use

# ChatML, the format of Qwen2.5's and SmolLM2's templates, each assistant turn and its
# end marked with {% generation %}, as Hugging Face's chat-template guide marks them
# for training: the template used when none is named.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILT_IN = {"chatml": CHATML}


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A chat's text, and the ``(start, end)`` character offsets of its assistant spans."""

    text: str
    spans: tuple[tuple[int, int], ...]

    def assistant(self) -> list[str]:
        """The text of each assistant span."""
        return [self.text[start:end] for start, end in self.spans]

    def byte_spans(self) -> np.ndarray:
        """The spans as ``[start, end)`` offsets in the text's UTF-8 bytes, ``[spans, 2]``."""
        said = np.asarray(self.spans, np.int64).reshape(-1, 2)
        sizes = np.fromiter((len(c.encode()) for c in self.text), np.int64, len(self.text))
        before = np.concatenate([[0], np.cumsum(sizes)])  # bytes before each character
        return before[said]

    def token_mask(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Which tokens are the assistant's.

        Each token is given by its ``[start, end)`` byte offsets in the text; it is the
        assistant's when it overlaps a span, as Hugging Face's
        ``return_assistant_tokens_mask`` marks a token holding any of a span's characters.
        """
        spans = self.byte_spans()
        starts, ends = np.asarray(starts)[:, None], np.asarray(ends)[:, None]
        return ((starts < spans[:, 1]) & (ends > spans[:, 0])).any(axis=1)

    def bytes_and_mask(self) -> tuple[np.ndarray, np.ndarray]:
        """The text as the ``bytes`` tokenizer's ids, and which are the assistant's.

        Each UTF-8 byte is one id, the byte plus one (0 pads).
        """
        ids = np.frombuffer(self.text.encode(), np.uint8).astype(np.int64) + 1
        at = np.arange(len(ids))
        return ids, self.token_mask(at, at + 1)


class ChatTemplate:
    """A chat template, checked: it parses and marks the assistant's part.

    Args:
      source: the template's Jinja text.
      name: where it came from, for messages (a file, or the gin binding).
      special: the tokenizer's special tokens the template may name (``eos_token``).
    """

    def __init__(self, source: str, name: str = "chat template", special: dict | None = None):
        self.source, self.name, self.special = source, name, dict(special or {})
        self._env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[Spans, "jinja2.ext.loopcontrols"],
        )
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise UserError(
                f"{name}:{error.lineno}: the chat template does not parse ({error.message})"
            ) from None
        if not _marks_generation(self._env, source):
            raise UserError(
                f"{name}: the chat template marks no {{% generation %}} span, so the "
                "assistant's tokens cannot be told from the rest: wrap each assistant "
                "message in {% generation %}...{% endgeneration %} (Hugging Face's "
                "return_assistant_tokens_mask needs the same)"
            )
        self._lock = threading.Lock()  # one render at a time: the spans are the env's

    @classmethod
    def from_directory(cls, path: str) -> ChatTemplate:
        """The template of a Hugging Face-layout model directory, with its special tokens."""
        config = _config(path)
        source, name = _source(path, config)
        special = {key: _token(config[key]) for key in SPECIAL if config.get(key)}
        return cls(source, name, special)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False, where: str = "chat"
    ) -> Rendered:
        """The chat's text and assistant spans; ``where`` names it in a refusal."""
        check_chat(messages, where)
        spans = self._env.extensions[Spans.identifier]
        with self._lock:
            spans.start()
            rendered = []
            try:
                for chunk in self._template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **self.special
                ):
                    spans.rendered += len(chunk)
                    rendered.append(chunk)
            except jinja2.TemplateError as error:
                raise UserError(f"{where}: {self.name} refused it: {error.message}") from None
            found = tuple(spans.found)
        result = Rendered("".join(rendered), found)
        _check_spans(result, messages, where, self.name)
        return result


def template_of(given: str) -> ChatTemplate:
    """A template by name (``BUILT_IN``: 'chatml'), model directory or Jinja file.

    A Hugging Face-layout directory gives its own template and special tokens
    (``ChatTemplate.from_directory``); a file is the template's Jinja text.
    """
    if given in BUILT_IN:
        return ChatTemplate(BUILT_IN[given], given)
    if os.path.isdir(given):
        return ChatTemplate.from_directory(given)
    if not os.path.isfile(given):
        raise UserError(
            f"chat template {given!r}: no such file or model directory; name "
            f"{' or '.join(map(repr, BUILT_IN))}, a model directory with {CONFIG} or {JINJA}, "
            "or a Jinja file"
        )
    with open(given, encoding="utf-8") as f:
        return ChatTemplate(f.read(), given)


class Spans(Extension):
    """``{% generation %}...{% endgeneration %}``: the body rendered, its offsets kept."""

    tags = {"generation"}

    def start(self) -> None:
        """Forgets the last render's spans."""
        self.rendered, self.found = 0, []

    def parse(self, parser):
        """The tag's body, called back when rendered."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

    def _span(self, caller) -> str:
        text = caller()  # rendered in full before the generator yields it
        self.found.append((self.rendered, self.rendered + len(text)))
        return text


def check_chat(messages, where: str) -> None:
    """Refuses a chat that is not ``[system?] (user, assistant)+`` with contents, in one line."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: a chat is a non-empty list of {{role, content}} turns")
    expected = "user"
    for number, turn in enumerate(messages, 1):
        role = turn.get("role") if isinstance(turn, dict) else None
        if number == 1 and role == "system":
            continue
        if role != expected:
            raise UserError(
                f"{where}: turn {number} is {role!r} where {expected!r} comes: roles go a "
                "system turn first if any, then user and assistant by turns"
            )
        if role == "assistant" and not str(turn.get("content") or "").strip():
            raise UserError(
                f"{where}: turn {number} (assistant) is empty: there is nothing to learn from "
                "it; drop the chat or give the answer"
            )
        expected = "assistant" if role == "user" else "user"


def _check_spans(rendered: Rendered, messages: list[dict], where: str, name: str) -> None:
    """Refuses a render whose spans miss an assistant turn's content."""
    answers = [t["content"] for t in messages if t.get("role") == "assistant"]
    marked = rendered.assistant()
    missing = [a for a in answers if not any(a in span for span in marked)]
    if missing:
        raise UserError(
            f"{where}: {name} rendered the assistant's answer {missing[0][:40]!r} outside "
            "its {% generation %} spans: put the message's content inside them"
        )


def _marks_generation(env: jinja2.Environment, source: str) -> bool:
    """Whether the template has a ``{% generation %}`` tag (not the word elsewhere)."""
    tokens = [(kind, value) for _, kind, value in env.lex(source) if kind != "whitespace"]
    return any(
        kind == "block_begin" and following == ("name", "generation")
        for (kind, _), following in zip(tokens, tokens[1:], strict=False)
    )


def _config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG)
    if not os.path.isfile(config_path):
        return {}
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        said = f"{config_path}: not JSON ({error}): copy the model's files again"
        raise UserError(said) from None


def _source(path: str, config: dict) -> tuple[str, str]:
    """The template's text and where it lies: chat_template.jinja, or the config's."""
    jinja_path = os.path.join(path, JINJA)
    if os.path.isfile(jinja_path):
        with open(jinja_path) as f:
            return f.read(), jinja_path
    found = config.get("chat_template")
    if isinstance(found, list):  # named templates: the default one
        found = next((t.get("template") for t in found if t.get("name") == "default"), None)
    if not isinstance(found, str):
        raise UserError(
            f"{path}: no chat template (neither {JINJA} nor a chat_template in {CONFIG}): "
            "give the template in gin, or a model directory that has one"
        )
    return found, os.path.join(path, CONFIG)


def _token(value) -> str:
    """A special token as the config keeps it: its text, or ``{"content": text, ...}``."""
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _tojson(value, indent=None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str):
    raise jinja2.TemplateError(message)
