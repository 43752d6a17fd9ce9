"""The framework's optimisation: schedules reach the optimizer, clipping, EMA, L2."""

import math
import os

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support.helpers import event_tags, scalar_series
from trainer import Estimator, ModelFn, Spec
from trainer.errors import UserError
from trainer.optimization import WarmupDecay, fused_update, take_ema
from trainer.settings import Optimization


class Slope(ModelFn):
    """loss = mean(w * x) with x = 1: the gradient is exactly 1 (plus 2 * l2 * w)."""

    def __init__(self, l2=0.0):
        super().__init__()
        regularizer = keras.regularizers.L2(l2) if l2 else None
        self.dense = keras.layers.Dense(
            1, use_bias=False, kernel_initializer="ones", kernel_regularizer=regularizer
        )

    def __call__(self, features, labels, mode):
        y = self.dense(features["x"])[:, 0]
        return Spec({"y": y}, loss=None if labels is None else tf.reduce_mean(y))


def ones(mode, params):
    del mode
    data = ({"x": tf.ones([params.batch_size, 1])}, {"y": tf.zeros([params.batch_size])})
    return tf.data.Dataset.from_tensors(data).repeat()


def eval_ones(mode, params):
    return ones(mode, params).take(3)


def weights_per_step(tmp_path, optimizer, max_steps, **kwargs):
    """Trains Slope one step per block; returns [w after step 0, 1, ..., max_steps]."""
    estimator = Estimator(
        Slope(kwargs.pop("l2", 0.0)),
        str(tmp_path),
        optimizer=optimizer,
        global_batch_size=4,
        steps_per_loop=1,
        log_every_steps=1,
        **kwargs,
    )
    weights = []
    after_each = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: weights.append(kernel(estimator))
    )
    estimator.train(ones, max_steps, callbacks=[after_each])
    return estimator, [1.0, *weights]


def kernel(estimator):
    return float(estimator.model_fn.dense.kernel.numpy()[0, 0])


def test_warmup_hold_and_each_decay():
    lr = 0.5
    warm = WarmupDecay(
        lr, warmup_steps=10, hold_steps=5, decay="step", decay_steps=4, decay_rate=0.1
    )
    assert [float(warm(s)) for s in (0, 5, 10, 14, 15, 18, 19, 23)] == pytest.approx(
        [0.0, 0.25, 0.5, 0.5, 0.5, 0.5, 0.05, 0.005]
    )
    exponential = WarmupDecay(lr, decay="exponential", decay_steps=10, decay_rate=0.5)
    assert float(exponential(5)) == pytest.approx(lr * 0.5**0.5)
    cosine = WarmupDecay(lr, warmup_steps=2, decay="cosine", decay_steps=8, final_learning_rate=0.1)
    assert [float(cosine(s)) for s in (2, 6, 10, 50)] == pytest.approx(
        [0.5, 0.1 + 0.4 * 0.5 * (1 + math.cos(math.pi * 0.5)), 0.1, 0.1]
    )


def test_the_schedule_is_the_rate_the_optimizer_applies(tmp_path):
    schedule = WarmupDecay(
        0.1, warmup_steps=4, hold_steps=2, decay="step", decay_steps=3, decay_rate=0.5
    )
    estimator, w = weights_per_step(tmp_path, keras.optimizers.SGD(schedule), 12)
    applied = [w[i] - w[i + 1] for i in range(12)]  # gradient is 1: the step is the rate
    for iteration in (0, 2, 4, 5, 6, 9, 11):  # start, warmup, its end, hold, decays
        assert applied[iteration] == pytest.approx(float(schedule(iteration)), abs=1e-7)
    logged = dict(scalar_series(os.path.join(tmp_path, "train"), "learning_rate"))
    assert logged[4] == pytest.approx(float(schedule(4)))  # the rate the next step uses
    assert estimator.step == 12


def test_gradients_are_clipped_to_the_global_norm_and_the_norm_is_logged(tmp_path):
    _, w = weights_per_step(
        tmp_path, keras.optimizers.SGD(0.1), 3, optimization=Optimization(clip_gradient_norm=0.25)
    )
    assert w[0] - w[1] == pytest.approx(0.1 * 0.25)
    norms = dict(scalar_series(os.path.join(tmp_path, "train"), "gradient_norm"))
    assert norms[1] == pytest.approx(1.0)  # logged before clipping


def test_l2_is_added_to_the_training_loss(tmp_path):
    _, w = weights_per_step(tmp_path, keras.optimizers.SGD(0.1), 2, l2=0.5)
    assert w[0] - w[1] == pytest.approx(0.1 * (1 + 2 * 0.5 * 1.0))  # d/dw (w + 0.5 w^2)
    assert "regularization_loss" in event_tags(os.path.join(tmp_path, "train"))


def test_eval_uses_the_moving_average_of_the_weights(tmp_path):
    decay, lr, steps = 0.9, 0.1, 6
    estimator, w = weights_per_step(
        tmp_path, keras.optimizers.SGD(lr), steps, optimization=Optimization(ema_decay=decay)
    )
    average = w[1]  # the weights after the first step, as Keras's use_ema starts
    for value in w[2:]:
        average = decay * average + (1 - decay) * value
    metrics = estimator.evaluate(eval_ones)
    assert metrics["loss"] == pytest.approx(average, abs=1e-6)  # loss = mean(w * 1)
    assert kernel(estimator) == pytest.approx(w[-1])  # raw weights are back after eval
    assert list(estimator.predict(eval_ones))[0]["y"] == pytest.approx(average, abs=1e-6)

    fresh = Estimator(
        Slope(), str(tmp_path), optimization=Optimization(ema_decay=decay), global_batch_size=4
    )
    assert fresh.evaluate(eval_ones)["loss"] == pytest.approx(average, abs=1e-6)  # restored


def test_momentum_and_schedules_are_gin_configurable():
    gin.parse_config("""
        import trainer.cli.experiment
        Momentum.learning_rate = @WarmupDecay()
        Momentum.momentum = 0.8
        WarmupDecay.learning_rate = 0.2
        WarmupDecay.warmup_steps = 10
    """)
    optimizer = gin.get_configurable("Momentum")()
    assert isinstance(optimizer, keras.optimizers.SGD) and optimizer.momentum == 0.8
    assert float(optimizer.learning_rate) == 0.0  # iteration 0 of the warmup
    optimizer.iterations.assign(5)
    np.testing.assert_allclose(float(optimizer.learning_rate), 0.1)  # halfway up the warmup


def test_export_saves_the_moving_average(tmp_path):
    estimator, w = weights_per_step(
        tmp_path / "run", keras.optimizers.SGD(0.1), 4, optimization=Optimization(ema_decay=0.5)
    )
    average = w[1]
    for value in w[2:]:
        average = 0.5 * average + 0.5 * value
    path = estimator.export(eval_ones, str(tmp_path / "export"))
    serve = tf.saved_model.load(path).signatures["serving_default"]
    assert float(serve(x=tf.ones([1, 1]))["y"][0]) == pytest.approx(average, abs=1e-6)
    assert kernel(estimator) == pytest.approx(w[-1])  # the raw weights are back


@pytest.mark.parametrize(
    "make, fused",
    [
        (lambda: keras.optimizers.Adam(WarmupDecay(0.01, warmup_steps=2)), True),
        (lambda: keras.optimizers.Adam(0.01, beta_1=0.8, epsilon=1e-3), True),
        (lambda: keras.optimizers.SGD(0.1), True),
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), True),
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), True),
        (lambda: keras.optimizers.Adam(0.01, amsgrad=True), False),  # Keras's own update
        (lambda: keras.optimizers.RMSprop(0.01), False),
    ],
)
def test_the_fused_update_is_keras_update(make, fused):
    """Three steps of fused_update change weights and slots as Keras's apply_gradients."""
    variables = [keras.Variable(np.linspace(-1, 1, 12).reshape(3, 4)), keras.Variable([0.5, -2.0])]
    twins = [keras.Variable(v.numpy()) for v in variables]
    optimizer, reference = make(), make()
    optimizer.build(variables)
    reference.build(twins)
    update = fused_update(optimizer)
    step = tf.function(lambda gradients: update(gradients, variables))
    for i in range(3):
        gradients = [tf.sin(v * (i + 1.0)) for v in variables]  # differ per variable and step
        step(gradients)
        reference.apply_gradients(zip(gradients, twins, strict=True))
    kernels = {op.type for op in step.get_concrete_function(gradients).graph.get_operations()}
    assert any(kernel.startswith("ResourceApply") for kernel in kernels) == fused, kernels
    for v, twin in zip(variables + optimizer.variables, twins + reference.variables, strict=True):
        np.testing.assert_allclose(v.numpy(), twin.numpy(), rtol=1e-6, atol=1e-7, err_msg=v.path)
    assert int(optimizer.iterations.numpy()) == 3


def test_keras_use_ema_becomes_the_weight_average_or_is_refused_in_one_line():
    """An optimizer compiled with use_ema gives the run its average, and is copied
    without it (not kept twice); what cannot be kept so is named in one line."""
    adam = keras.optimizers.Adam(use_ema=True, ema_momentum=0.9)
    taken, decay = take_ema({None: adam}, None)
    assert decay == 0.9 and not taken[None].use_ema and adam.use_ema  # the user's untouched
    assert take_ema({None: adam}, 0.9)[1] == 0.9
    plain = keras.optimizers.Adam()
    assert take_ema({None: plain}, 0.99) == ({None: plain}, 0.99)
    for optimizers, ema_decay, says in (
        ({None: adam}, 0.999, "Optimization.ema_decay is 0.999 but the optimizer has use_ema"),
        ({"body": adam, "head": plain}, None, "use_ema is set on group 'body' but not on"),
        (
            {None: keras.optimizers.SGD(use_ema=True, ema_overwrite_frequency=10)},
            None,
            "ema_overwrite_frequency is set on the optimizer",
        ),
    ):
        with pytest.raises(UserError) as error:
            take_ema(optimizers, ema_decay)
        assert str(error.value).startswith(says) and "\n" not in str(error.value)
