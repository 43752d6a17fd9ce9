"""TFRecord shards: lossless round trip, order, seeds, accuracy, and damaged data."""

import functools
import json
import os
import re
import subprocess
import sys

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets import digits, pipeline
from datasets.records import indexed, shards, tfrecord
from models.mlp import MLP
from tests.support.commands import REPO
from trainer import Estimator, InputParams, Mode, UserError


def params(batch_size=8, seed=0):
    return InputParams(batch_size=batch_size, global_batch_size=batch_size, seed=seed)


def random_examples(count=50, shape=(5, 6, 3), seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"image": rng.integers(0, 256, shape, dtype=np.uint8), "label": int(rng.integers(10))}
        for _ in range(count)
    ]


def read_all(data_dir, split="train", mode=Mode.EVAL, **kwargs):
    batches = list(tfrecord.read(str(data_dir), split, mode, params(), **kwargs))
    images = np.concatenate(
        [np.round(f["image"].numpy() * 255).astype(np.uint8) for f, _ in batches]
    )
    labels = np.concatenate([y["label"].numpy() for _, y in batches])
    return images, labels


@pytest.mark.parametrize("num_shards", [1, 7])
@pytest.mark.parametrize("compression", [None, "GZIP"])
@pytest.mark.parametrize("image_format", ["png", "raw"])
def test_round_trip_is_lossless_and_in_order(tmp_path, num_shards, compression, image_format):
    examples = random_examples()
    entry = shards.write(
        examples, str(tmp_path), "train", num_shards, image_format, compression, num_classes=10
    )
    assert len(entry["shards"]) == num_shards and entry["count"] == 50
    suffix = ".tfrecord.gz" if compression else ".tfrecord"
    names = [f"train-{i:05d}-of-{num_shards:05d}{suffix}" for i in range(num_shards)]
    indexes = [] if compression else [name + indexed.INDEX_SUFFIX for name in names]
    assert sorted(os.listdir(tmp_path)) == sorted(["dataset.json", *names, *indexes])
    images, labels = read_all(tmp_path)
    np.testing.assert_array_equal(images, np.stack([e["image"] for e in examples]))
    np.testing.assert_array_equal(labels, [e["label"] for e in examples])
    if not compression:  # the written offsets are the ones a checked pass finds
        for name, shard in zip(names, entry["shards"], strict=True):
            path = str(tmp_path / name)
            written = indexed.record_offsets(path, shard["count"])
            os.remove(path + indexed.INDEX_SUFFIX)
            np.testing.assert_array_equal(written, indexed.record_offsets(path, shard["count"]))


def first_labels(data_dir, seed):
    dataset = tfrecord.read(str(data_dir), "train", Mode.TRAIN, params(16, seed))
    return np.concatenate([y["label"].numpy() for _, y in dataset.take(4)])


def test_training_order_follows_the_seed(tmp_path):
    shards.write(random_examples(200), str(tmp_path), "train", 4, "raw")
    np.testing.assert_array_equal(first_labels(tmp_path, 0), first_labels(tmp_path, 0))
    assert not np.array_equal(first_labels(tmp_path, 0), first_labels(tmp_path, 1))


def test_augmentation_crops_and_flips_each_image_reproducibly(tmp_path):
    shards.write(random_examples(64, (32, 32, 3)), str(tmp_path), "train", 2, "raw")

    def first_batch(seed):
        dataset = tfrecord.read(str(tmp_path), "train", Mode.TRAIN, params(32, seed), augment=True)
        return next(iter(dataset))[0]["image"].numpy()

    plain = next(iter(tfrecord.read(str(tmp_path), "train", Mode.TRAIN, params(32, 0))))
    augmented = first_batch(0)
    assert augmented.shape == (32, 32, 32, 3)
    np.testing.assert_array_equal(augmented, first_batch(0))
    assert not np.allclose(augmented, plain[0]["image"].numpy())


@pytest.fixture(scope="module")
def digits_records(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("digits_records")
    for split in ("train", "test"):
        rows = list(digits.load(split, data_dir).as_numpy_iterator())
        shards.write(rows, str(out), split, 4, "png", num_classes=10)
    return out


def eval_accuracy(tmp_path, input_fn):
    keras.utils.set_random_seed(0)
    estimator = Estimator(
        MLP(hidden_units=[64]),
        str(tmp_path),
        global_batch_size=64,
        seed=0,
        optimizer=keras.optimizers.Adam(3e-3),
        steps_per_loop=50,
        log_every_steps=100,
    )
    return estimator.train_and_evaluate(input_fn, input_fn, max_steps=400)["eval"]["accuracy"]


@pytest.mark.slow
def test_digits_from_shards_match_the_in_memory_source(tmp_path, digits_records, data_dir):
    from_records = eval_accuracy(
        tmp_path / "records", functools.partial(tfrecord.input_fn, data_dir=str(digits_records))
    )
    in_memory = eval_accuracy(
        tmp_path / "memory", functools.partial(digits.input_fn, data_dir=data_dir)
    )
    assert from_records >= 0.95 and in_memory >= 0.95
    assert abs(from_records - in_memory) <= 0.02


def damaged_copy(digits_records, tmp_path, how):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(digits_records), str(copy)], check=True)
    shard = copy / "train-00002-of-00004.tfrecord"
    data = bytearray(shard.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:  # garbage in the middle, same size
        data[len(data) // 2 : len(data) // 2 + 64] = os.urandom(64)
    shard.write_bytes(bytes(data))
    return copy, shard


def test_truncated_shard_is_named_before_reading(digits_records, tmp_path):
    copy, shard = damaged_copy(digits_records, tmp_path, "truncate")
    with pytest.raises(UserError, match=rf"shard {shard} is \d+ bytes, \d+ were written"):
        tfrecord.read(str(copy), "train", Mode.TRAIN, params())


def test_garbage_fails_training_clearly_or_is_skipped_and_counted(digits_records, tmp_path, caplog):
    copy, shard = damaged_copy(digits_records, tmp_path, "garbage")
    fn = functools.partial(tfrecord.input_fn, data_dir=str(copy))
    estimator = Estimator(MLP(hidden_units=[8]), str(tmp_path / "strict"), global_batch_size=32)
    with pytest.raises(
        UserError, match=rf"input data is corrupt \(corrupted record at \d+ in {shard}\)"
    ):
        estimator.train(fn, 100)

    problems = shards.verify(str(copy), "train")
    assert len(problems) == 1 and problems[0].startswith(f"{shard}: ")

    skipping = Estimator(MLP(hidden_units=[8]), str(tmp_path / "skip"), global_batch_size=32)
    caplog.set_level("WARNING")
    assert skipping.train(functools.partial(fn, skip_corrupt=True), 100) == 100
    skipped = [r.getMessage() for r in caplog.records if "unreadable records" in r.getMessage()]
    assert len(skipped) == 1 and re.search(
        rf"Skipping \d+ unreadable records of 359 in {shard}$", skipped[0]
    )


def test_label_outside_the_classes_names_the_value(tmp_path):
    examples = random_examples(8)
    examples[3]["label"] = 12
    shards.write(examples, str(tmp_path), "train", 1, "raw", num_classes=10)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"a label in the data out of range \[0, 10\)\] \[12\]",
    ):
        read_all(tmp_path)


def test_empty_or_absent_splits_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="split 'train' has no examples to write"):
        shards.write([], str(tmp_path), "train", 2)
    shards.write(random_examples(4), str(tmp_path), "train", 1, "raw")
    with pytest.raises(UserError, match="has no split 'test'; it has train"):
        tfrecord.read(str(tmp_path), "test", Mode.EVAL, params())
    with pytest.raises(UserError, match="dataset.json not found: prepare the data"):
        tfrecord.read(str(tmp_path / "nowhere"), "train", Mode.EVAL, params())


@pytest.mark.slow
def test_prepare_command_writes_and_verifies(tmp_path, data_dir):
    out = tmp_path / "out"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "datasets.prepare",
            "--dataset",
            "digits",
            "--out",
            str(out),
            "--shards",
            "3",
            "--data_dir",
            data_dir,
            "--compression",
            "GZIP",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "train: 1437 examples in 3 shards" in proc.stdout
    assert "test: 360 examples in 3 shards" in proc.stdout
    verify = subprocess.run(
        [sys.executable, "-m", "datasets.prepare", "--verify", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0 and "all records readable" in verify.stdout


def test_weighted_mixing_of_sources():
    zeros = tf.data.Dataset.from_tensors({"v": 0}).repeat(100)
    ones = tf.data.Dataset.from_tensors({"v": 1}).repeat(100)
    dataset = pipeline.build(
        [zeros, ones],
        Mode.TRAIN,
        params(100),
        lambda e: ({"v": e["v"]}, {"v": e["v"]}),
        weights=[0.9, 0.1],
    )
    values = np.concatenate([f["v"].numpy() for f, _ in dataset.take(30)])
    assert 0.07 <= values.mean() <= 0.13
    evaluation = pipeline.build(
        [zeros, ones], Mode.EVAL, params(100), lambda e: ({"v": e["v"]}, {"v": e["v"]})
    )
    assert [int(f["v"].numpy().sum()) for f, _ in evaluation] == [0, 100]


def test_file_cache_and_determinism_are_gin_knobs(tmp_path):
    gin.parse_config([f"pipeline.cache = '{tmp_path}/cache'", "pipeline.deterministic = False"])
    source = tf.data.Dataset.range(10).map(lambda i: {"v": i})
    dataset = pipeline.build(source, Mode.EVAL, params(4), lambda e: (e, e), name="train")
    assert [len(f["v"]) for f, _ in dataset] == [4, 4, 2]
    assert any(name.startswith("train-0") for name in os.listdir(tmp_path / "cache"))
    assert dataset.options().deterministic is False


def flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_damaged_index_is_rebuilt_with_a_warning(tmp_path, caplog):
    """A bit flipped in the .npy header or in an offset: found by the index's checksum."""
    shards.write(random_examples(), str(tmp_path), "train", 1, "raw")
    shard = tmp_path / shards.shard_name("train", 0, 1, None)
    index = tmp_path / (shard.name + indexed.INDEX_SUFFIX)
    expected = read_all(tmp_path, mode=Mode.EVAL)
    sound = index.read_bytes()
    # the header's dict opened (numpy's parser then raises TokenError), its shape, an offset
    for at in (10, 20, len(sound) - 8 * 30):
        index.write_bytes(sound)
        flip(index, at)
        caplog.clear()
        with caplog.at_level("WARNING"):
            images, labels = read_all(tmp_path, mode=Mode.EVAL)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warned == [f"{index} is damaged or out of date; indexing {shard} again"]
        np.testing.assert_array_equal(images, expected[0])
        np.testing.assert_array_equal(labels, expected[1])
        assert index.read_bytes() == sound  # rebuilt, the same as prepare wrote


def test_a_flipped_bit_in_a_records_length_is_a_corrupt_record(tmp_path):
    """The length's own CRC is checked before the length is trusted (no 4 GB read)."""
    shards.write(random_examples(4), str(tmp_path), "train", 1, "raw")
    shard = tmp_path / shards.shard_name("train", 0, 1, None)
    offsets = indexed.record_offsets(str(shard), 4)
    flip(shard, int(offsets[2]) + 6)  # a high byte of record 2's length
    os.utime(str(shard) + indexed.INDEX_SUFFIX)  # its index stays the newer
    source = indexed.RecordSource([str(shard)], [offsets])
    got, problem = source._read(np.arange(4))
    assert problem == f"corrupted record at {offsets[2]} in {shard}"
    assert [len(r) > 0 for r in got] == [True, True, False, False]


def test_reads_over_many_shards_keep_a_bounded_number_of_files_open(tmp_path, monkeypatch):
    monkeypatch.setattr(indexed, "MAX_OPEN_FILES", 5)
    shards.write(random_examples(40), str(tmp_path), "train", 20, "raw")
    metadata, paths = shards.check_shards(str(tmp_path), "train")
    source = indexed.RecordSource(paths, [indexed.record_offsets(p, 2) for p in paths])
    rows = np.random.default_rng(0).permutation(40)
    got, problem = source._read(rows)
    assert problem == "" and source.files.open_count == 5
    want = [r.numpy() for r in tf.data.TFRecordDataset(paths)]
    assert list(got) == [want[i] for i in rows]
    source.files.close()
    assert source.files.open_count == 0


@pytest.mark.parametrize("split", ["train", "test"])
def test_corrupt_shards_are_named_in_training_and_evaluation(digits_records, tmp_path, split):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(digits_records), str(copy)], check=True)
    shard = copy / f"{split}-00001-of-00004.tfrecord"
    flip(shard, shard.stat().st_size // 2)
    os.utime(copy / (shard.name + indexed.INDEX_SUFFIX))  # its index stays the newer
    estimator = Estimator(MLP(hidden_units=[8]), str(tmp_path / "run"), global_batch_size=32)
    fn = functools.partial(tfrecord.input_fn, data_dir=str(copy))
    with pytest.raises(UserError, match=rf"corrupted record at \d+ in {shard}\)"):
        if split == "train":
            estimator.train(fn, 100)
        else:
            estimator.train(functools.partial(tfrecord.input_fn, data_dir=str(digits_records)), 1)
            estimator.evaluate(fn)


def test_a_description_that_does_not_fit_the_files_is_refused(digits_records, tmp_path):
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(digits_records), str(copy)], check=True)
    meta = copy / "dataset.json"
    sound = meta.read_text()
    first = copy / "train-00000-of-00004.tfrecord"

    doubled = json.loads(sound)
    for shard in doubled["splits"]["train"]["shards"]:
        shard["count"] *= 2
    meta.write_text(json.dumps(doubled))
    with pytest.raises(UserError) as error:
        tfrecord.read(str(copy), "train", Mode.TRAIN, params())
    assert str(error.value) == (
        f"{first} holds 360 records where dataset.json lists 720: re-copy the data files, or "
        "prepare the data again"
    )

    meta.write_text(
        sound.replace('"image_shape": [\n    8,\n    8,', '"image_shape": [\n    16,\n    16,')
    )
    with pytest.raises(UserError) as error:
        tfrecord.read(str(copy), "train", Mode.TRAIN, params())
    assert str(error.value) == (
        f"the records of {first} hold images of [8, 8, 1], where dataset.json says [16, 16, 1]: "
        "dataset.json does not describe these files; prepare the data again, or re-copy the "
        "whole directory"
    )

    meta.write_text(sound[:-20])
    with pytest.raises(UserError) as error:
        tfrecord.read(str(copy), "train", Mode.TRAIN, params())
    assert re.fullmatch(
        rf"{meta} is unreadable \(.*\): it describes the prepared data in {copy}; re-copy it, "
        rf"or prepare the data again with `python3 -m datasets.prepare --out {copy} \.\.\.`",
        str(error.value),
    )


@pytest.mark.slow
def test_training_over_2048_shards_under_an_open_file_limit_of_1024(tmp_path):
    """ImageNet-scale shard counts: files are closed, not held open one per shard."""
    data = tmp_path / "data"
    shards.write(random_examples(4096, (8, 8, 1)), str(data), "train", 2048, "raw", None, 10)
    shards.write(random_examples(64, (8, 8, 1), 1), str(data), "test", 1, "raw", None, 10)
    command = (
        f"ulimit -n 1024 && {sys.executable} -m trainer --gin_file {REPO}/"
        "experiments/digits_mlp_tfrecord.gin --model_dir run "
        f"--gin_param \"tfrecord.input_fn.data_dir = '{data}'\" "
        "--gin_param 'experiment.max_steps = 40' --gin_param 'experiment.eval_every_steps = None'"
    )
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.exists(tmp_path / "run" / "ckpt-40.index")
