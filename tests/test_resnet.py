"""ResNet: its sizes and recipe details, Keras fit's numbers, devices, and the command line."""

import numpy as np
import pytest
import tensorflow as tf

from datasets.records import shards
from models.resnet import ResNet
from tests.support import image_folders, parity
from tests.support.commands import run_cli
from tests.support.helpers import on_two_cpus, saved_state
from tests.support.parity import check
from trainer import Mode, UserError


@pytest.mark.slow
@pytest.mark.parametrize(
    "depth, variant, size, classes, weights",
    [
        (20, "cifar", 32, 10, 269_722),  # the paper's table 6: 0.27M
        (56, "cifar", 32, 10, 853_018),  # 0.85M
        (50, "imagenet", 64, 1000, 25_557_032),  # torchvision's resnet50, to the weight
    ],
)
def test_resnet_sizes_and_its_recipes_details(depth, variant, size, classes, weights):
    model = ResNet(depth=depth, variant=variant, num_classes=classes)
    spec = model(
        {"image": tf.zeros([2, size, size, 3])}, {"label": tf.constant([0, 1])}, Mode.TRAIN
    )
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == weights
    assert spec.predictions["probabilities"].shape == (2, classes)
    # Each block starts as its shortcut: its last batch-norm scale is zero, the others one.
    scales = {v.path: v.numpy() for v in model.trainable_variables if v.path.endswith("gamma")}
    zero = {path for path, value in scales.items() if not np.any(value)}
    assert len(zero) == len(model.block_names)
    assert all(f"/bn{2 if variant == 'imagenet' else 1}/" in path for path in zero), zero
    assert all(np.all(scales[path] == 1) for path in scales.keys() - zero)
    # Weight decay on convolution and Dense kernels only: one loss each, of wd / 2 * |w|^2.
    kernels = [v for v in model.trainable_variables if v.path.endswith("kernel")]
    losses = model.regularization_losses
    assert len(losses) == len(kernels)
    expected = sum(0.5e-4 * float(tf.reduce_sum(tf.square(k))) for k in kernels)
    assert float(tf.add_n(losses)) == pytest.approx(expected, rel=1e-4)


def test_a_depth_that_is_no_resnet_is_refused_in_one_line():
    assert ResNet(depth=50).variant == "imagenet" and ResNet(depth=56).variant == "cifar"
    with pytest.raises(UserError, match=r"depth is 6n \+ 2 \(20, 32, 44, 56, 110\)"):
        ResNet(depth=21)
    with pytest.raises(UserError, match=r"use one of 18, 34, 50, 101, 152"):
        ResNet(depth=20, variant="imagenet")


@pytest.mark.slow
def test_resnet20_trains_as_keras_fit_trains_its_own_layers(tmp_path):
    """Three steps of the framework's ResNet-20 equal fit's of a Keras model of its layers,
    then evaluate and predict."""
    check("resnet20 one_device", parity.cell("resnet20", "one_device", str(tmp_path / "model")))


@pytest.mark.slow
def test_resnet_on_two_devices_equals_one_device_or_keras_under_a_strategy():
    """Synchronized batch norm on two mirrored replicas trains what one device trains;
    towers (each tower by its own statistics) train what mirrored replicas train."""
    found = on_two_cpus("tests.support.parity", "resnet_on_two_devices")
    for comparison, (variable, difference) in found.items():
        assert difference <= parity.TOLERANCE[None], f"{comparison}: {variable} {difference}"


def _cli_args(data, model_dir, max_steps):
    bindings = [
        "ResNet.depth = 20",
        "ResNet.num_classes = 3",
        "ResNet.label_smoothing = 0.1",
        "experiment.input_fn = @tfrecord.input_fn",
        f"tfrecord.input_fn.data_dir = '{data}'",
        "tfrecord.input_fn.augment = True",
        f"experiment.max_steps = {max_steps}",
        "experiment.eval_every_steps = 24",
        "experiment.deterministic = True",
        "Estimator.global_batch_size = 16",
        "Estimator.steps_per_loop = 12",
        "Estimator.log_every_steps = 12",
        "Checkpoints.every_steps = 12",
    ]
    args = ["--gin_file", "experiments/cifar10_resnet56.gin", "--model_dir", str(model_dir)]
    for binding in bindings:
        args += ["--gin_param", binding]
    return args


@pytest.mark.slow
def test_resnet20_trains_above_chance_through_the_command_line_and_resumes_bitwise(tmp_path):
    """cifar10_resnet56.gin made ResNet-20 on generated 32x32 images of three classes."""
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    for split, count in (("train", 96), ("test", 48)):
        rows = [
            {"image": image_folders.picture(i % 3, rng, (32, 32)), "label": i % 3}
            for i in range(count)
        ]
        shards.write(rows, str(data), split, 2, "png", num_classes=3)
    straight = run_cli(*_cli_args(data, tmp_path / "straight", 24))
    assert straight.returncode == 0, straight.stderr[-3000:]
    accuracy = float(straight.stdout.split("accuracy ")[1].split()[0].rstrip(","))
    assert accuracy > 0.6, straight.stdout  # chance is 1/3
    stopped = run_cli(*_cli_args(data, tmp_path / "resumed", 12))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_cli(*_cli_args(data, tmp_path / "resumed", 24))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 12 to 24" in resumed.stdout
    expected, actual = saved_state(tmp_path / "straight"), saved_state(tmp_path / "resumed")
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(value, actual[key], err_msg=key)
