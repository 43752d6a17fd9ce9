"""Keras models as they are: compiled models train, resume, export and keep their weights."""

import functools
import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.metrics import f1_score, precision_score, roc_auc_score

from datasets import digits
from tests.support.commands import run_cli
from tests.support.helpers import event_tags
from trainer import Estimator, InputParams, Mode, UserError, keras_step, set_precision
from trainer.errors import TrainingDiverged
from trainer.settings import BestExport, Checkpoints, Devices, Optimization, Summaries


def digits_cnn(seed=0, learning_rate=3e-3):
    """A user's compiled Keras CNN for digits, as Keras users write one."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_cnn",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


SERVE = """
import json, sys
import numpy as np, tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
print(json.dumps(serve(image=tf.constant(np.load(sys.argv[2])))["output"].numpy().argmax(1).tolist()))
"""


def make(model, model_dir, **options):
    """The Estimator of these tests; ``options`` add to or replace its settings."""
    settings = dict(
        global_batch_size=32,
        steps_per_loop=50,
        checkpoints=Checkpoints(every_steps=100),
        seed=0,
        summaries=Summaries(write_graph=False),
        progress=False,
    )
    return Estimator(model, str(model_dir), **{**settings, **options})


@pytest.fixture
def input_fn(data_dir):
    return functools.partial(digits.input_fn, data_dir=data_dir)


@pytest.mark.slow
def test_compiled_sequential_trains_resumes_exactly_and_keeps_its_weights(tmp_path, input_fn):
    model = digits_cnn()
    estimator = make(model, tmp_path / "run")
    estimator.train(input_fn, max_steps=300)
    metrics = estimator.evaluate(input_fn)
    assert set(metrics) == {"loss", "accuracy"} and metrics["accuracy"] >= 0.95
    assert isinstance(estimator.optimizer, keras.optimizers.Adam)  # compile()'s optimizer

    # The Keras object holds the trained weights: Keras's predict, and Keras's load of
    # a saved .keras file, give the framework's predictions; so does the SavedModel.
    features, _ = next(
        iter(input_fn(Mode.EVAL, InputParams(batch_size=360, global_batch_size=360)))
    )
    ours = np.stack([p["output"] for p in estimator.predict(input_fn)])
    np.testing.assert_allclose(model.predict(features["image"], verbose=0), ours, atol=1e-6)
    model.save(tmp_path / "cnn.keras")
    loaded = keras.models.load_model(tmp_path / "cnn.keras")
    np.testing.assert_allclose(loaded.predict(features["image"], verbose=0), ours, atol=1e-6)
    exported = estimator.export(input_fn)
    stored = np.round(features["image"].numpy() * 255).astype("uint8")  # as the records hold them
    np.save(tmp_path / "images.npy", stored)
    served = subprocess.run(
        [sys.executable, "-c", SERVE, exported, str(tmp_path / "images.npy")],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=120,
    )
    assert served.returncode == 0, served.stderr[-2000:]
    assert json.loads(served.stdout.splitlines()[-1]) == ours.argmax(axis=1).tolist()

    # Resume: 150 + 150 steps in two Estimators equal 300 straight, bit for bit.
    make(digits_cnn(), tmp_path / "split").train(input_fn, max_steps=150)
    resumed = make(digits_cnn(seed=7), tmp_path / "split")  # other init: all restored
    resumed.train(input_fn, max_steps=300)
    for a, b in zip(model.weights, resumed.model_fn.model.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def two_headed(seed=0):
    """A compiled functional model: two named inputs, two named outputs and losses."""
    keras.utils.set_random_seed(seed)
    pixels, ink = keras.Input((64,), name="pixels"), keras.Input((1,), name="ink")
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([pixels, ink]))
    model = keras.Model(
        {"pixels": pixels, "ink": ink},
        {
            "digit": keras.layers.Dense(10, activation="softmax", name="digit")(hidden),
            "even": keras.layers.Dense(1, activation="sigmoid", name="even")(hidden),
        },
    )
    model.compile(
        "adam",
        loss={"digit": "sparse_categorical_crossentropy", "even": "binary_crossentropy"},
        loss_weights={"digit": 1.0, "even": 0.5},
        metrics={"digit": ["accuracy"], "even": ["accuracy", "mae"]},
    )
    return model


def two_headed_input_fn(mode, params):
    """Digits as two features (pixels, ink) and two labels (digit, even)."""
    images, labels = load_digits(return_X_y=True)
    part = slice(0, 1437) if mode == Mode.TRAIN else slice(1437, None)
    pixels = (images[part] / 16).astype("float32")
    features = {"pixels": pixels, "ink": pixels.sum(1, keepdims=True) / 64}
    targets = {"digit": labels[part], "even": (labels[part] % 2 == 0).astype("float32")}
    dataset = tf.data.Dataset.from_tensor_slices((features, targets))
    if mode == Mode.TRAIN:
        dataset = dataset.shuffle(1437, seed=params.seed).repeat()
    return dataset.batch(params.batch_size)


def test_compiled_functional_model_with_two_heads_evaluates_as_keras_does(tmp_path):
    model = two_headed()
    estimator = make(model, tmp_path / "run")
    estimator.train(two_headed_input_fn, max_steps=200)
    ours = estimator.evaluate(two_headed_input_fn)
    features, labels = next(iter(two_headed_input_fn(Mode.EVAL, InputParams(360, 360))))
    # In one batch: Keras averages its per-output losses over batches unweighted, so a
    # short last batch would count more there (the framework's are over examples).
    theirs = model.evaluate(features, labels, batch_size=360, return_dict=True, verbose=0)
    assert set(ours) == set(theirs)  # loss, digit_loss, even_loss, *_accuracy, even_mae
    for name, value in theirs.items():
        assert ours[name] == pytest.approx(value, abs=1e-5), name
    assert ours["even_accuracy"] > 0.75 and ours["digit_accuracy"] > 0.75  # it learned


def even_digits(mode, params, data_dir):
    """Digits as a binary task: is the digit even? (label 1.0 if it is)."""
    dataset = digits.input_fn(mode, params, data_dir=data_dir)
    return dataset.map(
        lambda features, labels: (
            features,
            {"even": tf.cast(labels["label"] % 2 == 0, tf.float32)},
        )
    )


def test_compiled_auc_and_precision_stream_over_the_eval_set(tmp_path, data_dir):
    """Keras metrics that are not a mean of per-example values, as compile() names them."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(1, "sigmoid")]
    )
    # Named: Keras names an unnamed Precision by a count of those made in the process
    # ('precision_1' after another test's), which made this test depend on the order.
    precision = keras.metrics.Precision(name="precision")
    f1 = keras.metrics.F1Score(threshold=0.5, name="f1")  # its result has shape [1]: refused
    model.compile("adam", "binary_crossentropy", metrics=["auc", precision, f1])
    input_fn = functools.partial(even_digits, data_dir=data_dir)
    estimator = make(model, tmp_path / "run", best_export=BestExport(metric="auc"))
    results = estimator.train_and_evaluate(input_fn, input_fn, max_steps=200, eval_every_steps=100)
    metrics = results["eval"]
    assert set(metrics) == {"loss", "auc", "precision", "f1"}

    even = np.array([p["output"][0] for p in estimator.predict(input_fn)])
    _, labels = next(iter(input_fn(Mode.EVAL, InputParams(360, 360))))
    truth = labels["even"].numpy()
    assert abs(metrics["auc"] - roc_auc_score(truth, even)) < 0.005
    assert metrics["precision"] == pytest.approx(precision_score(truth, even > 0.5), abs=1e-6)
    assert metrics["f1"] == pytest.approx(f1_score(truth, even > 0.5), abs=1e-6)
    features, _ = next(iter(input_fn(Mode.EVAL, InputParams(360, 360))))
    # [batch, 1] labels: Keras's F1Score takes no other shape
    keras_metrics = model.evaluate(features["image"], truth[:, None], verbose=0, return_dict=True)
    assert metrics["auc"] == pytest.approx(keras_metrics["auc"], abs=1e-6)
    assert metrics["f1"] == pytest.approx(keras_metrics["f1"], abs=1e-6)

    # Written where every metric goes, and ranked by the best export.
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evaluations = [line for line in lines if line["writer"] == "eval_eval"]
    assert [line["step"] for line in evaluations] == [100, 200]
    assert all("auc" in line and "precision" in line for line in evaluations)
    assert {"auc", "precision"} <= event_tags(str(tmp_path / "run" / "eval_eval"))
    best = json.loads((tmp_path / "run" / "export" / "best" / "best.json").read_text())
    assert best == [{"step": 200, "value": evaluations[-1]["auc"]}]  # auc rose: 200's kept
    assert evaluations[-1]["auc"] > evaluations[0]["auc"]


def test_mixed_precision_and_weight_averaging_take_a_keras_model(tmp_path, input_fn):
    """A compiled model made under mixed_bfloat16 trains in it; the export holds its EMA."""
    set_precision("mixed_bfloat16")
    try:
        model = digits_cnn()
    finally:
        set_precision(None)
    assert model.layers[0].compute_dtype == "bfloat16"
    estimator = make(
        model,
        tmp_path / "run",
        devices=Devices(mixed_precision="mixed_bfloat16"),
        optimization=Optimization(ema_decay=0.9),
    )
    estimator.train(input_fn, max_steps=200)
    assert estimator.evaluate(input_fn)["accuracy"] >= 0.9
    exported = tf.saved_model.load(estimator.export(input_fn)).signatures["serving_features"]
    features, _ = next(iter(input_fn(Mode.EVAL, InputParams(360, 360))))
    served = exported(image=features["image"])["output"].numpy().argmax(1)
    ours = np.stack([p["output"] for p in estimator.predict(input_fn)]).argmax(1)
    assert (served == ours).mean() == 1.0  # both the averaged weights


@pytest.mark.slow
def test_a_compiled_keras_model_trains_alike_on_two_workers(tmp_path, data_dir):
    """The gin experiment's Keras model across 2 worker processes, as on one: the same
    examples and updates (the same loss at step 100, to rounding; the sums' order
    differs, which Adam amplifies later), and the header's accuracy."""
    args = [
        "--gin_file",
        "experiments/digits_keras.gin",
        "--gin_param",
        "experiment.max_steps = 200",
        "--gin_param",
        f"digits.input_fn.data_dir = '{data_dir}'",
    ]
    one = run_cli(*args, "--model_dir", str(tmp_path / "one"), unset=["TF_CONFIG"])
    two = run_cli(
        *args, "--model_dir", str(tmp_path / "two"), "--workers", "2", unset=["TF_CONFIG"]
    )
    for proc in (one, two):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "multi_worker over 2 replicas" in two.stdout

    def value(stdout, start, name):
        line = next(x for x in stdout.splitlines() if x.startswith(start))
        return float(re.search(rf"\b{name} ([\d.e-]+)", line).group(1))

    train = [value(p.stdout, "step 100/200", "loss") for p in (one, two)]
    assert train[1] == pytest.approx(train[0], rel=2e-3)
    for proc in (one, two):
        assert value(proc.stdout, "Evaluation of 'eval' at step 200", "accuracy") >= 0.95


class Subclassed(keras.Model):
    """A subclassed Keras model, as Keras's guides write one."""

    def __init__(self):
        super().__init__(name="subclassed")
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.classes = keras.layers.Dense(10, activation="softmax")

    def call(self, image, training=False):
        return self.classes(self.hidden(self.flatten(image)))


def test_a_compiled_subclassed_model_trains_and_holds_its_weights(tmp_path, input_fn):
    keras.utils.set_random_seed(0)
    model = Subclassed()
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    estimator = make(model, tmp_path / "run")
    estimator.train(input_fn, max_steps=200)
    assert estimator.evaluate(input_fn)["accuracy"] >= 0.9
    features, _ = next(iter(input_fn(Mode.EVAL, InputParams(8, 8))))
    ours = np.stack([p["output"] for p in estimator.predict(input_fn)][:8])
    np.testing.assert_allclose(model.predict(features["image"], verbose=0), ours, atol=1e-6)


def test_a_keras_model_made_before_the_precision_policy_is_named(tmp_path):
    with pytest.raises(UserError) as error:
        make(digits_cnn(), tmp_path / "run", devices=Devices(mixed_precision="mixed_bfloat16"))
    assert str(error.value) == (
        "Devices.mixed_precision is 'mixed_bfloat16' but the layers of Keras model "
        "'digits_cnn' compute in 'float32': call trainer.set_precision('mixed_bfloat16') "
        "before making the model (python -m trainer does)"
    )
    assert not (tmp_path / "run").exists()


def user_module(name):
    """A module of tests/user_project, imported as its user imports it."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "user_project"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def gan_estimator(model, model_dir, **options):
    """Batches of 64, one log at step 7."""
    return make(model, model_dir, **{"global_batch_size": 64, "log_every_steps": 7, **options})


@pytest.mark.slow
def test_a_keras_models_own_train_step_trains_as_fit_does_and_resumes_exactly(tmp_path):
    """keras.io's DCGAN, whose train_step applies its two optimizers: the framework's
    steps are fit's on the same batches from the same weights, also when stopped and
    resumed by a new model object; the logs are fit's epoch means."""
    dcgan = user_module("dcgan")
    images = load_digits().images[:448, :, :, None].astype("float32") / 16.0  # 7 batches

    def input_fn(mode, params):  # the images alone, as the example's dataset yields them
        return tf.data.Dataset.from_tensor_slices(images).batch(params.batch_size).repeat()

    reference = dcgan.make()
    history = reference.fit(images, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    whole = dcgan.make()
    gan_estimator(whole, tmp_path / "whole", steps_per_loop=7).train(input_fn, 7)
    stopped = gan_estimator(dcgan.make(), tmp_path / "stopped", steps_per_loop=2)
    assert stopped.train(input_fn, 4) == 4
    resumed = dcgan.make()  # another object: its weights, optimizers and seeds restored
    assert gan_estimator(resumed, tmp_path / "stopped").train(input_fn, 7) == 7
    for model in (whole, resumed):
        for theirs, mine in zip(reference.weights, model.weights, strict=True):
            np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-6, err_msg=mine.path)
    assert resumed.d_optimizer.iterations.numpy() == resumed.g_optimizer.iterations.numpy() == 7
    (logged,) = [json.loads(line) for line in (tmp_path / "whole/metrics.jsonl").open()]
    assert logged["step"] == 7 and "gradient_norm" not in logged
    for name in ("d_loss", "g_loss"):  # fit's mean over the epoch, ours over the log period
        assert logged[name] == pytest.approx(history[name][0], rel=1e-5), name
    assert logged["loss"] == pytest.approx(logged["d_loss"] + logged["g_loss"], rel=1e-6)


class CustomModel(keras.Sequential):
    """keras.io's "Customizing what happens in fit()": compiled loss, metrics, optimizer."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def test_a_train_step_with_keras_compiled_loss_and_optimizer_trains_and_evaluates(tmp_path):
    """self.compute_loss, self.optimizer and self.metrics as Keras provides them: fit's
    weights after 7 steps; evaluated with the compiled loss and metrics."""
    digits_data = load_digits()
    x = digits_data.images[:448, :, :, None].astype("float32") / 16.0
    y = digits_data.target[:448]

    def model():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]
        made = CustomModel(layers, name="custom")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        made.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"])
        return made

    def input_fn(mode, params):
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(params.batch_size)
        return data.repeat() if mode == Mode.TRAIN else data

    reference = model()
    reference.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    ours = model()
    estimator = gan_estimator(ours, tmp_path)
    metrics = estimator.train_and_evaluate(input_fn, input_fn, 7)["eval"]
    for theirs, mine in zip(reference.weights, ours.weights, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-6, err_msg=mine.path)
    evaluated = reference.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert metrics["loss"] == pytest.approx(evaluated["loss"], rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(evaluated["accuracy"], abs=1e-6)

    # The framework's own datasets keep labels in a dict ({'label': ids}): the step is
    # handed the one tensor, as (x, y) (it failed: "got label of type 'str'").
    def labelled(mode, params):
        return input_fn(mode, params).map(lambda images, ids: (images, {"label": ids}))

    again = model()
    gan_estimator(again, tmp_path / "labelled").train(labelled, 7)
    for theirs, mine in zip(reference.weights, again.weights, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-6, err_msg=mine.path)


@pytest.mark.slow
def test_a_keras_models_own_train_step_refuses_what_it_cannot_honour(tmp_path):
    """Settings its own updates cannot reach, and an evaluation without a loss; a NaN
    its step meets stops training at that step, the last checkpoint untouched."""
    dcgan = user_module("dcgan")
    images = np.random.default_rng(0).random([320, 8, 8, 1], np.float32)
    images[64 * 4 + 3] = np.nan  # in the 5th batch
    estimator = gan_estimator(
        dcgan.make(), tmp_path / "nan", steps_per_loop=2, checkpoints=Checkpoints(every_steps=2)
    )
    with pytest.raises(TrainingDiverged, match=r"^loss or gradients NaN or Inf at step 5; the "):
        estimator.train(
            lambda mode, params: tf.data.Dataset.from_tensor_slices(images).batch(64).repeat(), 7
        )
    assert sorted(os.listdir(tmp_path / "nan")).count("ckpt-4.index") == 1
    fixes = {
        "Optimization.microbatches": (dict(optimization=Optimization(microbatches=2)), "remove it"),
        "Optimization.clip_gradient_norm": (
            dict(optimization=Optimization(clip_gradient_norm=1.0)),
            "clip in the step, or in its optimizers",
        ),
        "an optimizer given to the Estimator": (
            dict(optimizer=keras.optimizers.SGD()),
            "give it to the model's compile()",
        ),
        # Ignored before, while the log said which variables they matched.
        "Optimization.frozen_until_step": (
            dict(optimization=Optimization(frozen_until_step={"generator": 10})),
            "scale or hold back those variables' updates in the step",
        ),
        "Optimization.learning_rate_multipliers": (
            dict(optimization=Optimization(learning_rate_multipliers={"discriminator": 0.5})),
            "scale or hold back those variables' updates in the step",
        ),
    }
    for setting, (options, fix) in fixes.items():
        with pytest.raises(UserError) as raised:
            gan_estimator(dcgan.make(), tmp_path, **options)
        assert re.fullmatch(
            rf"Keras model 'gan(_\d+)?' applies its own updates in its train_step, which "
            rf"{re.escape(setting)} cannot reach: {re.escape(fix)}",
            str(raised.value),
        ), str(raised.value)
    with pytest.raises(
        UserError,
        match=r"which several devices or a tf.distribute strategy "
        r"cannot reach: train it on one device \(--num_devices 1\)$",
    ):
        keras_step.check(dcgan.make(), distributed=True)  # as ModelState checks a placement
    images = np.zeros([64, 8, 8, 1], np.float32)
    labelled = lambda mode, params: tf.data.Dataset.from_tensors((images, np.zeros(64)))  # noqa: E731
    with pytest.raises(
        UserError,
        match=r"trains with its own train_step and has no compiled "
        r"loss to evaluate with: train it \(--schedule train\)",
    ):
        gan_estimator(dcgan.make(), tmp_path / "eval").evaluate(labelled)


def test_a_model_of_mixed_labels_evaluates_on_class_ids_as_keras_does_on_one_hot_rows():
    """README's MixUp with a model compiled with categorical_crossentropy: training takes
    the mixed distributions; the eval set keeps class ids, which were refused. They
    are taken one-hot, as a Keras user's own evaluation would; in training, class ids
    to such a loss are still refused, as fit refuses them."""
    from trainer import KerasModel

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,), name="x"), keras.layers.Dense(3)])
    model.compile(
        "sgd", keras.losses.CategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    ids = np.arange(16) % 3
    expected = model.evaluate(x, np.eye(3)[ids], verbose=0, return_dict=True)
    spec = KerasModel(model)({"x": tf.constant(x)}, {"label": tf.constant(ids)}, Mode.EVAL)
    assert float(tf.reduce_mean(spec.loss)) == pytest.approx(expected["loss"], rel=1e-6)
    assert float(tf.reduce_mean(spec.metrics["accuracy"])) == pytest.approx(expected["accuracy"])
    with pytest.raises(UserError, match=r"class ids take sparse_categorical_crossentropy"):
        KerasModel(model)({"x": tf.constant(x)}, {"label": tf.constant(ids)}, Mode.TRAIN)
    mixed = tf.constant(np.eye(3)[ids] * 0.8 + 0.2 / 3, tf.float32)
    sparse = keras.Sequential([keras.Input((6,), name="x"), keras.layers.Dense(3)])
    sparse.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(UserError, match=r"class distributions \(MixUp, CutMix, soft labels\) "):
        KerasModel(sparse)({"x": tf.constant(x)}, {"label": mixed}, Mode.TRAIN)


def test_a_keras_model_frozen_whole_is_refused_for_what_it_is(tmp_path):
    """fit runs it and updates nothing; the advice was written for a ModelFn ("create its
    Keras layers as attributes in __init__")."""
    model = keras.Sequential([keras.Input((6,), name="x"), keras.layers.Dense(3)], name="frozen")
    model.trainable = False
    model.compile("sgd", "sparse_categorical_crossentropy")
    data = tf.data.Dataset.from_tensor_slices((np.zeros((16, 6), "float32"), np.zeros(16, int)))
    estimator = Estimator(model, str(tmp_path), global_batch_size=8, progress=False)
    with pytest.raises(UserError) as refused:
        estimator.train(lambda mode, params: data.repeat().batch(params.batch_size), 2)
    assert str(refused.value) == (
        "Keras model 'frozen' has no trainable variables (every layer is frozen): training "
        "would change nothing (fit runs it all the same); set trainable = True on the layers "
        "to train"
    )
