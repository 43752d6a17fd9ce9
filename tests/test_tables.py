"""Tables read where they lie (datasets/tables/): Parquet files and save_to_disk folders,
by index, in the window order of their row groups; each bad input one line."""

import json
import os
import subprocess
import sys

import gin
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from datasets import order, pipeline
from datasets.tables import arrow, input_fns
from datasets.tables import source as table
from datasets.tables.parquet import ParquetRows
from tests.support.helpers import REPO, finish, resume_run
from tests.support.workers import free_ports, tf_config
from trainer import InputParams, Mode, UserError, errors

TEXTS = [("good " if i % 2 else "bad ") * (1 + i % 7) + f"n{i}" for i in range(300)]
LABELS = ["pos" if i % 2 else "neg" for i in range(300)]


@pytest.fixture(autouse=True)
def fresh():
    """Each test reads its own files: the sources read once a process are forgotten."""
    table.MADE.clear()
    yield
    table.MADE.clear()
    gin.clear_config()


def write_parquet(path, columns: dict, row_group_size=40):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return str(path)


def save_to_disk(table: pa.Table, folder, shards=2) -> str:
    """``folder`` as datasets' ``Dataset.save_to_disk`` lays it out (datasets 2 to 4):
    Arrow IPC streams named data-0000k-of-0000n.arrow, state.json listing them in its
    _data_files, and dataset_info.json. (datasets itself is not installed here, and
    this project's own ``datasets`` package would shadow it.)"""
    os.makedirs(folder)
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    bounds = np.linspace(0, table.num_rows, shards + 1).astype(int)
    for name, start, end in zip(names, bounds, bounds[1:], strict=False):
        with pa.OSFile(os.path.join(folder, name), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table.slice(start, end - start), max_chunksize=50)
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump(state, f)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"citation": "", "description": "", "features": {}}, f)
    return str(folder)


def batches(dataset, count):
    return [tf.nest.map_structure(lambda t: t.numpy(), b) for b in dataset.take(count)]


# ---------------------------------------------------------------- the window order


def test_the_window_order_reads_each_row_once_an_epoch_a_window_of_blocks_at_a_time():
    blocks = [5, 7, 3, 10, 1, 6, 9, 4]
    n, window = sum(blocks), 3
    read = order.Order([n], seed=3, windows=[order.Windows(blocks, window)])
    rows = read.rows(tf.range(3 * n)).numpy()
    block_of = np.searchsorted(np.cumsum(blocks), rows, side="right")
    for epoch in range(3):
        seen = slice(epoch * n, (epoch + 1) * n)
        assert sorted(rows[seen]) == list(range(n))  # each row once
        _assert_read_in_windows(block_of[seen], window)
    assert not np.array_equal(rows[:n], rows[n : 2 * n])  # epochs differ
    # a pure function of the position: any positions, in any shape, alone
    picked = tf.constant([[n - 1, n], [2 * n + 5, 0]])
    assert read.rows(picked).numpy().tolist() == [
        [rows[n - 1], rows[n]],
        [rows[2 * n + 5], rows[0]],
    ]


def _assert_read_in_windows(block_of: np.ndarray, window: int) -> None:
    """The blocks, in the order they are first read, come ``window`` at a time: every
    row of one window's blocks is read before any row of the next window's."""
    first, last = {}, {}
    for position, block in enumerate(block_of.tolist()):
        first.setdefault(block, position)
        last[block] = position
    ordered = sorted(first, key=first.get)
    windows = [ordered[i : i + window] for i in range(0, len(ordered), window)]
    assert len(windows) > 1
    for one, following in zip(windows, windows[1:], strict=False):
        assert max(last[b] for b in one) < min(first[b] for b in following)


def test_a_window_of_every_block_is_a_full_shuffle_and_refuses_a_window_of_none():
    read = order.Order([10], seed=1, windows=[order.Windows([4, 6], 2)])
    assert sorted(read.rows(tf.range(10)).numpy()) == list(range(10))
    with pytest.raises(UserError, match="a window of 0 blocks: give at least 1"):
        order.Windows([4, 6], 0)


# ---------------------------------------------------------------- reading in place


def test_parquet_rows_are_read_by_index_through_the_pipeline_from_disk(tmp_path):
    """Larger than memory allows: each batch's rows read from their row groups, in the
    window order; a group decoded about once an epoch; evaluation reads each row once."""
    path = write_parquet(tmp_path / "t.parquet", {"id": np.arange(300), "text": TEXTS})
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    rows = table.rows_of(path, {"id": "integer"}, window=2)
    source = pipeline.RecordExamples(rows, lambda row: row, "ids")
    params = InputParams(batch_size=30, global_batch_size=30, seed=5)
    ids = lambda e: ({"id": e["id"]}, {})  # noqa: E731
    read = batches(pipeline.build(source, Mode.TRAIN, params, ids), 20)  # two epochs
    expected = order.Order([300], seed=5, windows=[rows.windows])
    stream = np.concatenate([b[0]["id"] for b in read])
    assert stream.tolist() == expected.rows(tf.range(600)).numpy().tolist()
    assert sorted(stream[:300]) == list(range(300))
    fresh = ParquetRows([path], {"id": "integer"}, window=2)
    for start in range(0, 600, 30):  # the same two epochs, read in batches of 30
        fresh._read(expected.rows(tf.range(start, start + 30)).numpy())
    assert 8 < fresh.decoded.decodes <= 2 * 8  # each of 8 groups at most once an epoch
    whole = InputParams(batch_size=64, global_batch_size=64)
    evaluated = pipeline.build(source, Mode.EVAL, whole, ids)
    assert np.concatenate([b[0]["id"] for b in batches(evaluated, 10)]).tolist() == list(range(300))


def test_a_parquet_folder_and_a_save_to_disk_folder_give_the_same_batches(tmp_path):
    rows_table = pa.table({"text": TEXTS, "label": LABELS})
    os.makedirs(tmp_path / "parts" / "sub")
    pq.write_table(rows_table.slice(0, 120), tmp_path / "parts" / "a.parquet", row_group_size=50)
    pq.write_table(
        rows_table.slice(120), tmp_path / "parts" / "sub" / "b.parquet", row_group_size=50
    )
    saved = save_to_disk(rows_table, tmp_path / "saved")
    params = InputParams(batch_size=8, global_batch_size=8, seed=2)
    found = {}
    for name, where in (("parquet", str(tmp_path / "parts")), ("arrow", saved)):
        dataset = input_fns.input_fn(Mode.EVAL, params, train=where, eval=where, tokenizer="words")
        found[name] = batches(dataset, 3)
    for left, right in zip(found["parquet"], found["arrow"], strict=True):
        np.testing.assert_array_equal(left[0]["tokens"], right[0]["tokens"])
        np.testing.assert_array_equal(left[1]["label"], right[1]["label"])
    assert found["arrow"][0][1]["label"].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]  # neg, pos
    glob = table.rows_of(str(tmp_path / "parts" / "**" / "*.parquet"), {"text": "text"})
    assert glob.windows.sizes.tolist() == [50, 50, 20, 50, 50, 50, 30]  # 3 + 4 row groups


def test_eval_fraction_holds_out_the_rows_prepare_holds_out(tmp_path):
    path = write_parquet(tmp_path / "f.parquet", {"text": TEXTS, "label": np.arange(300) % 3})
    params = InputParams(batch_size=300, global_batch_size=300)
    held = input_fns.input_fn(
        Mode.EVAL, params, train=path, eval_fraction=0.1, tokenizer="bytes", longest=4000
    )
    (features, labels), *_ = batches(held, 1)
    assert len(labels["label"]) == 30  # the 10th, 20th, ... row
    first = bytes(int(t) - 1 for t in features["tokens"][0] if t).decode()
    assert first == TEXTS[9] and labels["label"][0] == 9 % 3
    training = table.held_out_rows(table.rows_of(path, {"text": "text"}), 0.1, keep=False)
    assert len(training) == 270 and 9 not in training.kept and 8 in training.kept
    assert training.windows.sizes.sum() == 270  # its windows keep the row groups


# ---------------------------------------------------------------- several sources


def test_sources_mixed_by_weight_make_the_same_stream_from_disk_in_memory_or_both(tmp_path):
    """A Parquet file and a JSON lines file mixed 3 to 1: read from disk, held in
    memory, or one of each (the small one fits the limit, the large does not), the
    training batches are the same, from step 0 and from a resume; 3 of 4 examples
    come from the first. Their classes are the union of both; evaluation reads each
    row of each once, one source after the other."""
    small = write_parquet(
        tmp_path / "a.parquet",
        {"text": [f"a{i}" for i in range(40)], "label": ["neg", "pos"] * 20},
        row_group_size=10,
    )
    large = tmp_path / "b.jsonl"
    labels = ["neu", "pos"]
    large.write_text(
        "".join(
            json.dumps({"text": f"b{i} " + "w" * 40, "label": labels[i % 2]}) + "\n"
            for i in range(400)
        )
    )
    both = [small, str(large)]

    def train(memory_limit_mb, start=0, count=6):
        table.MADE.clear()
        gin.bind_parameter("pipeline.memory_limit_mb", memory_limit_mb)
        params = InputParams(32, 32, seed=7, start_example=start)
        dataset = input_fns.input_fn(Mode.TRAIN, params, train=both, weights=[3, 1], longest=8)
        return batches(dataset, count)

    from_disk = train(0)
    sizes = {
        "a": table.rows_of(small, {"text": "text", "label": "text"}).nbytes,
        "b": os.path.getsize(large),
    }
    assert sizes["a"] < 4096 < sizes["b"]
    for other in (train(None), train(4096 / 2**20)):  # in memory; one in, one out
        for disk, memory in zip(from_disk, other, strict=True):
            tf.nest.map_structure(np.testing.assert_array_equal, disk, memory)
    resumed = train(0, start=64, count=4)
    for again, straight in zip(resumed, from_disk[2:], strict=True):
        tf.nest.map_structure(np.testing.assert_array_equal, again, straight)
    first = np.concatenate([b[0]["tokens"][:, 0] for b in from_disk])
    assert abs(np.mean(first == ord("a") + 1) - 0.75) < 0.1
    classes = table.classes_of(table.sources_of(both, None, "text", "label", 8, False))
    assert classes == ["neg", "neu", "pos"]
    params = InputParams(64, 64)
    evaluated = input_fns.input_fn(Mode.EVAL, params, train=both, eval=both, longest=8)
    read = batches(evaluated, 20)
    tokens = np.concatenate([b[0]["tokens"] for b in read])
    texts = [bytes(int(t) - 1 for t in row if t).decode().split()[0] for row in tokens]
    assert texts == [f"a{i}" for i in range(40)] + [f"b{i}" for i in range(400)]
    assert np.concatenate([b[1]["label"] for b in read])[:4].tolist() == [0, 2, 0, 2]


# ---------------------------------------------------------------- a language model's documents


def test_documents_for_a_language_model_read_in_place_packed_as_held_in_memory(tmp_path):
    """Each row's text one example: its bytes' ids, and the same shifted by one ending
    in the end-of-document id (257, so 258 ids in all), cut at ``longest``; packed
    several to a row with segment ids, the batches read from disk are those held in
    memory."""
    path = write_parquet(tmp_path / "docs.parquet", {"text": TEXTS}, row_group_size=50)
    params = InputParams(16, 16)
    evaluated = input_fns.documents_input_fn(Mode.EVAL, params, train=path, eval=path, longest=20)
    (features, labels), *_ = batches(evaluated, 1)
    short = [b + 1 for b in TEXTS[1].encode()]  # 7 bytes: whole, then the end
    assert features["tokens"][1].tolist() == short + [0] * (20 - len(short))
    assert labels["targets"][1].tolist() == short[1:] + [257] + [0] * (20 - len(short))
    cut = [b + 1 for b in TEXTS[13].encode()]  # 38 bytes: its first 20, no end
    assert features["tokens"][13].tolist() == cut[:20]
    assert labels["targets"][13].tolist() == cut[1:21]
    gin.parse_config(f"tables.documents_input_fn.train = '{path}'")
    assert input_fns.documents_vocab_size() == 258
    gin.bind_parameter("packing.length", 64)

    def train(memory_limit_mb):
        table.MADE.clear()
        gin.bind_parameter("pipeline.memory_limit_mb", memory_limit_mb)
        read = InputParams(8, 8, seed=3)
        return batches(input_fns.documents_input_fn(Mode.TRAIN, read, train=path), 6)

    from_disk = train(0)
    assert from_disk[0][0]["segment_ids"].max() > 1  # several documents in a row
    for disk, memory in zip(from_disk, train(None), strict=True):
        tf.nest.map_structure(np.testing.assert_array_equal, disk, memory)


# ---------------------------------------------------------------- images


def test_encoded_images_in_a_column_are_read_in_place_as_a_prepared_folders_are(tmp_path):
    """PNG and JPEG bytes in a Parquet column, plain and as Hugging Face's Image feature
    (struct<bytes, path>), class names for labels: each batch's images are the central
    squares the prepared records give (datasets/images.py), from disk, mixed 1 to 1."""
    from datasets import images

    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (20 + 3 * i, 30 - i, 3), dtype=np.uint8) for i in range(12)]
    encoded = [
        (tf.io.encode_png if i % 2 else tf.io.encode_jpeg)(p).numpy()
        for i, p in enumerate(pictures)
    ]
    names = ["cat" if i % 3 else "dog" for i in range(12)]
    columns = {"image": encoded, "label": names, "caption": [f"a {n}" for n in names]}
    plain = write_parquet(tmp_path / "plain.parquet", columns, 5)
    as_hub = pa.table(
        {
            "image": [{"bytes": e, "path": f"{i}.png"} for i, e in enumerate(encoded)],
            "label": names,
        }
    )
    hub = str(tmp_path / "hub.parquet")
    pq.write_table(as_hub, hub, row_group_size=5)
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    params = InputParams(12, 12)
    for where in (plain, hub):
        table.MADE.clear()
        dataset = input_fns.images_input_fn(
            Mode.EVAL, params, train=where, eval=where, image_size=16
        )
        (features, labels), *_ = batches(dataset, 1)
        assert features["image"].shape == (12, 16, 16, 3)
        assert labels["label"].tolist() == [1 if n == "dog" else 0 for n in names]  # cat, dog
        for i in (0, 7):
            expected = images.centre_crop(tf.constant(encoded[i]), [16, 16], 3).numpy()
            np.testing.assert_array_equal(features["image"][i], expected)
    mixed = input_fns.images_input_fn(
        Mode.TRAIN,
        InputParams(8, 8, seed=1),
        train=[plain, hub],
        image_size=16,
        augment="inception",
    )
    (features, labels), *_ = batches(mixed, 1)
    assert features["image"].shape == (8, 16, 16, 3) and 0 <= features["image"].min()
    with pytest.raises(UserError, match=r"^tables\.images_input_fn\.augment must be one of"):
        input_fns.images_input_fn(Mode.TRAIN, params, train=plain, augment="flip")
    with pytest.raises(UserError, match=r"column 'caption' is string, not bytes \(binary, or an"):
        input_fns.images_input_fn(Mode.TRAIN, params, train=plain, image="caption")


# ---------------------------------------------------------------- resume


@pytest.mark.slow
def test_a_resume_at_an_odd_step_from_parquet_equals_a_straight_run_on_1_and_2_devices(tmp_path):
    """The id-table model (tests/support/resume_runs.py) read from a Parquet file of 7
    row groups, by index: stopped at step 7 (on 2 devices, and on 2 workers on
    127.0.0.1, each reading its share), then resumed on 1 device and on 2; every step
    read the examples a straight one-device run reads (bit-equal weights)."""
    ids = np.arange(50)
    path = write_parquet(tmp_path / "ids.parquet", {"id": ids}, row_group_size=7)
    env = {"RESUME_RUNS_INPUT": "parquet", "RESUME_RUNS_PARQUET": path}
    ports = free_ports(2)
    first = [resume_run(tmp_path / "to1", "mirrored:2", 7, env)] + [
        resume_run(tmp_path / "to2", "multi_worker:1", 7, {"TF_CONFIG": tf_config(ports, i), **env})
        for i in range(2)
    ]
    straight = resume_run(tmp_path / "straight", "towers:1", 12, env)
    stopped = [finish(process) for process in first]
    assert [stop["step"] for stop in stopped] == [7, 7, 7]
    assert stopped[1]["table"] == stopped[2]["table"]  # the workers hold the same weights
    second = [
        resume_run(tmp_path / "to1", "towers:1", 12, env),
        resume_run(tmp_path / "to2", "mirrored:2", 12, env),
    ]
    expected = finish(straight)["table"]
    assert np.std(expected) > 0.1  # the table tells steps and examples apart
    for process in second:
        assert finish(process)["table"] == expected


# ---------------------------------------------------------------- bad input, one line each


def test_a_parquet_file_cut_short_is_named_in_one_line(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", {"text": TEXTS})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(UserError, match=rf"^{path}: not a whole Parquet file \(.*\); it may"):
        table.rows_of(path, {"text": "text"})


@pytest.mark.parametrize(
    "case, columns, expected",
    [
        ("missing", {"txt": "text"}, r"{p}: no column 'txt' \(it has text, label, tokens, n\)"),
        ("list as text", {"tokens": "text"}, r"{p}: column 'tokens' is list<.*>, not text .*list"),
        ("numbers as text", {"label": "text"}, r"{p}: column 'label' is int64, not text"),
        ("nulls", {"n": "integer"}, r"{p}, row group 0: column 'n' holds 1 null value\(s\)"),
    ],
)
def test_a_schema_that_does_not_fit_is_refused_naming_the_file_and_column(
    tmp_path, case, columns, expected
):
    path = write_parquet(
        tmp_path / "t.parquet",
        {
            "text": TEXTS[:5],
            "label": [1, 2, 3, 4, 5],
            "tokens": [[1, 2]] * 5,
            "n": [1, None, 3, 4, 5],
        },
    )
    with pytest.raises(UserError, match="^" + expected.format(p=path)):
        table.rows_of(path, columns)


def test_a_file_among_many_with_another_schema_is_named(tmp_path):
    write_parquet(tmp_path / "d" / "a.parquet", {"text": TEXTS[:5]})
    other = write_parquet(tmp_path / "d" / "b.parquet", {"text": [b"x"] * 5})
    with pytest.raises(UserError, match=rf"^{other}: column 'text' is binary, not text"):
        table.rows_of(str(tmp_path / "d"), {"text": "text"})
    write_parquet(tmp_path / "e" / "a.parquet", {"n": [1, 2]})
    other = write_parquet(tmp_path / "e" / "b.parquet", {"n": [1.5, 2.5]})
    with pytest.raises(UserError, match=rf"^{other}: column 'n' is double here but int64 in "):
        table.rows_of(str(tmp_path / "e"), {"n": "number"})


def test_empty_files_and_folders_without_tables_are_refused(tmp_path):
    (tmp_path / "empty.parquet").touch()
    with pytest.raises(UserError, match=r"empty\.parquet: the file is empty \(0 bytes\)"):
        table.rows_of(str(tmp_path / "empty.parquet"), {"text": "text"})
    os.makedirs(tmp_path / "none")
    (tmp_path / "none" / "notes.txt").write_text("x")
    expected = r"no \.parquet, \.pq, \.jsonl, \.json or \.csv file there; name a file"
    with pytest.raises(UserError, match=expected):
        table.rows_of(str(tmp_path / "none"), {"text": "text"})
    with pytest.raises(UserError, match=r"'.*nowhere': no such file or folder"):
        table.rows_of(str(tmp_path / "nowhere"), {"text": "text"})


def test_a_save_to_disk_folder_of_an_unknown_layout_or_cut_short_is_refused(tmp_path):
    saved = save_to_disk(pa.table({"text": TEXTS}), tmp_path / "newer")
    with open(os.path.join(saved, "state.json"), "w") as f:
        json.dump({"_files": ["data.parquet"], "_fingerprint": "x"}, f)  # a layout to come
    with pytest.raises(UserError, match=r"state\.json lists no _data_files: written by a version"):
        table.rows_of(saved, {"text": "text"})
    saved = save_to_disk(pa.table({"text": TEXTS}), tmp_path / "cut")
    shard = os.path.join(saved, "data-00001-of-00002.arrow")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(UserError, match=rf"^{shard}: not a whole Arrow stream"):
        table.rows_of(saved, {"text": "text"})
    with pytest.raises(UserError, match=r"is a DatasetDict of splits train, test: name one"):
        os.makedirs(tmp_path / "dict")
        (tmp_path / "dict" / arrow.SPLITS).write_text('{"splits": ["train", "test"]}')
        table.rows_of(str(tmp_path / "dict"), {"text": "text"})


def test_a_row_group_that_fails_to_decode_mid_epoch_is_named_with_its_group(tmp_path):
    """A flipped run of bytes inside row group 2's data: the footer reads, the epoch
    starts, and the read of that group fails in one line naming the file and group."""
    path = write_parquet(tmp_path / "t.parquet", {"text": TEXTS}, row_group_size=100)
    column = pq.read_metadata(path).row_group(2).column(0)
    with open(path, "r+b") as f:
        f.seek(column.data_page_offset + 8)
        f.write(b"\xff" * 64)
    rows = table.rows_of(path, {"text": "text"})
    source = pipeline.RecordExamples(rows, lambda row: row, "texts")
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    params = InputParams(batch_size=50, global_batch_size=50)
    dataset = pipeline.build(source, Mode.EVAL, params, lambda e: ({"text": e["text"]}, {}))
    expected = rf"^evaluation: {path}, row group 2: input data is corrupt \(.*\); re-copy"
    with pytest.raises(UserError, match=expected):
        with errors.runtime_errors("evaluation"):
            batches(dataset, 10)


def test_skip_corrupt_leaves_out_a_row_group_that_fails_to_decode_and_says_how_many(
    tmp_path, caplog
):
    path = write_parquet(
        tmp_path / "t.parquet", {"text": TEXTS, "label": LABELS}, row_group_size=100
    )
    column = pq.read_metadata(path).row_group(1).column(0)
    with open(path, "r+b") as f:
        f.seek(column.data_page_offset + 8)
        f.write(b"\xff" * 64)
    params = InputParams(batch_size=50, global_batch_size=50)
    with caplog.at_level("WARNING"):
        dataset = input_fns.input_fn(
            Mode.EVAL, params, train=path, eval=path, skip_corrupt=True, longest=4000
        )
    tokens = np.concatenate([b[0]["tokens"][:, :3] for b in batches(dataset, 10)])
    assert len(tokens) == 200  # row groups 0 and 2
    knob = f"tables.input_fn.skip_corrupt ({path})"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned[0].startswith(
        f"{knob}: skipping 100 example(s): {path}, row group 1: input data is corrupt ("
    )
    assert warned[1:] == [
        f"{knob}: skipped 100 of 300 examples in all (1 problem(s), the first 1 said above)"
    ]
    first_of_group_2 = bytes(int(t) - 1 for t in tokens[100]).decode()
    assert first_of_group_2 == TEXTS[200][:3]


def test_the_stdlib_functions_written_as_parquet_are_read_as_the_recipe_reads_them(tmp_path):
    """``python3 -m datasets.stdlib --functions data/functions.parquet``, from a clone's
    root: a file of row groups, nothing left beside it."""
    proc = subprocess.run(
        [sys.executable, "-m", "datasets.stdlib", "--functions", "data/functions.parquet"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.listdir(tmp_path / "data") == ["functions.parquet"]
    rows_table = pq.read_table(tmp_path / "data" / "functions.parquet")
    assert rows_table.column_names == ["text", "label"] and rows_table.num_rows > 3000
    assert pq.read_metadata(tmp_path / "data" / "functions.parquet").num_row_groups > 3


@pytest.mark.slow
def test_the_text_classifier_recipe_runs_small_from_parquet_and_a_save_to_disk_folder(tmp_path):
    """text_classifier_parquet.gin, its header's commands: the functions written as
    Parquet, trained on where they lie (no prepare), small; then the same rows as a
    save_to_disk folder. The export takes strings, tokenized as training did."""
    import trainer
    from datasets import stdlib
    from trainer.cli import experiment

    header = open(f"{REPO}/experiments/text_classifier_parquet.gin").read()
    assert "python3 -m datasets.stdlib --functions data/functions.parquet" in header
    parquet = str(tmp_path / "data" / "functions.parquet")
    assert stdlib.main(["stdlib", "--functions", parquet]) == 0
    saved = save_to_disk(pq.read_table(parquet), tmp_path / "saved")
    results = {}
    for name, where in (("parquet", parquet), ("arrow", saved)):
        table.MADE.clear()
        gin.clear_config()
        gin.parse_config_files_and_bindings(
            [f"{REPO}/experiments/text_classifier_parquet.gin", f"{REPO}/experiments/smoke.gin"],
            [f"tables.input_fn.train = '{where}'", "experiment.eval_steps = None"],
        )
        run = experiment.experiment(model_dir=str(tmp_path / name), schedule="train_and_evaluate")
        results[name] = run["metrics"]["eval"]
        assert run["global_step"] == 10
    for metrics in results.values():  # (their batches are equal: the test above)
        assert 0.0 <= metrics["accuracy"] <= 1.0 and 0.5 < metrics["loss"] < 5.0
    exported = experiment.experiment(model_dir=str(tmp_path / "arrow"), schedule="export")
    serve = trainer.load_export(exported["export_dir"]).signatures["serving_default"]
    served = serve(text=tf.constant(["def main(self):\n    return logging.getLogger()"]))
    assert list(served.values())[0].shape[0] == 1


def test_prepare_takes_a_parquet_file_and_a_save_to_disk_folder_as_it_takes_json_lines(tmp_path):
    """The same rows as JSON lines, Parquet and a save_to_disk folder prepare to the
    same shards: the same classes, vocabulary, split and bytes."""
    from datasets.text import preparation

    rows_table = pa.table({"text": TEXTS, "label": LABELS})
    with open(tmp_path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows_table.to_pylist())
    pq.write_table(rows_table, tmp_path / "rows.parquet", row_group_size=64)
    sources = {
        "jsonl": str(tmp_path / "rows.jsonl"),
        "parquet": str(tmp_path / "rows.parquet"),
        "arrow": save_to_disk(rows_table, tmp_path / "saved"),
    }
    prepared = {}
    for name, source in sources.items():
        metadata = preparation.prepare(source, str(tmp_path / name), "words", 40)
        shards = sorted(p for p in os.listdir(tmp_path / name) if p.endswith(".tfrecord"))
        data = [(tmp_path / name / shard).read_bytes() for shard in shards]
        prepared[name] = ({k: v for k, v in metadata.items() if k != "source"}, data)
    assert prepared["jsonl"][0]["classes"] == ["neg", "pos"]
    assert prepared["parquet"] == prepared["jsonl"] == prepared["arrow"]


def test_prepare_refuses_a_parquet_file_cut_short_in_one_line_and_writes_nothing(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", {"text": TEXTS})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    proc = subprocess.run(
        [sys.executable, "-m", "datasets.prepare", "--text", "rows.parquet", "--out", "out"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert lines == [
        "error: rows.parquet: not a whole Parquet file (Parquet magic bytes not found in "
        "footer. Either the file is corrupted or this is not a parquet file.); it may be cut "
        "short: copy or write it again"
    ]
    assert sorted(os.listdir(tmp_path)) == ["rows.parquet"]  # nothing written


def test_parquet_on_disk_makes_the_batches_it_makes_held_in_memory(tmp_path):
    """Grouped by length into buckets and sized by a token budget: the rows read from
    the file, by the window order, make the very batches the same rows held in memory
    make (in the same order), from step 0 and from a resume."""
    path = write_parquet(tmp_path / "t.parquet", {"text": TEXTS, "label": LABELS}, 32)
    gin.bind_parameter("lengths.group_batches", 3)
    gin.bind_parameter("lengths.buckets", [16, 32, 64])
    gin.bind_parameter("lengths.token_budget", 256)

    def read(memory_limit_mb, start=0, count=8):
        table.MADE.clear()
        gin.bind_parameter("pipeline.memory_limit_mb", memory_limit_mb)
        params = InputParams(8, 8, seed=4, start_example=start)
        dataset = input_fns.input_fn(Mode.TRAIN, params, train=path, eval=path, longest=60)
        return batches(dataset, count)

    from_disk, in_memory = read(0), read(None)
    for disk, memory in zip(from_disk, in_memory, strict=True):
        tf.nest.map_structure(np.testing.assert_array_equal, disk, memory)
    assert len({b[0]["tokens"].shape for b in from_disk}) > 1  # batches of several shapes
    start = sum(len(b[1]["label"]) for b in from_disk[:3])
    resumed = read(0, start, 5)
    for again, straight in zip(resumed, from_disk[3:], strict=True):
        tf.nest.map_structure(np.testing.assert_array_equal, again, straight)


def test_eval_rows_with_a_class_the_training_rows_lack_are_refused_naming_it(tmp_path):
    train = write_parquet(tmp_path / "train.parquet", {"text": TEXTS, "label": LABELS})
    held = write_parquet(
        tmp_path / "eval.parquet", {"text": TEXTS[:3], "label": ["pos", "neu", "neg"]}
    )
    params = InputParams(8, 8)
    with pytest.raises(
        UserError,
        match=rf"^{held}: column 'label' holds 1 class name\(s\) the "
        r"training rows do not have \('neu'; they have 'neg', 'pos'\)",
    ):
        input_fns.input_fn(Mode.EVAL, params, train=train, eval=held)


def test_two_workers_each_read_their_share_of_a_parquet_file_and_together_the_whole(tmp_path):
    """Two input pipelines (one a worker) over a file read from disk: each yields its
    replica's share of every step, and the two shares are the steps one pipeline reads
    (evaluation: each reads every other row, together every row once)."""
    path = write_parquet(tmp_path / "ids.parquet", {"id": np.arange(300)}, row_group_size=25)
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    rows = table.rows_of(path, {"id": "integer"}, window=2)
    source = pipeline.RecordExamples(rows, lambda row: row, "ids")
    ids = lambda e: ({"id": e["id"]}, {})  # noqa: E731

    def read(mode, count, **params):
        dataset = pipeline.build(source, mode, InputParams(seed=6, **params), ids)
        return [b[0]["id"] for b in batches(dataset, count)]

    one = read(Mode.TRAIN, 12, batch_size=8, global_batch_size=16)  # replica 0, 1, 0, 1, ...
    shares = [
        read(
            Mode.TRAIN,
            6,
            batch_size=8,
            global_batch_size=16,
            num_input_pipelines=2,
            input_pipeline_id=worker,
        )
        for worker in (0, 1)
    ]
    for step in range(6):
        assert shares[0][step].tolist() == one[2 * step].tolist()
        assert shares[1][step].tolist() == one[2 * step + 1].tolist()
    evaluated = [
        read(
            Mode.EVAL,
            10,
            batch_size=50,
            global_batch_size=100,
            num_input_pipelines=2,
            input_pipeline_id=worker,
        )
        for worker in (0, 1)
    ]
    assert sorted(np.concatenate(evaluated[0] + evaluated[1]).tolist()) == list(range(300))
