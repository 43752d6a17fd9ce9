"""A body-and-head ModelFn and line data, shared by the optimizer-group, research and
warm-start tests."""

import functools

import keras
import numpy as np
import tensorflow as tf

import trainer


def line_data(mode, params, width=1):
    """y = 2x + 1 with noise (x the first of ``width`` features), as README's own
    input_fns are written."""
    rng = np.random.default_rng(0 if mode == trainer.Mode.TRAIN else 1)
    x = rng.uniform(-1, 1, size=(256, width)).astype("float32")
    y = (2 * x[:, 0] + 1 + 0.1 * rng.normal(size=256)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, {"y": y}))
    if mode == trainer.Mode.TRAIN:
        dataset = dataset.shuffle(256, seed=params.seed).repeat()
    return dataset.batch(params.batch_size)


body_data = functools.partial(line_data, width=4)  # a body's four inputs


class BodyHead(trainer.ModelFn):
    """A body and a head, as a fine-tuned model has them; optionally two groups."""

    def __init__(self, groups=None, loss_per_group=False):
        super().__init__()
        self.body = keras.layers.Dense(8, activation="relu", name="body")
        self.head = keras.layers.Dense(1, name="head")
        self.groups, self.loss_per_group = groups, loss_per_group

    def optimizer_groups(self):
        return self.groups

    def __call__(self, features, labels, mode):
        y = tf.cast(self.head(self.body(features["x"]))[:, 0], tf.float32)  # under float16
        if labels is None:
            return trainer.Spec({"y": y})
        loss = tf.reduce_mean((y - labels["y"]) ** 2)
        if self.loss_per_group:
            loss = {"body": loss, "head": 2.0 * loss}
        return trainer.Spec({"y": y}, loss=loss, metrics={"abs_error": tf.abs(y - labels["y"])})


def weights(model):
    return {v.path: v.numpy().copy() for v in model.trainable_variables}


def built(run, start=None):
    """The run's model built (its variables made), from ``start``'s values if given."""
    element_spec = run.inputs.dataset(body_data, trainer.Mode.TRAIN).element_spec
    run.model.build(element_spec, trainer.Mode.TRAIN)
    for v in run.model_fn.trainable_variables if start else []:
        v.assign(start[v.path])
    return weights(run.model_fn)


def estimator(model, model_dir, **kwargs):
    keras.utils.set_random_seed(0)
    kwargs.setdefault("optimizer", keras.optimizers.SGD(0.1))
    return trainer.Estimator(
        model,
        str(model_dir),
        global_batch_size=16,
        steps_per_loop=1,
        seed=0,
        progress=False,
        **kwargs,
    )
