"""The Estimator the callback tests train, and one worker of their two-worker run
(``worker_run``, started by ``helpers.on_workers``)."""

import functools

import keras

import trainer
from datasets import digits
from models.mlp import MLP
from trainer import Checkpoints, Devices, Estimator


def estimator(model_dir, model=None, **kwargs):
    keras.utils.set_random_seed(0)
    return Estimator(
        model or MLP(hidden_units=[16], dropout_rate=0.0),
        str(model_dir),
        optimizer=None if model else keras.optimizers.SGD(0.1),
        global_batch_size=32,
        eval_batch_size=64,
        steps_per_loop=4,
        log_every_steps=5,
        checkpoints=Checkpoints(every_steps=5),
        seed=0,
        progress=False,
        **kwargs,
    )


def plateau_callbacks(csv_path):
    """EarlyStopping and ReduceLROnPlateau that see no improvement after the first epoch."""
    return [
        keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=2, min_delta=1.0),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, min_delta=10.0),
        keras.callbacks.CSVLogger(str(csv_path)),
    ]


def worker_run(model_dir, data_dir):
    """One worker of test_on_two_workers_...: its step, learning rate and weights."""
    trainer.make_strategy("multi_worker", [])  # before TensorFlow runs an op
    input_fn = functools.partial(digits.input_fn, data_dir=data_dir)
    est = estimator(model_dir, devices=Devices(distribution="multi_worker", count="auto"))
    est.train_and_evaluate(
        input_fn,
        input_fn,
        100,
        eval_every_steps=5,
        eval_steps=2,
        callbacks=plateau_callbacks(f"{model_dir}.csv"),
    )
    return {
        "step": est.step,
        "rate": float(keras.ops.convert_to_numpy(est.optimizer.learning_rate)),
        "weights": [float(v.numpy().sum()) for v in est.model_fn.trainable_variables],
    }
