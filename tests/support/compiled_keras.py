"""A Keras model compiled as Keras users compile it, on the digits with sample weights
as Keras's fit takes them (tests/test_keras_compile.py, and its two-device runs in a
subprocess: ``sum_reduced_runs``)."""

import os

import keras
import tensorflow as tf
from sklearn.datasets import load_digits

import trainer

BATCH, STEPS = 64, 30


def digits_arrays():
    """Digits as 'is it 5 or more', with a weight per example a user might give."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = (digits.target >= 5).astype("float32")
    w = (1.0 + (digits.target % 3)).astype("float32")  # some examples count thrice
    return x, y, w


def weighted_input_fn(mode, params):
    """README's way, with a third item of sample weights as Keras's fit takes them."""
    x, y, w = digits_arrays()
    dataset = tf.data.Dataset.from_tensor_slices(({"image": x}, y, w))
    if mode == trainer.Mode.TRAIN:
        dataset = dataset.repeat()
    return dataset.batch(params.batch_size)


def compiled(loss, **compile_args):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,), name="image"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.002), loss=loss, **compile_args)
    return model


def sum_reduced_runs(model_dir):
    """One device, two towers and two mirrored replicas, with reduction='sum' (run in a
    subprocess that made two logical CPUs); each run's final weights and eval loss."""
    runs = {}
    for distribution in ("auto", "towers", "mirrored"):
        model = compiled(keras.losses.BinaryCrossentropy(reduction="sum"))
        estimator = trainer.Estimator(
            model,
            os.path.join(model_dir, distribution),
            global_batch_size=BATCH,
            steps_per_loop=10,
            devices=trainer.Devices(
                distribution=distribution, count=1 if distribution == "auto" else 2
            ),
            progress=False,
        )
        estimator.train(weighted_input_fn, max_steps=10)
        runs[distribution] = {
            "weights": [w.tolist() for w in model.get_weights()],
            "loss": estimator.evaluate(weighted_input_fn)["loss"],
        }
    return runs
