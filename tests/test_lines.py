"""JSON lines and CSV read in place (datasets/tables/lines.py): each row by its byte
offsets, the offsets kept beside the file; a changed file, a line that is not JSON, a
ragged CSV row: one line each, naming the file, the line and the byte."""

import csv
import json
import os

import gin
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from datasets import pipeline
from datasets.records import indexed
from datasets.tables import input_fns, lines
from datasets.tables import source as table
from trainer import InputParams, Mode, UserError, errors

# Text a CSV must quote: commas, quotes, line breaks (Windows' too), and not ASCII.
TEXTS = [f'doc {i}, "said" {"good " * (i % 5)}\nnext line\r\nlast é{i}' for i in range(240)]
LABELS = ["pos" if i % 3 else "neg" for i in range(240)]


@pytest.fixture(autouse=True)
def fresh():
    table.MADE.clear()
    lines._INDEXED.clear()
    yield
    table.MADE.clear()
    lines._INDEXED.clear()
    gin.clear_config()


def write_jsonl(path, rows, blank_every=50):
    with open(path, "w", encoding="utf-8", newline="") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(row, ensure_ascii=False) + ("\r\n" if i % 2 else "\n"))
            if i % blank_every == 7:
                f.write("\n" if (i // blank_every) % 2 else "\r\n")  # blank lines: no rows
    return str(path)


def write_csv(path, rows, bom=True):
    with open(path, "w", encoding="utf-8-sig" if bom else "utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))  # Excel's dialect: "\r\n"
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def rows_of(texts=TEXTS, labels=LABELS):
    return [{"text": t, "label": label} for t, label in zip(texts, labels, strict=True)]


def batches(dataset, count):
    return [tf.nest.map_structure(lambda t: t.numpy(), b) for b in dataset.take(count)]


def test_json_lines_and_csv_give_the_batches_parquet_gives(tmp_path):
    """The same rows three ways, quoted line breaks, a byte-order mark, Windows line
    ends and blank lines among them: evaluation's batches are equal, and training read
    by index from disk makes the batches it makes with the rows held in memory."""
    rows_table = pa.Table.from_pylist(rows_of())
    parquet = str(tmp_path / "t.parquet")
    pq.write_table(rows_table, parquet, row_group_size=60)
    sources = {
        "parquet": parquet,
        "jsonl": write_jsonl(tmp_path / "t.jsonl", rows_of()),
        "csv": write_csv(tmp_path / "t.csv", rows_of()),
    }
    params = InputParams(batch_size=64, global_batch_size=64)
    found = {}
    for name, where in sources.items():
        dataset = input_fns.input_fn(Mode.EVAL, params, train=where, eval=where, longest=80)
        found[name] = batches(dataset, 10)
    assert sum(len(b[1]["label"]) for b in found["jsonl"]) == 240
    for name in ("jsonl", "csv"):
        for theirs, parquets in zip(found[name], found["parquet"], strict=True):
            tf.nest.map_structure(np.testing.assert_array_equal, theirs, parquets)
    first = bytes(int(t) - 1 for t in found["csv"][0][0]["tokens"][0] if t).decode()
    assert first == TEXTS[0][:80].encode()[:80].decode()
    assert os.path.isfile(sources["csv"] + indexed.INDEX_SUFFIX)  # kept beside the file

    def train(memory_limit_mb):
        table.MADE.clear()
        gin.bind_parameter("pipeline.memory_limit_mb", memory_limit_mb)
        read = InputParams(batch_size=32, global_batch_size=32, seed=3)
        return batches(input_fns.input_fn(Mode.TRAIN, read, train=sources["jsonl"]), 9)

    for disk, memory in zip(train(0), train(None), strict=True):
        tf.nest.map_structure(np.testing.assert_array_equal, disk, memory)


def test_the_index_is_made_once_and_made_again_when_the_file_changes(tmp_path, caplog):
    """The second start reads the index kept beside the file; a file rewritten since is
    indexed again, with a warning, and its new rows are read."""
    path = write_jsonl(tmp_path / "t.jsonl", rows_of())
    index = path + indexed.INDEX_SUFFIX
    assert len(lines.LineRows([path], {"text": "text"})) == 240
    made = os.stat(index).st_mtime_ns
    lines._INDEXED.clear()
    with caplog.at_level("INFO"):
        again = lines.LineRows([path], {"text": "text"})
    assert len(again) == 240 and os.stat(index).st_mtime_ns == made
    assert not [r for r in caplog.records if "Indexing" in r.getMessage()]
    write_jsonl(path, rows_of(TEXTS[:100], LABELS[:100]))
    os.utime(index, ns=(made - 10**9, made - 10**9))  # older than the file
    lines._INDEXED.clear()
    caplog.clear()
    with caplog.at_level("WARNING"):
        rewritten = lines.LineRows([path], {"text": "text", "label": "text"})
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"{path} changed since its index {index} was made; indexing it again"]
    values, problem = rewritten._read(np.array([99, 0]))
    assert problem == "" and values[0][0].decode() == TEXTS[99]


def test_a_file_changed_during_training_fails_its_next_read_in_one_line(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", rows_of())
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    params = InputParams(batch_size=16, global_batch_size=16, seed=1)
    dataset = iter(input_fns.input_fn(Mode.TRAIN, params, train=path))
    next(dataset)
    size = os.path.getsize(path)
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more", "label": "pos"}) + "\n")
    expected = (
        rf"^training: {path} changed since it was indexed "
        rf"\({size:,} bytes then, {size + 37:,} now\): its rows' offsets are stale; restart the "
        "run to index it again, or leave the file alone while training reads it$"
    )
    with pytest.raises(UserError, match=expected):
        with errors.runtime_errors("training"):
            for _ in range(40):  # past the batches read ahead before the change
                next(dataset)


def test_a_folder_that_cannot_be_written_to_is_indexed_at_each_start(tmp_path, monkeypatch):
    """(Run as root here, no folder is read-only: the save is made to fail instead.)"""
    path = write_csv(tmp_path / "t.csv", rows_of())

    def refused(*_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(indexed, "write_index", refused)
    rows = lines.LineRows([path], {"text": "text", "label": "text"})
    assert len(rows) == 240 and not os.path.exists(path + indexed.INDEX_SUFFIX)
    assert rows._read(np.array([5]))[0][0][0].decode() == TEXTS[5]


# ---------------------------------------------------------------- bad input, one line each


def _line_and_byte(path, row_text):
    data = open(path, "rb").read()
    at = data.index(row_text.encode())
    return data[:at].count(b"\n") + 1, at


def test_a_json_line_that_is_not_json_is_named_by_its_line_and_byte(tmp_path):
    """In the rows checked at the start, it stops the start; further on, the read of it,
    mid-epoch."""
    rows = [json.dumps(r) for r in rows_of()]
    rows[3] = '{"text": "cut short", "label": "pos"'
    path = tmp_path / "early.jsonl"
    path.write_text("\n".join(rows) + "\n")
    line, at = _line_and_byte(path, rows[3])
    with pytest.raises(UserError, match=rf"^{path}:{line} \(byte {at:,}\): not JSON \("):
        lines.LineRows([str(path)], {"text": "text"})
    rows[3], rows[200] = rows[4], "[1, 2]"
    path = tmp_path / "late.jsonl"
    path.write_text("\n".join(rows) + "\n")
    line, at = _line_and_byte(path, rows[200])
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    source = lines.LineRows([str(path)], {"text": "text"})
    read = pipeline.RecordExamples(source, lambda row: row, "late")
    params = InputParams(batch_size=50, global_batch_size=50)
    dataset = pipeline.build(read, Mode.EVAL, params, lambda e: ({"text": e["text"]}, {}))
    expected = rf"{path}:{line} \(byte {at:,}\): a JSON list, not an object of columns"
    with pytest.raises(UserError, match=rf"^evaluation: {expected}: a JSON lines file holds"):
        with errors.runtime_errors("evaluation"):
            batches(dataset, 10)
    assert line == 201


def test_a_ragged_csv_row_is_named_by_its_line_and_byte(tmp_path):
    path = tmp_path / "t.csv"
    body = "text,label\n" + "".join(f"row {i},pos\n" for i in range(150))
    path.write_text(body.replace("row 120,pos", "row 120,with, a comma,pos"))
    line, at = _line_and_byte(path, "row 120,")
    rows = lines.LineRows([str(path)], {"text": "text", "label": "text"})
    values, problem = rows._read(np.array([119, 120]))
    assert problem == (
        f"{path}:{line} (byte {at:,}): 4 fields where the header row has 2: quote a field "
        "that holds a comma"
    )
    assert line == 122


@pytest.mark.parametrize(
    "case, row, columns, expected",
    [
        ("missing", {"txt": "a"}, {"text": "text"}, r"{p}: no column 'text' \(it has txt\)"),
        (
            "a list as text",
            {"text": [{"role": "user", "content": "hi"}]},
            {"text": "text"},
            r"{p}: column 'text' is list<.*>, not text \(string\): a list \(chat messages",
        ),
        (
            "nulls",
            {"text": None},
            {"text": "text"},
            r"{p} \(first 5 rows\): column 'text' holds 5 null",
        ),
        ("text as ids", {"n": "seven"}, {"n": "integer"}, r"{p}: column 'n' is string, not whole"),
    ],
)
def test_columns_that_do_not_fit_are_refused_naming_the_file_and_column(
    tmp_path, case, row, columns, expected
):
    path = write_jsonl(tmp_path / "t.jsonl", [row] * 5)
    with pytest.raises(UserError, match="^" + expected.format(p=path)):
        lines.LineRows([path], columns)


def test_a_file_among_many_of_another_type_and_empty_sources_are_refused(tmp_path):
    os.makedirs(tmp_path / "d")
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"n": 1}, {"n": 2}])
    other = write_csv(tmp_path / "d" / "b.csv", [{"n": "1.5"}, {"n": "2"}])
    with pytest.raises(UserError, match=rf"^{other}: column 'n' is double here but int64 in "):
        table.rows_of(str(tmp_path / "d"), {"n": "number"})
    write_jsonl(tmp_path / "d" / "c.parquet", [{"n": 1}])
    with pytest.raises(UserError, match=r"holds Parquet files and JSON lines or CSV files"):
        table.rows_of(str(tmp_path / "d"), {"n": "number"})
    (tmp_path / "empty.jsonl").touch()
    with pytest.raises(UserError, match=r"empty\.jsonl: the file is empty \(0 bytes\)"):
        table.rows_of(str(tmp_path / "empty.jsonl"), {"text": "text"})
    (tmp_path / "blank.csv").write_text("\n\n\n")
    with pytest.raises(UserError, match=r"blank\.csv:1: no header row of column names \(empty\)"):
        table.rows_of(str(tmp_path / "blank.csv"), {"text": "text"})
    (tmp_path / "header.csv").write_text("text,label\n")
    with pytest.raises(UserError, match=r"header\.csv: no rows in 1 file"):
        table.rows_of(str(tmp_path / "header.csv"), {"text": "text"})
    os.makedirs(tmp_path / "none")
    (tmp_path / "none" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match=r"no \.parquet, \.pq, \.jsonl, \.json or \.csv file there"):
        table.rows_of(str(tmp_path / "none"), {"text": "text"})


def test_skip_corrupt_leaves_out_lines_that_cannot_be_read_and_says_how_many(tmp_path, caplog):
    """A line cut short among the first rows (their types are still the others'), a row
    without its label, one whose label is of another type: three rows skipped, the
    rest trained on from disk in the full shuffle, every row once an epoch."""
    rows = [json.dumps({"text": f"r{i}", "label": i % 2}) for i in range(200)]
    rows[2] = rows[2][:-3]
    rows[150] = json.dumps({"text": "r150"})
    rows[160] = json.dumps({"text": "r160", "label": "one"})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    source = table.Source(str(path), skip_corrupt=True)
    with caplog.at_level("WARNING"):
        kept = source.rows({"text": "text", "label": "integer"})
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    line, at = _line_and_byte(path, rows[150])
    assert len(kept) == 197 and warned[1] == (
        f"tables.input_fn.skip_corrupt ({path}): skipping 1 example(s): {path}:{line} "
        f"(byte {at:,}): column 'label' is missing: give every row a value, or drop the row"
    )
    assert warned[-1].endswith(
        "skipped 3 of 200 examples in all (3 problem(s), the first 3 said above)"
    )
    read = pipeline.RecordExamples(kept, lambda row: row, "texts")
    params = InputParams(batch_size=197, global_batch_size=197, seed=2)
    texts = lambda e: ({"text": e["text"]}, {})  # noqa: E731
    (epoch,) = batches(pipeline.build(read, Mode.TRAIN, params, texts), 1)
    expected = {f"r{i}".encode() for i in set(range(200)) - {2, 150, 160}}
    assert len(epoch[0]["text"]) == 197 and set(epoch[0]["text"]) == expected


def test_a_messages_column_reads_alike_from_json_lines_and_parquet(tmp_path):
    """Chats chosen by name, each row's turns (role and content, in order; other keys
    left) as one JSON string for a chat template to render; a column of another shape
    is one line."""
    chats = [
        [
            {"role": "user", "content": f"What does f{i} do?", "name": "x"},
            {"role": "assistant", "content": f"It returns {i}, «é»."},
        ]
        for i in range(30)
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in chats])
    parquet = str(tmp_path / "chats.parquet")
    pq.write_table(pa.table({"messages": chats}), parquet, row_group_size=8)
    expected = [
        json.dumps([{k: t[k] for k in ("role", "content")} for t in c], ensure_ascii=False)
        for c in chats
    ]
    for where in (path, parquet):
        rows = table.rows_of(where, {"messages": "messages"})
        values, problem = rows._read(np.arange(30))
        assert problem == "" and [v.decode() for v in values[0]] == expected
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": ["hi", "hello"]}] * 3)
    with pytest.raises(
        UserError, match=r"column 'messages' is list<item: string>, not chat messages"
    ):
        table.rows_of(bad, {"messages": "messages"})
