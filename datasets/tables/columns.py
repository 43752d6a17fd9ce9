"""The columns a table source reads, by name and kind, checked against each file's schema.

A kind is what a column holds and the tensor a row of it becomes:

* ``'text'``: a string (``string``, ``large_string``), a ``tf.string`` of UTF-8;
* ``'bytes'``: bytes (``binary``, ``large_binary``; an image file's, or Hugging Face's
  ``Image`` feature, ``struct<bytes, path>``, its bytes), a ``tf.string``;
* ``'messages'``: a chat, a list of ``{role, content}`` (Parquet's
  ``list<struct<role, content>>``, a JSON list of objects), a ``tf.string`` of its
  turns as JSON (``messages_json``), for a chat template to render;
* ``'integer'``: a whole number (a class id), an ``int64``;
* ``'number'``: a number, a ``float32``.

``check`` refuses, in one line naming the file and the column, a column that is
missing, of another type (a list where text is expected), or that holds nulls
(Parquet's and Arrow's metadata count them, so no row is read to know). Several files
are one source only when their columns agree: the first file's schema is the one the
others are held to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tensorflow as tf

from trainer import UserError


def is_image(found: pa.DataType) -> bool:
    """Hugging Face ``datasets``' ``Image`` feature: ``struct<bytes: binary, path: string>``."""
    if not pa.types.is_struct(found) or found.get_field_index("bytes") < 0:
        return False
    return pa.types.is_binary(found.field("bytes").type)


def is_messages(found: pa.DataType) -> bool:
    """A chat: a list of ``struct<role: string, content: string, ...>``."""
    if not (pa.types.is_list(found) or pa.types.is_large_list(found)):
        return False
    turn = found.value_type
    if not pa.types.is_struct(turn):
        return False
    fields = {turn.field(i).name: turn.field(i).type for i in range(turn.num_fields)}
    return all(pa.types.is_string(fields.get(name, pa.null())) for name in ("role", "content"))


# Each kind: the Arrow types it takes, what to call them in a message, its tensor.
KINDS = {
    "text": ((pa.types.is_string, pa.types.is_large_string), "text (string)", tf.string),
    "bytes": (
        (pa.types.is_binary, pa.types.is_large_binary, is_image),
        "bytes (binary, or an image's {bytes, path})",
        tf.string,
    ),
    "messages": (
        (is_messages,),
        "chat messages (a list of {role, content})",
        tf.string,
    ),
    "integer": ((pa.types.is_integer,), "whole numbers (int)", tf.int64),
    "number": ((pa.types.is_integer, pa.types.is_floating), "numbers", tf.float32),
}


def check_kinds(columns: Mapping[str, str], knob: str) -> dict[str, str]:
    """``columns`` (name: kind) as given in gin, each kind one of ``KINDS``."""
    if not columns:
        raise UserError(f"{knob} names no column: give e.g. {{'text': 'text', 'label': 'integer'}}")
    for name, kind in columns.items():
        if kind not in KINDS:
            raise UserError(
                f"{knob}: column {name!r} has kind {kind!r}; the kinds are {', '.join(KINDS)}"
            )
    return dict(columns)


def check(schema: pa.Schema, columns: Mapping[str, str], path: str) -> None:
    """Refuses a schema without each column, or with one of another kind, in one line."""
    for name, kind in columns.items():
        index = schema.get_field_index(name)
        if index < 0:
            raise UserError(
                f"{path}: no column {name!r} (it has {', '.join(schema.names)}): name one "
                "of its columns"
            )
        found = schema.field(index).type
        takes, said, _ = KINDS[kind]
        if not any(test(found) for test in takes):
            raise UserError(f"{path}: column {name!r} is {found}, not {said}: {_hint(found, kind)}")


def check_same(schema: pa.Schema, first: pa.Schema, columns, path: str, first_path: str) -> None:
    """Refuses a file whose columns differ from the first file's, naming the column."""
    for name in columns:
        mine, theirs = _type(schema, name), _type(first, name)
        if mine != theirs:
            raise UserError(
                f"{path}: column {name!r} is {mine} here but {theirs} in {first_path}: one "
                "source's files must share their columns' types; rewrite one, or read them "
                "as two sources"
            )


def check_no_nulls(nulls: int, name: str, where: str) -> None:
    """Refuses a column that holds nulls (``nulls`` of them, ``where``)."""
    if nulls:
        raise UserError(
            f"{where}: column {name!r} holds {nulls} null value(s): drop or fill those rows "
            "(e.g. with pyarrow.compute.fill_null) before training on it"
        )


def dtypes(columns: Mapping[str, str]) -> tuple[tf.DType, ...]:
    """The tensor type of each column, in ``columns``' order."""
    return tuple(KINDS[kind][2] for kind in columns.values())


def to_numpy(array: pa.Array | pa.ChunkedArray, kind: str) -> np.ndarray:
    """A column's values as the numpy array its tensor is made of."""
    if kind == "bytes" and is_image(array.type):
        array = pc.struct_field(array, "bytes")
    if kind == "messages":
        return np.asarray([messages_json(chat) for chat in array.to_pylist()], object)
    if kind in ("text", "bytes"):
        return np.asarray(array.to_pylist(), object)
    return array.to_numpy().astype(np.int64 if kind == "integer" else np.float32)


def messages_json(chat: list[dict]) -> bytes:
    """A chat as its tensor holds it: JSON of its turns' role and content, in order."""
    turns = [{"role": turn["role"], "content": turn["content"]} for turn in chat]
    return json.dumps(turns, ensure_ascii=False).encode()


def one_line(error: Exception) -> str:
    """A library's error message on one line (pyarrow's may hold several)."""
    return " ".join(str(error).split())


def empty(count: int, kind: str) -> np.ndarray:
    """A column's values to fill, of its tensor's type (a failed read returns them so)."""
    if KINDS[kind][2] == tf.string:
        return np.full(count, b"", object)
    return np.zeros(count, np.int64 if kind == "integer" else np.float32)


def _type(schema: pa.Schema, name: str):
    index = schema.get_field_index(name)
    return schema.field(index).type if index >= 0 else "missing"


def _hint(found, kind: str) -> str:
    if kind == "text" and (pa.types.is_list(found) or pa.types.is_large_list(found)):
        return "a list (chat messages, or tokens) is not text: name a column of strings"
    return f"name a column of {KINDS[kind][1]}, or give this one's kind"
