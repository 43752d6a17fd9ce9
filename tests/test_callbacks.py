"""Keras's own callbacks, as users pass them to fit, in train and train_and_evaluate.

An epoch is an evaluation cycle (``trainer/callbacks.py``); a resumed run takes each
callback's state back, so that it stops, reduces and writes as a straight run does.
"""

import csv
import functools
import os

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import trainer
from datasets import digits
from models.mlp import MLP
from tests.support.callback_runs import estimator, plateau_callbacks
from tests.support.helpers import checkpoint_steps, on_workers, scalar_series
from trainer import Checkpoints, Estimator, Mode, errors
from trainer.errors import UserError


@pytest.fixture
def input_fn(data_dir):
    return functools.partial(digits.input_fn, data_dir=data_dir)


def compiled_linear():
    """A linear classifier of the digits, compiled as a Keras user compiles it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 1), name="image"), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    model.compile(
        keras.optimizers.SGD(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def fit_blank(model, epochs, callbacks):
    """``model.fit`` as a Keras user calls it, on 64 blank digits in batches of 32,
    validating on them too; its History."""
    images, labels = np.zeros((64, 8, 8, 1), np.float32), np.arange(64) % 10
    return model.fit(
        images,
        labels,
        batch_size=32,
        epochs=epochs,
        validation_data=(images, labels),
        verbose=0,
        callbacks=callbacks,
    )


def csv_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_keras_callbacks_stop_reduce_and_log_alike_straight_and_resumed(tmp_path, input_fn):
    """EarlyStopping's patience, ReduceLROnPlateau's rate and CSVLogger's rows survive a
    resume: the resumed run stops at the step the straight one stops at (a fresh
    EarlyStopping would wait two more epochs), trains at the same reduced rates and
    adds its rows under the first run's header."""

    def train(est, steps, callbacks):
        est.train_and_evaluate(
            input_fn, input_fn, steps, eval_every_steps=5, eval_steps=2, callbacks=callbacks
        )

    straight = estimator(tmp_path / "straight")
    train(straight, 100, plateau_callbacks(tmp_path / "straight.csv"))
    assert straight.step == 15  # epochs 0 (best), 1 and 2 without improvement
    first = estimator(tmp_path / "resumed")
    train(first, 10, plateau_callbacks(tmp_path / "resumed.csv"))
    again = estimator(tmp_path / "resumed")  # a new process's objects
    train(again, 100, plateau_callbacks(tmp_path / "resumed.csv"))
    assert again.step == 15 and checkpoint_steps(tmp_path / "resumed") == [5, 10, 15]

    rows = csv_rows(tmp_path / "straight.csv")
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert {"loss", "accuracy", "learning_rate", "val_loss", "val_accuracy"} <= set(rows[0])
    resumed_rows = csv_rows(tmp_path / "resumed.csv")
    assert [r["epoch"] for r in resumed_rows] == ["0", "1", "2"]
    for row, resumed_row in zip(rows, resumed_rows, strict=True):
        assert {k: float(v) for k, v in resumed_row.items()} == pytest.approx(
            {k: float(v) for k, v in row.items()}, rel=1e-5
        )
    # Reduced 10x at the ends of epochs 1 and 2, each logging the rate it ran at (as in
    # fit); step 15 logs before the evaluation there.
    rates = dict(scalar_series(str(tmp_path / "straight" / "train"), "learning_rate"))
    assert rates == pytest.approx({5: 0.1, 10: 0.1, 15: 0.01})
    assert [float(r["learning_rate"]) for r in rows] == pytest.approx([0.1, 0.1, 0.01])
    resumed = dict(scalar_series(str(tmp_path / "resumed" / "train"), "learning_rate"))
    assert resumed == rates
    assert float(again.optimizer.learning_rate) == pytest.approx(0.001)
    # The epoch's loss is the mean over its steps, as fit reports it.
    losses = dict(scalar_series(str(tmp_path / "straight" / "train"), "loss"))
    assert float(rows[1]["loss"]) == pytest.approx(losses[10], rel=1e-5)


def test_a_keras_models_best_weights_are_restored_into_the_last_checkpoint(tmp_path, input_fn):
    """restore_best_weights on a compiled Keras model: callback.model is the model, and
    the weights EarlyStopping puts back at the end are the ones the run saves."""
    model = compiled_linear()
    seen = []
    best_at_first = keras.callbacks.EarlyStopping(
        monitor="val_loss", mode="max", patience=1, restore_best_weights=True
    )
    models = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: seen.append(keras_of()))
    est = estimator(tmp_path / "keras", model)
    keras_of = lambda: models.model  # noqa: E731
    results = est.train_and_evaluate(
        input_fn,
        input_fn,
        100,
        eval_every_steps=5,
        eval_steps=2,
        callbacks=[best_at_first, models, keras.callbacks.CSVLogger(str(tmp_path / "k.csv"))],
    )
    assert seen == [model] and est.step == 10
    first_epoch = float(csv_rows(tmp_path / "k.csv")[0]["val_loss"])
    assert results["eval"]["loss"] < first_epoch  # the final evaluation saw the last weights
    restored = estimator(tmp_path / "keras", model)
    assert restored.evaluate(input_fn, steps=2)["loss"] == pytest.approx(first_epoch, rel=1e-5)

    # With a moving average, evaluations use it: the best epoch's average comes back with
    # its weights (the checkpoint's evaluated at the last epoch's average).
    best_at_first = keras.callbacks.EarlyStopping(
        monitor="val_loss", mode="max", patience=1, restore_best_weights=True
    )
    averaged = trainer.Optimization(ema_decay=0.5)
    est = estimator(tmp_path / "ema", optimization=averaged)
    csv = keras.callbacks.CSVLogger(str(tmp_path / "ema.csv"))
    est.train_and_evaluate(
        input_fn, input_fn, 100, eval_every_steps=5, eval_steps=2, callbacks=[best_at_first, csv]
    )
    assert est.step == 10
    first_epoch = float(csv_rows(tmp_path / "ema.csv")[0]["val_loss"])
    restored = estimator(tmp_path / "ema", optimization=averaged)
    assert restored.evaluate(input_fn, steps=2)["loss"] == pytest.approx(first_epoch, rel=1e-5)


def test_trains_epochs_are_log_periods_and_callbacks_see_each_block(tmp_path, input_fn):
    """In train an epoch ends at each log step; a batch event ends each compiled block,
    its index counted in the epoch; stop_training set by a callback stops at the block's
    end with a checkpoint; callback.model gets and sets a ModelFn's weights."""
    events = []
    est = estimator(tmp_path)

    class Watch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            events.append(("begin", epoch, est.step))

        def on_train_batch_end(self, batch, logs=None):
            events.append(("batch", batch, est.step, sorted(logs)))
            if est.step == 14:
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            events.append(("end", epoch, est.step, sorted(logs)))

        def on_checkpoint(self, step, path):
            events.append(("checkpoint", step, os.path.basename(path)))

        def on_train_end(self, logs=None):
            weights = self.model.get_weights()
            assert sorted(w.shape for w in weights) == [(10,), (16,), (16, 10), (64, 16)]
            self.model.set_weights([np.zeros_like(w) for w in weights])

    est.train(input_fn, 100, callbacks=[Watch()])
    metrics = ["accuracy", "loss"]  # fit's: no learning_rate unless a callback adds it
    assert events == [
        ("begin", 0, 0),
        ("batch", 3, 4, ["accuracy", "loss"]),
        ("batch", 4, 5, ["accuracy", "loss"]),
        ("end", 0, 5, metrics),
        ("checkpoint", 5, "ckpt-5"),
        ("begin", 1, 5),
        ("batch", 3, 9, ["accuracy", "loss"]),
        ("batch", 4, 10, ["accuracy", "loss"]),
        ("end", 1, 10, metrics),
        ("checkpoint", 10, "ckpt-10"),
        ("begin", 2, 10),
        ("batch", 3, 14, ["accuracy", "loss"]),
        ("end", 2, 14, metrics),
    ]  # the last checkpoint follows on_train_end
    assert est.step == 14 and checkpoint_steps(tmp_path) == [5, 10, 14]
    kept = estimator(tmp_path)  # the weights set at on_train_end are the checkpoint's
    assert kept.evaluate(input_fn, steps=1)["loss"] == pytest.approx(np.log(10), rel=1e-6)


@pytest.mark.slow
def test_lambda_callbacks_get_fits_arguments_and_csv_rows_fits_columns(tmp_path, input_fn):
    """Ported from Keras's LambdaCallback and CSVLogger tests: every begin event is given
    ``(index, logs)``, and a CSVLogger row has the columns fit writes (no learning_rate)."""

    def callbacks(name, seen):
        return [
            keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: seen.append(("epoch", epoch, dict(logs))),
                on_train_batch_begin=lambda batch, logs: seen.append(("batch", dict(logs))),
            ),
            keras.callbacks.CSVLogger(str(tmp_path / f"{name}.csv")),
        ]

    ours = []
    est = estimator(tmp_path / "run", compiled_linear())
    est.train_and_evaluate(
        input_fn, input_fn, 10, eval_every_steps=5, eval_steps=2, callbacks=callbacks("ours", ours)
    )
    assert [e for e in ours if e[0] == "epoch"] == [("epoch", 0, {}), ("epoch", 1, {})]
    assert {e[1] == {} for e in ours if e[0] == "batch"} == {True}

    fits = []
    fit_blank(compiled_linear(), 2, callbacks("fit", fits))
    assert [e for e in fits if e[0] == "epoch"] == [("epoch", 0, {}), ("epoch", 1, {})]
    with open(tmp_path / "ours.csv") as f, open(tmp_path / "fit.csv") as g:
        assert f.readline() == g.readline() == "epoch,accuracy,loss,val_accuracy,val_loss\n"


@pytest.mark.slow
def test_a_second_call_begins_its_callbacks_afresh_as_a_second_fit_does(tmp_path, input_fn):
    """Keras resets EarlyStopping in on_train_begin: a second fit with the same callback
    waits its patience again. So does a second train_and_evaluate (it stopped after one
    epoch); a new EarlyStopping with other settings does not take the old one's state."""
    model = compiled_linear()
    plateau = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=10.0)
    fits = [len(fit_blank(model, 100, [plateau]).epoch) for _ in range(2)]
    assert fits == [3, 3]

    est = estimator(tmp_path / "run")
    plateau = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=10.0)
    steps = []
    for _ in range(2):
        est.train_and_evaluate(
            input_fn, input_fn, 100, eval_every_steps=5, eval_steps=1, callbacks=[plateau]
        )
        steps.append(est.step)
    assert steps == [15, 30]  # 3 epochs of 5 steps each time, as fit's
    other = keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, min_delta=10.0)
    est.train_and_evaluate(
        input_fn, input_fn, 100, eval_every_steps=5, eval_steps=1, callbacks=[other]
    )
    assert est.step == 50  # its own patience from its first epoch: 4 epochs


@pytest.mark.slow
def test_a_stop_mid_epoch_validates_and_ends_the_epoch_as_fit_does(tmp_path, input_fn):
    """A callback that sets stop_training in on_train_batch_end: fit leaves the epoch's
    batches, then validates and calls on_epoch_end (a CSVLogger row) before on_train_end."""

    class StopAt(keras.callbacks.Callback):
        def __init__(self, batch):
            super().__init__()
            self.batch, self.seen = batch, []

        def on_train_batch_end(self, batch, logs=None):
            if batch == self.batch:
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(("epoch_end", epoch, sorted(logs)))

        def on_train_end(self, logs=None):
            self.seen.append(("train_end",))

    fit_stop = StopAt(0)
    fit_blank(compiled_linear(), 3, [fit_stop])
    est = estimator(tmp_path / "run", compiled_linear())
    ours = StopAt(3)  # the block that ends at step 4, in the first 5-step epoch
    est.train_and_evaluate(
        input_fn,
        input_fn,
        100,
        eval_every_steps=5,
        eval_steps=1,
        callbacks=[ours, keras.callbacks.CSVLogger(str(tmp_path / "rows.csv"))],
    )
    assert est.step == 4
    assert (
        ours.seen
        == fit_stop.seen
        == [
            ("epoch_end", 0, ["accuracy", "loss", "val_accuracy", "val_loss"]),
            ("train_end",),
        ]
    )
    assert [r["epoch"] for r in csv_rows(tmp_path / "rows.csv")] == ["0"]


def test_streamed_metrics_are_in_the_training_epoch_logs_as_fit_has_them(tmp_path):
    """AUC and F1 (no mean of per-example values) in each epoch's training logs: the
    CSVLogger rows equal fit's on the same batches, training and validation columns alike
    (training had none of them: evaluation's copies are apart, so its reset leaves them);
    and in TensorBoard's training curves."""
    data = load_digits()
    x = data.images[:448, :, :, None].astype("float32") / 16.0
    y = (data.target[:448, None] % 2 == 0).astype("float32")

    def model():
        keras.utils.set_random_seed(0)
        made = keras.Sequential(
            [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(1, "sigmoid")]
        )
        f1 = keras.metrics.F1Score(threshold=0.5, name="f1")
        made.compile(keras.optimizers.SGD(0.1), "binary_crossentropy", metrics=["auc", f1])
        return made

    def input_fn(mode, params):
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(params.batch_size)
        return batches.repeat() if mode == Mode.TRAIN else batches

    fit_csv = keras.callbacks.CSVLogger(str(tmp_path / "fit.csv"))
    model().fit(x, y, 32, 2, verbose=0, shuffle=False, validation_data=(x, y), callbacks=[fit_csv])
    ours = keras.callbacks.CSVLogger(str(tmp_path / "ours.csv"))
    estimator(tmp_path / "run", model()).train_and_evaluate(
        input_fn, input_fn, 28, eval_every_steps=14, callbacks=[ours]
    )
    fits, rows = csv_rows(tmp_path / "fit.csv"), csv_rows(tmp_path / "ours.csv")
    assert list(rows[0]) == list(fits[0]) == [
        "epoch", "auc", "f1", "loss", "val_auc", "val_f1", "val_loss"
    ]  # fmt: skip
    for row, fit_row in zip(rows, fits, strict=True):
        for column, value in fit_row.items():  # fit writes F1's [1] result as "[0.698]"
            expected = float(value.strip('"[]'))
            assert float(row[column]) == pytest.approx(expected, abs=2e-5), column
    assert float(rows[1]["auc"]) > float(rows[0]["auc"])  # epochs apart, not one running sum
    # TensorBoard's training curves have them too, as they stand in the epoch at each
    # log step (as Keras's batch logs do): at an epoch's last step, the epoch's value.
    for name in ("auc", "f1"):
        curve = dict(scalar_series(str(tmp_path / "run" / "train"), name))
        assert sorted(curve) == [5, 10, 14, 15, 20, 25, 28], name
        for row, end in zip(rows, (14, 28), strict=True):
            assert curve[end] == pytest.approx(float(row[name]), abs=1e-6), (name, end)


@pytest.mark.parametrize(
    "given, says",
    [
        (keras.callbacks.ModelCheckpoint("m.keras"), "ModelCheckpoint works only inside"),
        (keras.callbacks.BackupAndRestore("b"), "resumes from model_dir's newest checkpoint"),
        (keras.callbacks.TensorBoard(), "writes TensorBoard event files to model_dir"),
        (lambda step, logs: None, "takes keras.callbacks.Callback objects, got function"),
    ],
)
def test_callbacks_that_work_only_in_fit_are_refused_in_one_line(tmp_path, given, says):
    with pytest.raises(UserError, match=says) as refused:
        estimator(tmp_path).train(lambda mode, params: None, 10, callbacks=[given])
    assert "\n" not in str(refused.value)
    assert not os.listdir(tmp_path)


@gin.configurable("callbacks_taken")
def callbacks_taken(callbacks=None):
    return callbacks


@pytest.mark.parametrize(
    "binding, says",
    [
        (
            "[@callbacks.ModelCheckpoint()]",  # without the filepath it would need
            "keras.callbacks.ModelCheckpoint works only inside model.fit: the framework "
            "checkpoints model_dir itself",
        ),
        ("[@callbacks.BackupAndRestore()]", "keras.callbacks.BackupAndRestore works only"),
        ("[@callbacks.ProgbarLogger()]", "keras.callbacks.ProgbarLogger works only inside"),
        ("[@callbacks.SwapEMAWeights()]", "keras.callbacks.SwapEMAWeights works only inside"),
        ("[@callbacks.ModelCheckpoint]", "keras.callbacks.ModelCheckpoint works only inside"),
        (
            "[@callbacks.EarlyStopping]",
            "callbacks takes keras.callbacks.Callback objects, got the class EarlyStopping "
            "(in gin, write @callbacks.EarlyStopping() with parentheses)",
        ),
    ],
)
def test_callbacks_named_in_gin_are_refused_as_from_python(binding, says):
    from trainer.cli import gin_config  # noqa: F401 (registers gin's callbacks)

    gin.parse_config([f"callbacks_taken.callbacks = {binding}"])
    with pytest.raises(UserError) as refused:
        trainer.callbacks.checked(callbacks_taken())
    assert errors.first_line(refused.value).startswith(says), refused.value


@pytest.mark.parametrize(
    "given, says",
    [
        (  # made in the test: an optimizer made at import would run ops before worker_run
            lambda: dict(
                optimizer=keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.1, 9))
            ),
            "but SGD's is a schedule (CosineDecay), which Keras cannot set (fit fails alike)",
        ),
        (
            lambda: dict(
                optimization=trainer.Optimization(learning_rate_multipliers={"logits": 0.5})
            ),
            "which Optimization.learning_rate_multipliers makes a schedule per rule",
        ),
    ],
)
@pytest.mark.parametrize("setter", ["ReduceLROnPlateau", "LearningRateScheduler"])
def test_a_callback_that_sets_a_scheduled_rate_is_refused_before_training(
    tmp_path, input_fn, given, says, setter
):
    callback = (
        keras.callbacks.ReduceLROnPlateau(patience=1)
        if setter == "ReduceLROnPlateau"
        else keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate / 2)
    )
    est = Estimator(MLP(hidden_units=[16]), str(tmp_path), progress=False, **given())
    with pytest.raises(UserError) as refused:
        est.train_and_evaluate(input_fn, input_fn, 10, eval_every_steps=5, callbacks=[callback])
    assert str(refused.value).startswith(f"keras.callbacks.{setter} sets the optimizer's")
    assert says in str(refused.value)
    assert checkpoint_steps(tmp_path) == []


def test_a_monitor_whose_direction_is_unknown_is_refused_before_training(tmp_path, input_fn):
    unknown = keras.callbacks.EarlyStopping(monitor="val_my_score")
    with pytest.raises(UserError, match=r"monitor='val_my_score'\) cannot tell .* mode='max'"):
        estimator(tmp_path).train_and_evaluate(input_fn, input_fn, 10, callbacks=[unknown])
    assert checkpoint_steps(tmp_path) == []
    known = keras.callbacks.EarlyStopping(monitor="val_accuracy")
    est = estimator(tmp_path)
    est.train_and_evaluate(input_fn, input_fn, 5, eval_steps=1, callbacks=[known])
    assert known.monitor_op is not None and est.step == 5
    for name in ("val_acc", "acc", "val_auc"):  # compile()'s "acc" too, as fit infers it
        callback = keras.callbacks.EarlyStopping(monitor=name)
        trainer.callbacks.set_direction(callback)
        assert callback.monitor_op(1.0, 0.0), name  # higher is better


@pytest.mark.slow
def test_on_two_workers_the_chiefs_callbacks_stop_and_slow_both(tmp_path, data_dir):
    """Callbacks run on the chief; its stop and its reduced learning rate reach the other
    worker, which stops at the same step and trains at the same rate (the weights of
    the two would part otherwise)."""
    digits.load("train", data_dir)  # built once, before the workers read it
    runs = on_workers(
        2, "tests.support.callback_runs", "worker_run", str(tmp_path / "run"), data_dir
    )
    assert [run["step"] for run in runs] == [15, 15]
    assert [run["rate"] for run in runs] == pytest.approx([0.001, 0.001])
    np.testing.assert_allclose(runs[1]["weights"], runs[0]["weights"], rtol=1e-6)
    assert [r["epoch"] for r in csv_rows(tmp_path / "run.csv")] == ["0", "1", "2"]


@pytest.mark.slow
def test_terminate_on_nan_stops_as_in_fit_and_the_checkpoint_stays_whole(tmp_path):
    """TerminateOnNaN owns a NaN loss it is given (the NaN guard raised before it could
    see one): training stops gracefully after that batch, the epoch ends (a CSV row),
    on_train_end runs; raise_error=True raises fit's RuntimeError before on_train_end.
    Its NaN weights, as fit leaves them, are never saved."""
    images = np.zeros((128, 8, 8, 1), np.float32)
    images[70] = np.nan  # in the third batch of 32
    labels = np.arange(128) % 10

    def input_fn(mode, params):
        data = tf.data.Dataset.from_tensor_slices((images, labels)).batch(params.batch_size)
        return data.repeat() if mode == trainer.Mode.TRAIN else data

    def run(raise_error, name):
        ends = []
        watch = keras.callbacks.LambdaCallback(on_train_end=lambda logs: ends.append(logs))
        csv = keras.callbacks.CSVLogger(str(tmp_path / f"{name}.csv"))
        return [keras.callbacks.TerminateOnNaN(raise_error=raise_error), csv, watch], ends

    given, ended = run(False, "fit")
    history = compiled_linear().fit(
        images, labels, batch_size=32, epochs=3, verbose=0, callbacks=given
    )
    assert len(history.epoch) == 1 and len(ended) == 1  # stopped in epoch 0, gracefully
    given, ended = run(False, "ours")
    est = Estimator(
        compiled_linear(),
        str(tmp_path / "run"),
        global_batch_size=32,
        steps_per_loop=1,
        log_every_steps=4,
        checkpoints=Checkpoints(every_steps=4),
        progress=False,
    )
    est.train_and_evaluate(input_fn, input_fn, 12, eval_every_steps=4, callbacks=given)
    assert est.step == 2 and len(ended) == 1  # the NaN step, the third, is not counted
    ours, fits = csv_rows(tmp_path / "ours.csv"), csv_rows(tmp_path / "fit.csv")
    assert [r["epoch"] for r in ours] == [r["epoch"] for r in fits] == ["0"]
    assert ours[0]["val_loss"] == "nan"  # the epoch ends on the weights the step left
    assert checkpoint_steps(tmp_path / "run") == []  # whole weights or none: none yet

    given, ended = run(True, "raised")
    with pytest.raises(RuntimeError, match="NaN or Inf loss encountered"):
        compiled_linear().fit(images, labels, batch_size=32, epochs=3, verbose=0, callbacks=given)
    assert ended == []
    given, ended = run(True, "raised")
    with pytest.raises(RuntimeError, match="NaN or Inf loss encountered"):
        est = Estimator(compiled_linear(), str(tmp_path / "raised"), global_batch_size=32,
                        steps_per_loop=1, progress=False)  # fmt: skip
        est.train(input_fn, 12, callbacks=given)
    assert ended == []

    refused = Estimator(
        compiled_linear(),
        str(tmp_path / "rollback"),
        optimization=trainer.Optimization(nonfinite_loss="rollback"),
        progress=False,
    )
    with pytest.raises(UserError, match="never sees a NaN loss under"):
        refused.train(input_fn, 12, callbacks=[keras.callbacks.TerminateOnNaN()])
