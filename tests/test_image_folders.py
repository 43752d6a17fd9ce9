"""Folders of the user's own image files: prepared, kept byte for byte, verified, trained."""

import functools
import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets import folders
from datasets.records import tfrecord
from models.mlp import MLP
from tests.support import image_folders
from tests.support.commands import REPO
from trainer import Estimator, InputParams, Mode, UserError
from trainer.settings import Checkpoints


def prepare(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "datasets.prepare", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )


def stored_images(data_dir, split):
    metadata = json.loads((data_dir / "dataset.json").read_text())
    paths = [str(data_dir / s["file"]) for s in metadata["splits"][split]["shards"]]
    feature = {"image": tf.io.FixedLenFeature([], tf.string)}
    return [
        tf.io.parse_single_example(r, feature)["image"].numpy()
        for r in tf.data.TFRecordDataset(paths)
    ]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """A folder with train/ and val/, every odd kind of file, prepared once."""
    root = tmp_path_factory.mktemp("photos")
    broken = image_folders.make(str(root / "photos"), 40, split_folders=("train", "val"))
    out = root / "prepared"
    proc = prepare("--images", root / "photos", "--out", out)
    return root / "photos", out, broken, proc


@pytest.mark.slow
def test_a_folder_is_prepared_with_its_bad_files_named_and_counted(photos):
    root, out, broken, proc = photos
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-3:] == [
        "train: 120 examples in 1 shards, 2 files skipped",
        "val: 30 examples in 1 shards",
        f"wrote {out}",
    ]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3, proc.stderr
    for name, why in zip(broken, ("Invalid JPEG data", "not an image"), strict=True):
        assert any(f"Skipping {root / name}: " in w and why in w for w in warnings), warnings
    assert warnings[-1] == (
        "warning: train: skipped 2 of 122 files that are not readable images (named above)"
    )
    metadata = json.loads((out / "dataset.json").read_text())
    assert metadata["class_names"] == list(image_folders.CLASSES)
    assert (metadata["num_classes"], metadata["eval_split"]) == (3, "val")
    assert metadata["image_format"] == "encoded" and metadata["image_shape"] is None
    # grayscale and CMYK JPEGs stay JPEG; PNGs named .jpg stay PNG; BMPs become PNG
    assert metadata["splits"]["train"]["encodings"] == {"jpeg": 114, "png": 6}
    assert not list(out.glob("*.progress.json"))


def test_jpeg_bytes_are_kept_as_they_are(photos):
    root, out, _, _ = photos
    stored = set(stored_images(out, "val"))
    files = sorted((root / "val").glob("*/*"))
    jpegs = [p.read_bytes() for p in files if p.read_bytes()[:3] == b"\xff\xd8\xff"]
    assert len(stored) == len(files) == 30 and len(jpegs) == 30
    assert stored == set(jpegs)


@pytest.mark.slow
def test_verify_and_a_rerun_keep_what_is_written(photos):
    _, out, _, _ = photos
    verified = prepare("--verify", out)
    assert verified.returncode == 0 and verified.stdout == f"{out}: all records readable\n"
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare("--images", photos[0], "--out", out)
    assert again.returncode == 0, again.stderr
    assert "train: already written" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_class_folders_hold_out_a_stable_fraction_of_each_class(tmp_path):
    image_folders.make(str(tmp_path), 20, split_folders=(), broken=False)
    splits, classes = folders.layout(str(tmp_path), 0.25)
    assert classes == list(image_folders.CLASSES)
    labels = [label for _, label in splits["test"]]
    assert sorted(labels) == [0] * 5 + [1] * 5 + [2] * 5 and len(splits["train"]) == 45
    (tmp_path / "daylight" / "new one.jpg").write_bytes(b"")
    again, _ = folders.layout(str(tmp_path), 0.25)
    moved = {p for p, _ in splits["test"]} ^ {p for p, _ in again["test"]}
    assert len(moved) <= 2  # the new file, and at most the one it displaced


@pytest.mark.parametrize("split_folders", [(), ("train", "test")])
def test_an_empty_class_folder_is_refused_by_name(tmp_path, split_folders):
    """A class without training images would be a label no example has."""
    image_folders.make(str(tmp_path), 4, split_folders=split_folders, broken=False)
    where = tmp_path / "train" if split_folders else tmp_path
    (where / "zebra").mkdir()
    (where / "zebra" / ".DS_Store").write_bytes(b"")  # hidden files are no images
    with pytest.raises(UserError, match=rf"^{where / 'zebra'}: no training images in this class"):
        folders.layout(str(tmp_path), 0.25)
    if split_folders:  # a class with training images but none to evaluate on is fine
        (where / "zebra" / "a.jpg").write_bytes(b"")
        splits, classes = folders.layout(str(tmp_path), 0.25)
        assert classes[-1] == "zebra" and 3 not in {label for _, label in splits["test"]}


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--images", "no/such/dir"], "--images no/such/dir: no such directory"),
        (["--images", "."], "has no class subfolders"),
    ],
)
def test_a_folder_that_cannot_be_prepared_is_one_line(tmp_path, args, message):
    if args[1] == ".":
        args = ["--images", str(tmp_path)]
    proc = prepare(*args, "--out", tmp_path / "out")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_images_of_varying_sizes_need_an_image_size(photos):
    params = InputParams(batch_size=4, global_batch_size=4)
    with pytest.raises(UserError, match=r"vary in size: .*tfrecord.input_fn.image_size = S"):
        tfrecord.input_fn(Mode.TRAIN, params, data_dir=str(photos[1]))


@pytest.mark.slow
def test_inception_crops_resume_bit_equal(photos, tmp_path):
    """Random-resized crops are drawn from the stream position: 20 + 20 steps = 40 steps.

    (Accuracy through the CLI: test_as_written runs experiments/images_alexnet.gin.)
    """
    fn = functools.partial(
        tfrecord.input_fn, data_dir=str(photos[1]), image_size=16, augment="inception"
    )

    def estimator(model_dir, seed=0):
        keras.utils.set_random_seed(seed)
        return Estimator(
            MLP(hidden_units=[16], num_classes=3, dropout_rate=0.0),
            str(model_dir),
            global_batch_size=16,
            steps_per_loop=5,
            checkpoints=Checkpoints(every_steps=20),
            seed=0,
            optimizer=keras.optimizers.Adam(3e-3),
        )

    straight = estimator(tmp_path / "straight")
    straight.train(fn, max_steps=40)
    estimator(tmp_path / "split").train(fn, max_steps=20)
    resumed = estimator(tmp_path / "split", seed=7)
    resumed.train(fn, max_steps=40)
    for a, b in zip(
        straight.model_fn.trainable_variables, resumed.model_fn.trainable_variables, strict=True
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def imagenet_layout(directory, per_split=((("train", 2), 60), (("validation", 1), 15)), seed=0):
    """Shards as TensorFlow models' ImageNet build script writes them: labels from 1."""
    rng = np.random.default_rng(seed)
    for (split, count), examples in per_split:
        for shard in range(count):
            path = directory / f"{split}-{shard:05d}-of-{count:05d}"
            with tf.io.TFRecordWriter(str(path)) as writer:
                for _ in range(examples // count):
                    label = int(rng.integers(3))
                    data = image_folders.encoded(image_folders.picture(label, rng), "jpeg")
                    feature = {
                        "image/encoded": tf.train.Feature(
                            bytes_list=tf.train.BytesList(value=[data])
                        ),
                        "image/class/label": tf.train.Feature(
                            int64_list=tf.train.Int64List(value=[label + 1])
                        ),
                        "image/format": tf.train.Feature(
                            bytes_list=tf.train.BytesList(value=[b"JPEG"])
                        ),
                    }
                    example = tf.train.Example(features=tf.train.Features(feature=feature))
                    writer.write(example.SerializeToString())


@pytest.mark.slow
def test_imagenet_build_script_shards_are_read_where_they_lie(tmp_path):
    """Indexed, not copied; labels from 1 moved to 0; verified; trained above chance."""
    lying = tmp_path / "imagenet"
    lying.mkdir()
    imagenet_layout(lying)
    before = sorted(p.name for p in lying.iterdir())
    out = tmp_path / "prepared"
    for split in ("train", "validation"):
        args = ["--tfrecords", f"{lying}/{split}-*", "--split", split, "--label_offset", -1]
        proc = prepare(*args, "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in lying.iterdir()) == before  # nothing written beside them
    metadata = json.loads((out / "dataset.json").read_text())
    assert (metadata["num_classes"], metadata["eval_split"]) == (3, "validation")
    assert [s["file"] for s in metadata["splits"]["train"]["shards"]] == [
        str(lying / f"train-0000{i}-of-00002") for i in range(2)
    ]
    verified = prepare("--verify", out)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    params = InputParams(batch_size=64, global_batch_size=64)
    labels = np.concatenate(
        [
            y["label"].numpy()
            for _, y in tfrecord.input_fn(Mode.EVAL, params, data_dir=str(out), image_size=16)
        ]
    )
    assert len(labels) == 15 and set(labels) <= {0, 1, 2}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "--gin_file",
            "experiments/images_alexnet.gin",
            "--model_dir",
            str(tmp_path / "run"),
            "--gin_param",
            f"tfrecord.input_fn.data_dir = '{out}'",
            "--gin_param",
            "experiment.max_steps = 100",
            "--gin_param",
            "tfrecord.input_fn.image_size = 32",  # above chance at a quarter of the cost
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = next(i for i, line in enumerate(lines) if line.startswith("eval set "))
    assert lines[table].split()[-1] == "accuracy"
    assert float(lines[table + 1].split()[-1]) > 0.6, proc.stdout  # chance is 1/3


@pytest.mark.slow
def test_shards_without_the_keys_given_are_one_line(tmp_path):
    lying = tmp_path / "imagenet"
    lying.mkdir()
    imagenet_layout(lying, per_split=((("train", 1), 4),))
    proc = prepare(
        "--tfrecords", f"{lying}/train-*", "--image_key", "jpeg", "--out", tmp_path / "o"
    )
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "a record has no 'jpeg' bytes or 'image/class/label' integer" in proc.stderr
    assert "give --image_key and --label_key as the records name them" in proc.stderr


def test_tfds_imagenet2012_is_prepared_encoded_and_read(tmp_path):
    """TFDS's imagenet2012 (mock data): its JPEG bytes written as they are, then read."""
    import tensorflow_datasets as tfds

    from datasets import tfds_images
    from datasets.records import shards

    with tfds.testing.mock_data(num_examples=10):
        assert tfds_images.varies_in_size("imagenet2012", None)
        metadata = tfds_images.prepare_encoded(
            "imagenet2012", None, str(tmp_path), ["train", "validation"], 2
        )
    assert metadata["num_classes"] == 1000 and metadata["eval_split"] == "validation"
    assert metadata["splits"]["train"]["count"] == 10
    assert metadata["splits"]["train"]["encodings"] == {"jpeg": 10}
    assert shards.verify(str(tmp_path), "train") == []
    params = InputParams(batch_size=4, global_batch_size=4)
    features, labels = next(
        iter(
            tfrecord.input_fn(
                Mode.TRAIN, params, data_dir=str(tmp_path), image_size=32, augment="inception"
            )
        )
    )
    assert features["image"].shape == (4, 32, 32, 3) and labels["label"].shape == (4,)
    evaluated = list(tfrecord.input_fn(Mode.EVAL, params, data_dir=str(tmp_path), image_size=32))
    assert sum(len(y["label"]) for _, y in evaluated) == 10


@pytest.mark.slow
def test_a_killed_preparation_is_finished_by_the_same_command(tmp_path):
    """Killed after its first shards: nothing looks complete; the rerun writes the rest."""
    rng = np.random.default_rng(1)
    for label, name in enumerate(image_folders.CLASSES):
        (tmp_path / "photos" / name).mkdir(parents=True)
        for i in range(240):
            data = image_folders.encoded(image_folders.picture(label, rng, (160, 200)), "png")
            (tmp_path / "photos" / name / f"{i}.png").write_bytes(data)
    args = ["--images", tmp_path / "photos", "--shards", 24, "--out"]
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "datasets.prepare", *map(str, args), str(out)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)
    while not (out / "train.progress.json").exists() and process.poll() is None:
        time.sleep(0.005)
    process.kill()
    process.wait()
    assert process.returncode == -9, "prepare ended before it could be killed"
    assert not (out / "dataset.json").exists()
    assert len(list(out.glob("train-*.tfrecord"))) < 24
    assert prepare(*args, out).returncode == 0
    assert prepare(*args, tmp_path / "straight").returncode == 0
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert written == {p.name: p.read_bytes() for p in (tmp_path / "straight").iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("name, size", [("imagenet_alexnet", 64), ("imagenet_resnet50", 32)])
def test_the_imagenet_experiment_trains_small_and_reports_top_k_errors(tmp_path, name, size):
    """An ImageNet experiment on build-script shards, small images for 10 steps."""
    import gin

    from datasets import foreign
    from trainer.cli import experiment

    lying = tmp_path / "imagenet"
    lying.mkdir()
    imagenet_layout(lying, per_split=((("train", 2), 32), (("validation", 1), 12)))
    for split in ("train", "validation"):
        foreign.index(f"{lying}/{split}-*", split, str(tmp_path / "data"), label_offset=-1)
    gin.parse_config_files_and_bindings(
        [f"{REPO}/experiments/{name}.gin", f"{REPO}/experiments/smoke.gin"],
        [
            f"tfrecord.input_fn.data_dir = '{tmp_path / 'data'}'",
            f"tfrecord.input_fn.image_size = {size}",
            "Estimator.global_batch_size = 8",
            "Estimator.steps_per_loop = 5",
        ],
    )
    result = experiment.experiment(model_dir=str(tmp_path / "run"), schedule="train_and_evaluate")
    metrics = result["metrics"]["eval"]
    assert result["global_step"] == 10
    assert metrics["top_1_error"] == pytest.approx(1 - metrics["accuracy"])
    assert metrics["top_5_error"] == 0.0  # three classes: the label is always in the top 5


PEAK_MEMORY = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.mark.slow
def test_preparing_four_times_the_images_takes_no_more_memory(tmp_path):
    """Peak memory of prepare --images on 4,000 and on 16,000 images: within 60 MB."""
    rng = np.random.default_rng(0)
    # Ten JPEGs of each class, 8 kB each, repeated under new names: a preparation that
    # held the images in a list would take ~95 MB more for the 12,000 more.
    tiles = [
        [
            image_folders.encoded(image_folders.picture(label, rng, (160, 160)), "jpeg")
            for _ in range(10)
        ]
        for label in range(3)
    ]
    peaks = {}
    for count in (4_000, 16_000):
        root = tmp_path / f"photos{count}"
        for name in image_folders.CLASSES:
            (root / name).mkdir(parents=True)
        for i in range(count):
            label = i % 3
            path = root / image_folders.CLASSES[label] / f"{i}.jpg"
            path.write_bytes(tiles[label][i % 10])
        command = [sys.executable, "-m", "datasets.prepare", "--images", str(root)]
        proc = subprocess.run(
            [sys.executable, "-c", PEAK_MEMORY, *command, "--out", str(tmp_path / f"out{count}")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[count] = int(proc.stdout.split()[-1]) / 1024  # MB
    assert abs(peaks[16_000] - peaks[4_000]) < 60, peaks
