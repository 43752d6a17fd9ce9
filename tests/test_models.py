"""Model shapes, parameter counts and train/eval behaviour of layers."""

import gin
import numpy as np
import pytest
import tensorflow as tf

from models.alexnet import AlexNet
from models.layers import ConvStack, DenseStack
from models.mlp import MLP
from tests.support.commands import REPO
from trainer import Mode, UserError


def build(model, shape):
    """Runs one PREDICT batch; returns (logits-shaped probabilities shape, parameter count)."""
    spec = model({"image": tf.zeros([2, *shape])}, None, Mode.PREDICT)
    count = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return tuple(spec.predictions["probabilities"].shape), count


@pytest.mark.parametrize(
    "shape, params",
    [
        # 3x3 convs 64-128-256 with 2x2 pools: 28 -> 14 -> 7 -> 3; 32 -> 16 -> 8 -> 4.
        ((28, 28, 1), 640 + 73856 + 295168 + (3 * 3 * 256 * 512 + 512) + 5130),
        ((32, 32, 3), 1792 + 73856 + 295168 + (4 * 4 * 256 * 512 + 512) + 5130),
    ],
)
def test_alexnet_downsamples_and_counts_parameters(shape, params):
    out, count = build(AlexNet(num_classes=10), shape)
    assert out == (2, 10)
    assert count == params
    assert count < 3_000_000  # the TF1 original had ~103M here: pooling that did not pool


def test_alexnet_resizes_digits_to_32x32():
    resized = AlexNet(num_classes=10, resize_to=(32, 32))
    assert build(resized, (8, 8, 1)) == build(AlexNet(num_classes=10), (32, 32, 1))


def test_classic_imagenet_alexnet_binding():
    gin.parse_config_file(f"{REPO}/experiments/alexnet_imagenet.gin")
    model = AlexNet()
    image = tf.zeros([1, 224, 224, 3])
    features = model.convs(image)
    assert features.shape == (1, 6, 6, 256)
    assert build(model, (224, 224, 3)) == ((2, 1000), 62_378_344)


@pytest.mark.parametrize(
    "kwargs, params",
    [
        (dict(hidden_units=[512, 512]), 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10),
        (dict(hidden_units=[32], batch_norm=True), 784 * 32 + 2 * 32 + 32 * 10 + 10),
    ],
)
def test_mlp_shapes_and_parameters(kwargs, params):
    assert build(MLP(num_classes=10, **kwargs), (28, 28, 1)) == ((2, 10), params)


def test_per_layer_lists_broadcast_and_must_match():
    stack = DenseStack([8, 4], activation=["relu", "tanh"], dropout=0.5)
    stack(tf.zeros([1, 3]))
    assert [b[1].name for b in stack.blocks] == ["dense_0_act", "dense_1_act"]
    assert [type(b[-1]).__name__ for b in stack.blocks] == ["Dropout", "Dropout"]
    with pytest.raises(UserError, match="dropout has 3 values for 2 layers"):
        DenseStack([8, 4], dropout=[0.1, 0.2, 0.3])
    with pytest.raises(UserError, match="kernel_size has 2 values for 3 layers"):
        ConvStack([4, 4, 4], kernel_size=[3, 5])


def test_batch_norm_statistics_move_in_train_only():
    model = MLP(num_classes=3, hidden_units=[4], batch_norm=True)
    features = {"image": tf.random.normal([8, 5], mean=3.0)}
    labels = {"label": tf.zeros([8], tf.int64)}
    model(features, labels, Mode.PREDICT)
    bn = model.hidden.blocks[0][1]
    start = bn.moving_mean.numpy().copy()
    for mode in (Mode.EVAL, Mode.PREDICT):
        model(features, labels if mode == Mode.EVAL else None, mode)
        np.testing.assert_array_equal(bn.moving_mean.numpy(), start)
    model(features, labels, Mode.TRAIN)
    assert not np.allclose(bn.moving_mean.numpy(), start)


def test_dropout_in_train_only_for_alexnet():
    model = AlexNet(num_classes=4, conv_filters=[4], dense_units=[16], dropout_rate=0.5)
    features = {"image": tf.ones([2, 8, 8, 1])}
    outputs = {
        m: [
            model(features, None if m == Mode.PREDICT else {"label": tf.zeros([2])}, m)
            .predictions["probabilities"]
            .numpy()
            for _ in range(2)
        ]
        for m in (Mode.TRAIN, Mode.EVAL, Mode.PREDICT)
    }
    assert not np.allclose(*outputs[Mode.TRAIN])
    np.testing.assert_array_equal(*outputs[Mode.EVAL])
    np.testing.assert_array_equal(outputs[Mode.EVAL][0], outputs[Mode.PREDICT][0])


def test_l2_adds_regularization_losses():
    model = MLP(num_classes=2, hidden_units=[3], l2=0.1)
    model({"image": tf.ones([1, 4])}, None, Mode.PREDICT)
    kernel = model.hidden.blocks[0][0].kernel
    losses = [loss for layer in model.layers for loss in layer.losses]
    assert len(losses) == 1
    np.testing.assert_allclose(losses[0], 0.1 * np.sum(kernel.numpy() ** 2), rtol=1e-6)
