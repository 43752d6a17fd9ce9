"""The parity harness: one Keras model trained a few steps two ways, compared.

A *row* is a model feature users' models contain (batch norm, a constraint, an
``add_loss``, sample weights, ...): a function that makes the compiled Keras model,
and what data it takes. A *column* is how the framework trains it (one device,
towers, mirrored replicas, micro-batches, XLA, mixed precision, optimizer groups).
A *cell* trains the row's model from the same initial weights on the same batches
two ways and compares every variable, trainable and not (batch-norm moving
statistics), and the optimizer's slots:

* the reference is Keras (``train_on_batch``, which is ``fit``'s step) for every
  column: where Keras has no such setting (towers, micro-batches, groups), the
  framework must train what it trains on one device, which the ``one_device``
  column checks equal to Keras; mixed precision is compared with Keras under the
  same policy, at a looser tolerance (``TOLERANCE``);
* a model whose forward pass depends on how the batch is cut (batch statistics)
  is compared after one step, on its moving statistics: each shard, slice or
  replica normalises by its own statistics (as Keras does under a strategy), and
  the moving statistics must be what one device computes on the whole batch;
* deep nets are chaotic (a 1e-7 nudge to MobileNetV2's weights is 0.35 apart by
  step 3 at SGD 0.02), so a cell compares the first ``STEPS`` steps of a small model;
* dropout is left out: its draws differ between Keras and the framework's step.

The data is Keras's own: ``(x, y)`` or ``(x, y, sample_weight)`` tensors, not dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

import trainer
from trainer.errors import UserError

BATCH = 16  # a global batch: 2 devices take 8 each, 4 slices 4 each
STEPS = 3
TOLERANCE = {None: 2e-5, "mixed_float16": 2e-2, "mixed_bfloat16": 5e-2}


@dataclasses.dataclass(frozen=True)
class Row:
    """A model feature.

    Attributes:
      make: makes the compiled Keras model (seeded: the same weights every time).
      weighted: the data carries sample weights, ``(x, y, w)``.
      outputs: several outputs: their names (labels of those names).
      model_fn: the framework trains ``model_fn(model)``, a ModelFn over the Keras
        model's layers, with its optimizer (Keras trains the model itself).
      batch_statistics: its forward pass depends on how the batch is cut.
      frozen: a prefix of layer names: Keras trains the model with those layers set
        ``trainable = False`` (its fine-tuning guide), the framework with
        ``frozen_until_step`` on them.
      image: the data are images of this shape (their labels from their mean).
      tokens: the data are token sequences of skewed lengths (``token_arrays``).
      reference: makes the model Keras trains, if not ``make``'s (the same model
        compiled with ``AdamOfDenseGradients``).
    """

    make: Callable[[], keras.Model]
    weighted: bool = False
    outputs: tuple[str, ...] = ()
    model_fn: Callable | None = None
    batch_statistics: bool = False
    frozen: str | None = None
    image: tuple[int, int, int] | None = None
    tokens: bool = False
    reference: Callable[[], keras.Model] | None = None


@dataclasses.dataclass(frozen=True)
class Column:
    """How the framework trains: Estimator settings, on ``devices`` logical CPUs."""

    settings: dict
    devices: int = 1
    precision: str | None = None
    cuts_batch: bool = False  # shards, slices or replicas: batch statistics differ
    rows: tuple[str, ...] = ()  # the rows it runs (every row when empty)
    resume_at: int | None = None  # stop there, then a new Estimator resumes the run
    warm_start: bool = False  # start from other weights, warm-started from a .keras file
    evaluates: bool = False  # also compares evaluate's metrics and predict's outputs
    workers: int = 0  # processes of a multi_worker cluster (devices: one each)


COMPILED = (  # plain, batch statistics, an update, weights, outputs, a layer twice
    "plain",
    "batch_norm",
    "regularizers",
    "weights_weighted_mean",
    "two_outputs",
    "constraint",
    "layer_called_twice",
    "ema",
    "token_mean",
    "keras_token_mean",
)
GROUPED = ("plain", "batch_norm", "frozen_batch_norm", "constraint", "regularizers")
GROUPED += ("weights_weighted_mean", "layer_held_twice", "ema", "token_mean")
# What crosses processes: the global batch's weights and loss terms, synchronised
# statistics, averages. Per-replica batch statistics and per-output losses add nothing
# to what the mirrored column (the same two replicas, in one process) shows.
MULTI_WORKER = ("plain", "synchronized_batch_norm", "weights_weighted_mean", "regularizers")
MULTI_WORKER += ("ema", "token_mean")
# What a cut batch could change in evaluation (weighted means, sums, layer losses,
# outputs, averages): the rows the multi-device columns evaluate (one device: all).
EVALUATED_APART = ("plain", "weights_weighted_mean", "weights_sum", "regularizers")
EVALUATED_APART += ("add_loss_mean", "two_outputs", "ema", "synchronized_batch_norm")
EVALUATED_APART += ("token_mean",)
RESTARTED = ("plain", "batch_norm", "frozen_batch_norm", "regularizers", "ema", "two_outputs")
RESTARTED += ("token_mean",)
COLUMNS = {
    "one_device": Column({}, evaluates=True),
    "microbatches_2": Column({"microbatches": 2}, cuts_batch=True),
    "microbatches_4": Column({"microbatches": 4}, cuts_batch=True),
    # These three change how a step is compiled, split or computed, not what a feature
    # means: they run the rows whose arithmetic they could change.
    "jit_compile": Column({"jit_compile": True}, rows=COMPILED),
    "groups": Column({"learning_rate_multipliers": {"kernel": 1.0}}, rows=GROUPED),
    "mixed_float16": Column({"mixed_precision": "mixed_float16"}, precision="mixed_float16"),
    "mixed_bfloat16": Column(
        {"mixed_precision": "mixed_bfloat16"},
        precision="mixed_bfloat16",
        rows=(*COMPILED[:5], "token_mean"),
    ),
    # A run stopped after 2 steps and resumed by a new Estimator (a new process's
    # view): the checkpoint holds every slot, moving statistic, average and the input.
    "resumed": Column({}, rows=RESTARTED, resume_at=2),
    # Made from other weights, warm-started from the row's model saved as .keras.
    "warm_started": Column({}, rows=RESTARTED, warm_start=True),
    "towers": Column(
        {"distribution": "towers", "num_devices": 2}, 2, cuts_batch=True, evaluates=True
    ),
    "mirrored": Column(
        {"distribution": "mirrored", "num_devices": 2}, 2, cuts_batch=True, evaluates=True
    ),
    "multi_worker": Column(
        {"distribution": "multi_worker"},
        2,
        cuts_batch=True,
        evaluates=True,
        workers=2,
        rows=MULTI_WORKER,
    ),
}


def arrays(seed: int = 0, examples: int = BATCH * STEPS, image=None):
    """Keras-style data: features [n, 6], class ids [n] in 0..2, a weight per example.

    ``image``: features [n, *image] instead, the class from each image's mean.
    """
    rng = np.random.default_rng(seed)
    if image:
        x = rng.normal(size=(examples, *image)).astype("float32")
        y = np.digitize(x.mean(axis=(1, 2, 3)), [-0.02, 0.02]).astype("int64")
        return x, y, rng.uniform(0.2, 3.0, size=examples).astype("float32")
    x = rng.normal(size=(examples, 6)).astype("float32")
    y = (np.abs(x[:, 0] * 2 + x[:, 1]) % 3).astype("int64")
    w = rng.uniform(0.2, 3.0, size=examples).astype("float32")
    return x, y, w


TOKEN_LENGTHS = [12] * 4 + [4] * 4 + [2] * 4 + [1] * 4  # of each batch: its parts' tokens
VOCABULARY = 8  # 0 pads


def token_arrays(examples: int = BATCH * STEPS):
    """Token sequences ``[n, 12]`` padded with 0, and each token's successor as its label.

    Every batch of 16 has the lengths ``TOKEN_LENGTHS``: its halves hold 64 and 12
    tokens, its quarters 48, 16, 8 and 4, so a part's token mean is not the batch's;
    every batch holds 76, so Keras's evaluate (a mean of batch means) is the token mean.
    """
    rng = np.random.default_rng(0)
    lengths = np.tile(TOKEN_LENGTHS, examples // BATCH)
    x = rng.integers(1, VOCABULARY, size=(examples, 12))
    x[np.arange(12) >= lengths[:, None]] = 0
    y = np.where(x > 0, x % (VOCABULARY - 1) + 1, 0)
    return x.astype("int64"), y.astype("int64")


def elements(row: Row):
    """The row's data as Keras users give it: ``(x, y)`` or ``(x, y, w)`` arrays."""
    if row.tokens:
        return token_arrays()
    x, y, w = arrays(image=row.image)
    if row.outputs:
        y = {name: y if i == 0 else (y + 1) % 3 for i, name in enumerate(row.outputs)}
    return (x, y, w) if row.weighted else (x, y)


def input_fn(row: Row):
    """An input_fn as a Keras user writes one: ``from_tensor_slices((x, y)).batch(...)``."""

    def fn(mode, params):
        dataset = tf.data.Dataset.from_tensor_slices(elements(row))
        if mode == trainer.Mode.TRAIN:  # of one shape, as jit_compile asks
            return dataset.repeat().batch(params.batch_size, drop_remainder=True)
        return dataset.batch(params.batch_size)

    return fn


def state(model: keras.Model, optimizers: list | None = None) -> dict[str, np.ndarray]:
    """Every variable of the model and its optimizers' slots, as numpy.

    Keyed so that two models made one after the other (whose paths differ by Keras's
    layer counters, ``dense_3``) match: ``'w2 dense/bias'`` is the third weight, and
    ``'momentum of w2'`` its slot, whichever optimizer holds it (``optimizers``: the
    model's compiled one by default).
    """
    weights = list(model.weights)
    found = {f"w{i} {re.sub(r'_[0-9]+', '', v.path)}": np.array(v) for i, v in enumerate(weights)}
    flat = sorted(((v.path.replace("/", "_"), i) for i, v in enumerate(weights)), reverse=True)
    held = [v for o in optimizers or [model.optimizer] for v in o.variables]
    for v in held:
        name = v.path.rsplit("/", 1)[-1]  # under loss scaling: 'loss_scale_optimizer/adam/...'
        owner = next((i for path, i in flat if name.startswith(path + "_")), None)
        if owner is not None:
            slot = name[len(weights[owner].path) + 1 :]
            found[f"{slot} of w{owner}"] = np.array(v)
    return found


@functools.cache
def keras_run(
    row: Row, steps: int = STEPS, precision: str | None = None, evaluated: bool = False
) -> dict:
    """The reference: Keras's own step on each batch in turn (``fit``'s step).

    ``evaluated``: also what ``evaluate`` and ``predict`` give after them, on the
    averaged weights with ``use_ema`` (as after ``fit``). Kept once computed: every
    column of a row compares with it.
    """
    with policy(precision):
        model = (row.reference or row.make)()
    for layer in model.layers:
        if row.frozen and layer.name.startswith(row.frozen):
            layer.trainable = False
    data = elements(row)
    for i in range(steps):
        part = tf.nest.map_structure(lambda a, i=i: a[i * BATCH : (i + 1) * BATCH], data)
        model.train_on_batch(*part[:2], sample_weight=part[2] if row.weighted else None)
    found = state(model)
    if evaluated:
        if model.optimizer.use_ema:  # what fit does when it ends
            model.optimizer.finalize_variable_values(model.trainable_variables)
        x, y, *w = data
        metrics = model.evaluate(
            x, y, sample_weight=w[0] if w else None, batch_size=BATCH, verbose=0, return_dict=True
        )
        found |= {f"eval {name}": np.array(value) for name, value in metrics.items()}
        found |= predicted(model.predict(x, batch_size=BATCH, verbose=0))
    return found


def predicted(outputs) -> dict[str, np.ndarray]:
    """Predictions keyed ``'prediction'``, or ``'prediction NAME'`` by output."""
    if isinstance(outputs, dict):
        return {f"prediction {name}": np.asarray(value) for name, value in outputs.items()}
    return {"prediction": np.asarray(outputs)}


def grouped(flat: dict) -> dict:
    """The Estimator's arguments for settings named flat (``{'microbatches': 2}``), as a
    column says them: each in its group (``optimization=Optimization(microbatches=2)``)."""
    groups: dict = {}
    for name, value in flat.items():
        group, field = trainer.settings.MOVED[name].split(".")
        groups.setdefault(group, {})[field] = value
    arguments = {"WarmStart": "warm_start"}
    return {
        arguments.get(group, group.lower()): getattr(trainer.settings, group)(**fields)
        for group, fields in groups.items()
    }


def framework_run(
    row: Row,
    model_dir: str,
    steps: int = STEPS,
    resume_at: int | None = None,
    warm_start: bool = False,
    evaluated: bool = False,
    **settings,
) -> dict:
    """The framework's run of the same model on the same batches.

    ``resume_at``: a first Estimator stops there, a second resumes to ``steps``.
    ``warm_start``: the model is made with other weights and warm-started from the
    row's model saved as ``.keras`` beside ``model_dir``. ``evaluated``: also what
    ``evaluate`` and ``predict`` give (keys as ``keras_run``'s).
    """
    if warm_start:  # Keras's layer counters as a new process has them, on both sides
        keras.backend.clear_session()
        source = os.path.join(os.path.dirname(model_dir), "source.keras")
        row.make().save(source)
        settings = {**settings, "warm_start_from": source}
    if row.frozen:  # frozen for longer than the run
        settings = {**settings, "frozen_until_step": {f"/{row.frozen}": 10**6}}
    for stop in (resume_at, steps) if resume_at else (steps,):
        if warm_start:
            keras.backend.clear_session()
        with policy(settings.get("mixed_precision")):
            model = row.make()
        if warm_start:
            for variable in model.weights:  # other weights (variances stay positive)
                variable.assign(variable + 0.5)
        given = row.model_fn(model) if row.model_fn else model
        optimizer = {"optimizer": model.optimizer} if row.model_fn else {}
        estimator = trainer.Estimator(
            given,
            model_dir,
            global_batch_size=BATCH,
            steps_per_loop=steps,
            checkpoints=trainer.Checkpoints(every_steps=None),
            progress=False,
            **optimizer,
            **grouped(settings),
        )
        estimator.train(input_fn(row), max_steps=stop)
    # The optimizers that trained: one per unit with groups, remade in a strategy's scope.
    found = state(model, [unit.optimizer for unit in estimator.model.plan.units])
    found |= averages(model, estimator.model.ema)
    if evaluated:
        found |= {f"eval {k}": np.array(v) for k, v in estimator.evaluate(input_fn(row)).items()}
        rows = list(estimator.predict(input_fn(row)))
        found |= predicted(
            {key: np.stack([r[key] for r in rows]) for key in rows[0]}
            if row.outputs
            else np.stack([next(iter(r.values())) for r in rows])
        )
    return found


def averages(model: keras.Model, ema) -> dict[str, np.ndarray]:
    """The framework's moving averages of the weights, keyed as Keras's ``use_ema``
    slots (``'average of w2'``)."""
    if ema is None:
        return {}
    index = {v.path: i for i, v in enumerate(model.weights)}
    return {
        f"average of w{index[v.path]}": np.array(average)
        for v, average in zip(ema.variables, ema.averages, strict=True)
    }


class policy:  # noqa: N801 (a context manager, named as one)
    """Keras's global dtype policy set inside the block, float32 again after it."""

    def __init__(self, name: str | None):
        self.name = name

    def __enter__(self):
        if self.name:
            keras.mixed_precision.set_dtype_policy(self.name)

    def __exit__(self, *exc):
        keras.mixed_precision.set_dtype_policy("float32")


def differences(expected: dict, found: dict) -> dict[str, float]:
    """The largest absolute difference of each variable; those only one run has are inf.

    But for the zero slots of variables one run never updated (frozen ones, which the
    framework's optimizer holds slots for and Keras's does not).
    """
    unused = {key for key in found.keys() - expected.keys() if " of w" in key}
    unused = {key for key in unused if not np.any(found[key])}
    return {
        key: float(np.max(np.abs(expected[key].astype("float64") - found[key]), initial=0.0))
        if key in expected and key in found and expected[key].shape == found[key].shape
        else float("inf")
        for key in (expected.keys() | found.keys()) - unused
    }


def cell(row_name: str, column_name: str, model_dir: str | None = None) -> dict:
    """One cell: ``{'worst': (variable, difference), 'tolerance': t, 'reference': what}``
    (``what``: ``'Keras (policy)'``), or ``{'refused': line}``, the framework's one line.

    Where Keras's own step fails under a mixed policy (3.15 cannot add float16
    ``add_loss`` values to its float32 loss), the reference is Keras in float32, at the
    mixed tolerance.

    A row with batch statistics under a column that cuts the batch is compared after
    one step, on its moving statistics only.
    """
    if model_dir is None:  # a directory of its own, removed after
        with tempfile.TemporaryDirectory() as made:
            return cell(row_name, column_name, os.path.join(made, "model"))
    row, column = (ROWS | ZOO)[row_name], COLUMNS[column_name]
    cut = row.batch_statistics and column.cuts_batch
    steps = 1 if cut else STEPS
    evaluated = column.evaluates and not cut
    evaluated = evaluated and (column.devices == 1 or row_name in EVALUATED_APART)
    reference = column.precision
    try:
        expected = keras_run(row, steps, column.precision, evaluated)
    except TypeError:  # Keras 3.15 under mixed_float16 fails to add float16 add_loss values
        reference, expected = "float32", keras_run(row, steps, None, evaluated)
    try:
        found = framework_run(
            row, model_dir, steps, column.resume_at, column.warm_start, evaluated, **column.settings
        )
    except UserError as error:
        return {"refused": str(error)}
    # Each of Keras's eval metrics must be there; the framework may report more.
    found = {key: value for key, value in found.items() if key in expected or "eval " not in key}
    found_diff = differences(expected, found)
    kept = {key: value for key, value in found_diff.items() if not cut or "moving" in key}
    worst = max(kept, key=kept.get)
    return {
        "worst": [worst, kept[worst]],
        "tolerance": TOLERANCE[column.precision],
        "reference": f"Keras ({reference or 'float32'})",
    }


def resnet_on_two_devices() -> dict:
    """ResNet-8's worst differences over 3 steps: mirrored with synchronized batch norm
    against one device, and towers against mirrored (each part by its own statistics,
    as Keras under a strategy)."""
    runs = {}
    with tempfile.TemporaryDirectory() as made:
        for name, row, settings in [
            ("one", "resnet8", {}),
            ("mirrored synchronized", "resnet8_synchronized", {"distribution": "mirrored"}),
            ("towers", "resnet8", {"distribution": "towers"}),
            ("mirrored", "resnet8", {"distribution": "mirrored"}),
        ]:
            if settings:
                settings = {**settings, "num_devices": 2}
            runs[name] = framework_run(ZOO[row], f"{made}/{name}", **settings)
    return {
        f"{a} vs {b}": max(differences(runs[b], runs[a]).items(), key=lambda item: item[1])
        for a, b in [("mirrored synchronized", "one"), ("towers", "mirrored")]
    }


def cells(row_names: str, column_names: str) -> dict:
    """The cells of comma-separated rows and columns, keyed ``'row column'`` (the
    multi-device test runs them in one process): a recipe's as ``recipe_cell`` gives."""
    return {
        f"{r} {c}": recipe_cell(r, c) if r in RECIPES else cell(r, c)
        for r in row_names.split(",")
        for c in column_names.split(",")
    }


def worker_cells(base_dir: str, scored: str) -> dict:
    """The multi_worker column's cells, run by each worker of the cluster alike (every
    worker trains, evaluates and predicts), each cell in a model_dir under ``base_dir``
    that the workers share. ``scored``: the folder of ``chats.scored_pairs()``, DPO's
    pairs scored by its reference before the cluster started, as a user runs the
    reference pass once before training on several machines."""
    from tests.support import chats

    trainer.make_strategy("multi_worker", [])  # before TensorFlow runs an op
    rows = COLUMNS["multi_worker"].rows
    found = {f"{r} multi_worker": cell(r, "multi_worker", f"{base_dir}/{r}/model") for r in rows}
    recipes = {**RECIPES, "dpo": functools.partial(_dpo, made=chats.scored_at(scored))}
    for recipe in SEVERAL_MACHINES:
        found[f"{recipe} multi_worker"] = recipe_cell(
            recipe, "multi_worker", f"{base_dir}/{recipe}", recipes
        )
    return found


# ---------------------------------------------------------------- the recipe rows

# Models Keras has no counterpart for, trained by the framework alone: their reference
# is the framework on one device, and the multi-device columns must train what one
# device trains. ``recipe(column settings, model_dir)`` trains and gives the weights.
#
# * reverse_lstm: the seed's LSTM encoder-decoder, by its recipe
#   (experiments/reverse_lstm.gin, small: tests/support/reversal.py), a loss per real
#   target token over targets of 3 to 13 tokens, dropout 0; tests/test_seq2seq.py
#   compares it with four micro-batches;
# * packed_tokens: a token mean over examples of 1 to 19 tokens packed in rows of 24
#   (tests/support/packed.py); tests/test_packing.py compares it with the padded rows;
# * budgeted_tokens: the same examples in batches of as many as fit a token budget (4
#   to 16 a batch, a share that differs by one between replicas when it is odd);
# * sft_packed: a LanguageModel's loss over the assistant's tokens of prepared chats
#   (tests/support/chats.py), packed in rows of 320; its reference is one device on
#   the same chats padded, unpacked (tests/test_sft.py compares micro-batches too);
# * dpo: a PreferenceModel's DPO loss on prepared pairs against its reference's scores
#   kept beside them, warm-started from that reference (tests/support/chats.py
#   scored_pairs; on workers, the test's, scored before the cluster starts);
#   tests/test_reference.py checks it from its start (log 2) and resumed;
# * dpo_held: the same loss against a reference held in memory (PreferenceModel.reference:
#   an untrained LanguageModel's checkpoint, which it starts from), on several workers too;
# * lora: rank-2 adapters on a LanguageModel's projections over a frozen base
#   (models/lora.py, tests/support/chats.py lora_tuned): only they train.
RECIPE_STEPS = 5


def _reverse_lstm(settings: dict, model_dir: str) -> dict:
    from tests.support import reversal

    moved = trainer.settings.MOVED
    bindings = [f"{moved[name]} = {value!r}" for name, value in settings.items()]
    reversal.trained(model_dir, RECIPE_STEPS, reversal.NO_DROPOUT, *bindings)
    return reversal.weights(model_dir)


def _packed_tokens(settings: dict, model_dir: str) -> dict:
    from tests.support import packed

    weights = packed.trained(model_dir, RECIPE_STEPS, **settings)
    return {f"w{i}": w for i, w in enumerate(weights)}


def _budgeted_tokens(settings: dict, model_dir: str) -> dict:
    from tests.support import packed

    packed.bind_budget()
    weights = packed.trained(model_dir, RECIPE_STEPS, packed=False, **settings)
    return {f"w{i}": w for i, w in enumerate(weights)}


def _sft_packed(settings: dict, model_dir: str, packed: bool = True) -> dict:
    from tests.support import chats

    return chats.trained(model_dir, RECIPE_STEPS, packed, **settings)


def _dpo(settings: dict, model_dir: str, made: dict | None = None) -> dict:
    from tests.support import chats

    made = made or chats.scored_pairs()  # pairs and scores made in this process
    return chats.tuned(
        model_dir,
        RECIPE_STEPS,
        "dpo",
        made["data_dir"],
        made["reference"],
        warm_start_from=made["reference"],
        **settings,
    )


def _dpo_held(settings: dict, model_dir: str) -> dict:
    from tests.support import chats

    base = chats.untrained_base()
    pairs = chats.prepared_pairs()
    return chats.tuned(
        model_dir, RECIPE_STEPS, "dpo", pairs, held=base, warm_start_from=base, **settings
    )


def _lora(settings: dict, model_dir: str) -> dict:
    from tests.support import chats

    return chats.lora_tuned(model_dir, RECIPE_STEPS, **settings)


RECIPES = {
    "reverse_lstm": _reverse_lstm,
    "packed_tokens": _packed_tokens,
    "budgeted_tokens": _budgeted_tokens,
    "sft_packed": _sft_packed,
    "dpo": _dpo,
    "dpo_held": _dpo_held,
    "lora": _lora,
}
# The recipes run on several workers, in RECIPES' order: every worker of a cluster must
# make its variables in the same order (a set's order differs between processes, by
# their hash seeds).
SEVERAL_MACHINES = list(RECIPES)
# A recipe whose reference is another way of training it on one device.
REFERENCES = {"sft_packed": functools.partial(_sft_packed, packed=False)}


def recipe_cell(
    name: str, column_name: str, model_dir: str | None = None, recipes: dict = RECIPES
) -> dict:
    """Recipe ``name`` trained under a column: ``{'weights': {variable: list}}`` (lists,
    for JSON; ``recipe_result`` compares them). ``recipes``: how each recipe trains."""
    if model_dir is None:
        with tempfile.TemporaryDirectory() as made:
            return recipe_cell(name, column_name, made, recipes)
    weights = recipes[name](COLUMNS[column_name].settings, model_dir)
    return {"weights": {key: value.tolist() for key, value in weights.items()}}


@functools.cache
def recipe_reference(name: str) -> dict[str, np.ndarray]:
    """Recipe ``name``'s weights trained on one device (once per process), or as
    ``REFERENCES`` trains it there."""
    if name not in REFERENCES:
        return {k: np.array(v) for k, v in recipe_cell(name, "one_device")["weights"].items()}
    with tempfile.TemporaryDirectory() as made:
        return REFERENCES[name]({}, made)


def recipe_result(name: str, found: dict) -> dict:
    """A recipe cell as ``check`` takes it: its worst difference from one device's."""
    weights = {key: np.array(value, "float32") for key, value in found["weights"].items()}
    apart = differences(recipe_reference(name), weights)
    worst = max(apart, key=apart.get)
    return {"worst": [worst, apart[worst]], "tolerance": TOLERANCE[None], "reference": "one device"}


# ---------------------------------------------------------------- rows


def _seeded(build: Callable[[], keras.Model], optimizer=None, **compile_args) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = build()
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(0.01),
        loss=compile_args.pop("loss", "sparse_categorical_crossentropy"),
        metrics=compile_args.pop("metrics", ["accuracy"]),
        **compile_args,
    )
    return model


def _dense_stack(*middle) -> keras.Model:
    return keras.Sequential([keras.Input((6,)), *middle, keras.layers.Dense(3)])


def frozen_batch_norm() -> keras.Model:
    """A body with batch norm under a head: the body to freeze, as in fine-tuning."""
    return _seeded(
        lambda: keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, use_bias=False, name="body_dense"),
                keras.layers.BatchNormalization(momentum=0.5, name="body_norm"),
                keras.layers.ReLU(),
                keras.layers.Dense(3, name="head"),
            ]
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def ema() -> keras.Model:
    """Keras's moving average of the weights, as its optimizer's ``use_ema``."""
    return _seeded(
        lambda: _dense_stack(keras.layers.Dense(8, activation="relu")),
        keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def batch_norm() -> keras.Model:
    return _seeded(
        lambda: _dense_stack(
            keras.layers.Dense(8, use_bias=False),  # a bias before batch norm is noise
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.ReLU(),
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def synchronized_batch_norm() -> keras.Model:
    """Batch norm that normalizes by the whole batch's statistics across replicas."""
    return _seeded(
        lambda: _dense_stack(
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.5, synchronized=True),
            keras.layers.ReLU(),
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def constraint() -> keras.Model:
    return _seeded(
        lambda: _dense_stack(
            keras.layers.Dense(8, activation="relu", kernel_constraint=keras.constraints.NonNeg())
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def regularizers() -> keras.Model:
    return _seeded(
        lambda: _dense_stack(
            keras.layers.Dense(
                8,
                activation="relu",
                kernel_regularizer=keras.regularizers.L2(0.01),
                activity_regularizer=keras.regularizers.L1(0.01),
            )
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


class _AddedLoss(keras.layers.Layer):
    """A layer that adds a loss of its activations: their mean, or their sum."""

    def __init__(self, reduce: str = "mean", **kwargs):
        super().__init__(**kwargs)
        self.reduce = reduce

    def call(self, x):
        squared = keras.ops.square(x) * 0.01
        self.add_loss(keras.ops.mean(squared) if self.reduce == "mean" else keras.ops.sum(squared))
        return x

    def get_config(self):
        return {**super().get_config(), "reduce": self.reduce}


def add_loss(reduce: str) -> Callable[[], keras.Model]:
    def make():
        return _seeded(
            lambda: _dense_stack(
                keras.layers.Dense(8, activation="relu"), _AddedLoss(reduce, name="added_loss")
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    return make


def weighted_loss(reduction: str) -> Callable[[], keras.Model]:
    def make():
        return _seeded(
            lambda: _dense_stack(keras.layers.Dense(8, activation="relu")),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
        )

    return make


def two_outputs() -> keras.Model:
    def build():
        x = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(x)
        first = keras.layers.Dense(3, name="first")(hidden)
        second = keras.layers.Dense(3, name="second")(hidden)
        return keras.Model(x, {"first": first, "second": second})

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return _seeded(
        build,
        loss={"first": loss, "second": loss},
        loss_weights={"first": 1.0, "second": 0.3},
        metrics={"first": ["accuracy"], "second": ["accuracy"]},
    )


def shared_layer() -> keras.Model:
    """One Dense (with a kernel regularizer) called on two halves of the input: siamese."""

    def build():
        x = keras.Input((6,))
        tower = keras.layers.Dense(
            4,
            name="tower",
            activation="relu",
            kernel_regularizer=keras.regularizers.L2(0.01),
            activity_regularizer=keras.regularizers.L2(0.1),
        )
        left = tower(keras.layers.Lambda(lambda t: t[:, :3] * 1.0)(x))
        right = tower(keras.layers.Lambda(lambda t: t[:, 3:] * 2.0)(x))
        joined = keras.layers.Concatenate()([left, right])
        return keras.Model(x, keras.layers.Dense(3, name="head")(joined))

    return _seeded(build, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _spec(logits: tf.Tensor, labels: tf.Tensor) -> trainer.Spec:
    """A ModelFn's Spec as the rows' compile() has it: the loss and accuracy."""
    loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    hits = tf.cast(tf.equal(tf.argmax(logits, -1), tf.cast(labels, tf.int64)), tf.float32)
    return trainer.Spec({"logits": logits}, loss=tf.reduce_mean(loss), metrics={"accuracy": hits})


class HeldTwice(trainer.ModelFn):
    """A ModelFn over a Keras model that also holds the model's first layer itself."""

    def __init__(self, model: keras.Model):
        super().__init__()
        self.body = model
        self.first = model.layers[0]  # reachable twice: alone and inside the body

    def __call__(self, features, labels, mode):
        logits = self.body(features, training=mode == trainer.Mode.TRAIN)
        if labels is None:
            return trainer.Spec({"logits": logits})
        return _spec(logits, labels)


class CalledTwice(trainer.ModelFn):
    """``shared_layer``'s computation written as a ModelFn: one tower called twice."""

    def __init__(self, model: keras.Model):
        super().__init__()
        self.tower, self.head = model.get_layer("tower"), model.get_layer("head")

    def __call__(self, features, labels, mode):
        left, right = self.tower(features[:, :3] * 1.0), self.tower(features[:, 3:] * 2.0)
        logits = self.head(tf.concat([left, right], axis=-1))
        if labels is None:
            return trainer.Spec({"logits": logits})
        return _spec(logits, labels)


def tokens(metrics=(), adam: type | None = None, mask=True, ignore_class=None) -> keras.Model:
    """A per-token classifier whose padding is masked (``mask_zero``): Keras's compiled
    loss (and ``metrics``) is then the mean over the batch's real tokens.

    SGD with momentum unless an ``adam`` class is given (rate 0.01): SGD's update is
    linear in the gradient, so an embedding's sparse gradient gives the same update
    however its rows are summed. ``ignore_class``: the loss leaves the tokens of that
    label out, of the mask's (or, with ``mask=False``, of every position).
    """
    return _seeded(
        lambda: keras.Sequential(
            [
                keras.Input((12,), dtype="int64"),
                keras.layers.Embedding(VOCABULARY, 6, mask_zero=mask),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(VOCABULARY),
            ]
        ),
        optimizer=adam(0.01) if adam else keras.optimizers.SGD(0.5, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=ignore_class
        ),
        metrics=list(metrics),
    )


class AdamOfDenseGradients(keras.optimizers.Adam):
    """Keras's Adam given an embedding's gradient as the dense tensor it stands for.

    Keras on TensorFlow takes a sparse gradient row by row, one row per lookup, and
    squares each row before it adds those of one id up: an id looked up twice adds
    ``g1^2 + g2^2`` to Adam's second moment, not ``(g1 + g2)^2``. Keras on JAX, tf.keras
    2 (which summed the rows of one id first) and the framework take the dense gradient
    (``trainer.optimization.keras_update``), so that a step's update does not depend on
    how its lookups were split over devices or micro-batches. Only the tables an input
    is gathered from can differ.
    """

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(tf.convert_to_tensor(gradient), variable, learning_rate)


class TokenMeanOf(trainer.ModelFn):
    """The tokens model as a ModelFn whose loss is ``trainer.token_mean``: the mean over
    the real tokens of each step's whole batch, as Keras's on one device."""

    def __init__(self, model: keras.Model):
        super().__init__()
        self.model = model

    def __call__(self, features, labels, mode):
        logits = self.model(features, training=mode == trainer.Mode.TRAIN)
        if labels is None:
            return trainer.Spec({"logits": logits})
        return trainer.Spec({"logits": logits}, loss=self.loss(logits, features, labels))

    @staticmethod
    def loss(logits, features, labels):
        losses = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return trainer.token_mean(losses, features != 0, cross_entropy=True)


class PartTokenMeansOf(TokenMeanOf):
    """The negative control: each part's own token mean as a plain loss, so that parts
    of unequal tokens are averaged as equals (the gradient-accumulation bug)."""

    @staticmethod
    def loss(logits, features, labels):
        losses = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        mask = tf.cast(features != 0, losses.dtype)
        return tf.reduce_sum(losses * mask) / tf.reduce_sum(mask)


_RESNETS: dict = {}  # id of a resnet() model -> the ResNet whose layers it holds


def resnet(depth: int = 20, synchronized: bool = False) -> keras.Model:
    """models.resnet's CIFAR ResNet (option A shortcuts, zero-initialised last batch-norm
    scales, weight decay on the kernels) as a compiled Keras model of its own layers,
    trained with its recipe's SGD."""
    from models.resnet import ResNet

    def build():
        net = ResNet(depth=depth, num_classes=3, synchronized_batch_norm=synchronized)
        model = net.keras_model(RESNET_IMAGE)
        _RESNETS[id(model)] = net
        return model

    return _seeded(
        build,
        keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


class ResNetOf(trainer.ModelFn):
    """The ResNet ModelFn whose layers a ``resnet()`` model holds, fed Keras's ``(x, y)``."""

    def __init__(self, model: keras.Model):
        super().__init__()
        self.net = _RESNETS.pop(id(model))

    def __call__(self, features, labels, mode):
        spec = self.net({"image": features}, None if labels is None else {"label": labels}, mode)
        # Predictions as Keras's predict gives them: the logits first.
        spec.predictions = {"logits": spec.activations["logits"], **spec.predictions}
        return spec


RESNET_IMAGE = (8, 8, 3)
plain = weighted_loss("sum_over_batch_size")
ROWS = {
    "plain": Row(plain),
    "batch_norm": Row(batch_norm, batch_statistics=True),
    "frozen_batch_norm": Row(frozen_batch_norm, frozen="body"),
    # The whole batch's statistics on every replica: equal to one device throughout.
    "synchronized_batch_norm": Row(synchronized_batch_norm),
    "ema": Row(ema),
    "constraint": Row(constraint),
    "regularizers": Row(regularizers),
    "add_loss_mean": Row(add_loss("mean")),
    "add_loss_sum": Row(add_loss("sum")),
    "weights_mean": Row(weighted_loss("sum_over_batch_size"), weighted=True),
    "weights_weighted_mean": Row(weighted_loss("mean_with_sample_weight"), weighted=True),
    "weights_sum": Row(weighted_loss("sum"), weighted=True),
    "two_outputs": Row(two_outputs, outputs=("first", "second")),
    "shared_layer": Row(shared_layer),
    "layer_held_twice": Row(regularizers, model_fn=HeldTwice),
    "layer_called_twice": Row(shared_layer, model_fn=CalledTwice),
    "token_mean": Row(tokens, model_fn=TokenMeanOf, tokens=True),
    # The compiled Keras model as it is: its mask makes its loss and accuracy per token.
    # With Adam, against Keras's Adam of the dense gradient (AdamOfDenseGradients).
    "keras_token_mean": Row(
        functools.partial(tokens, ["accuracy"], keras.optimizers.Adam),
        tokens=True,
        reference=functools.partial(tokens, ["accuracy"], AdamOfDenseGradients),
    ),
    "part_token_means": Row(tokens, model_fn=PartTokenMeansOf, tokens=True),
    # A loss that leaves a class out (keras-io's translation example): the mean is over
    # the tokens both the mask and the loss keep (label 1 is a real token's), or, with
    # no mask, over the positions the loss keeps (label 0 is padding's).
    "ignore_class": Row(functools.partial(tokens, ["accuracy"], ignore_class=1), tokens=True),
    "ignore_class_unmasked": Row(
        functools.partial(tokens, mask=False, ignore_class=0), tokens=True
    ),
}
# Models of the zoo, ModelFns against fit of their own layers: the columns they are
# tested in are their own (tests/test_resnet.py), not the whole grid.
ZOO = {
    "resnet20": Row(resnet, model_fn=ResNetOf, batch_statistics=True, image=RESNET_IMAGE),
    # ResNet-8: one block of each stage (an identity and two padded shortcuts), for the
    # multi-device runs, which trace a step per device.
    "resnet8": Row(functools.partial(resnet, 8), model_fn=ResNetOf, image=RESNET_IMAGE),
    "resnet8_synchronized": Row(
        functools.partial(resnet, 8, synchronized=True), model_fn=ResNetOf, image=RESNET_IMAGE
    ),
}


class SummedOwnStep(trainer.ModelFn):
    """A model with its own train_step whose Spec reports the batch's summed loss."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def __call__(self, features, labels, mode):
        logits = self.dense(features)
        if labels is None:
            return trainer.Spec({"logits": logits})
        losses = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return trainer.Spec({"logits": logits}, loss=tf.reduce_sum(losses), loss_reduction="sum")

    def train_step(self, features, labels, optimizers):
        with tf.GradientTape() as tape:
            spec = self(features, labels, trainer.Mode.TRAIN)
            mean = spec.loss / tf.cast(tf.shape(features)[0], tf.float32)
        variables = self.dense.trainable_variables
        optimizers["model"].apply(tape.gradient(mean, variables), variables)
        return spec


def reported_summed_losses(setups: str) -> dict:
    """The first step's reported loss of ``SummedOwnStep`` under each ``distribution:devices``."""
    found = {}
    for setup in setups.split(","):
        distribution, devices = setup.split(":")
        keras.utils.set_random_seed(1)
        logged = []
        with tempfile.TemporaryDirectory() as model_dir:
            estimator = trainer.Estimator(
                SummedOwnStep(),
                model_dir,
                global_batch_size=BATCH,
                log_every_steps=1,
                devices=trainer.Devices(distribution=distribution, count=int(devices)),
                progress=False,
            )
            at_end = keras.callbacks.LambdaCallback(on_train_end=logged.append)  # noqa: B023
            estimator.train(input_fn(Row(plain)), 1, callbacks=[at_end])
        found[setup] = logged[0]["loss"]
    return found


# Cells refused in one line, and why: any other cell that refuses fails.
SYNCHRONIZED = "synchronized batch norm needs the whole batch's statistics in each part"
REFUSED: dict[tuple[str, str], str] = {
    ("synchronized_batch_norm", "microbatches_2"): SYNCHRONIZED,
    ("synchronized_batch_norm", "microbatches_4"): SYNCHRONIZED,
    ("synchronized_batch_norm", "towers"): SYNCHRONIZED,
    ("frozen_batch_norm", "mixed_float16"): "frozen_until_step cannot split a loss scale",
}


def check(name: str, result: dict) -> None:
    """Asserts one cell: refused in one line where ``REFUSED`` says, else within its
    tolerance."""
    expected = tuple(name.split()) in REFUSED
    assert ("refused" in result) == expected, f"{name}: {result}"
    if expected:
        assert "\n" not in result["refused"], result["refused"]
        return
    variable, difference = result["worst"]
    assert difference <= result["tolerance"], (
        f"{name}: {variable} is {difference:.3g} from {result['reference']}, "
        f"tolerance {result['tolerance']}"
    )
