"""The model and what a checkpoint holds of it: weights, optimizer, step, moving average.

``ModelState`` makes the model's and optimizer's variables once, by tracing the
model on the input's element spec (no batch is run), checks what a checkpoint could
not save, and compiles the steps (``step.Steps``). It knows whether the weights in
memory are worth using (trained or restored), and restores the newest checkpoint
for evaluation, prediction and export when they are not.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import os
import re
import time
from collections.abc import Mapping

import keras
import tensorflow as tf
from absl import logging

from trainer import (
    checkpoint_writer,
    checkpoints,
    confusion,
    custom_step,
    errors,
    internals,
    keras_step,
    microbatch,
    optimizer_groups,
    precision,
)
from trainer.accounting import Examples
from trainer.distributed.placement import Placement
from trainer.errors import UserError
from trainer.keras_model import KerasModel
from trainer.losses import loss_name
from trainer.metrics import specs_of, split_metrics, training_copies, unfit_metric
from trainer.model_fn import Mode, ModelFn, Weighted, check_spec, converted, split_element
from trainer.optimization import WeightAverage, take_ema
from trainer.settings import Optimization
from trainer.step import Steps
from trainer.trace import Trace, accounting_of


class ModelState:
    """A ModelFn with its optimizer, global step and compiled steps.

    Args:
      model_fn: the model.
      optimizer: the Estimator's: a Keras optimizer (None: Adam), or a dict of one per
        optimizer group of the model; each is made again in the placement's scope.
      placement: where the variables live and the steps run, and with what precision
        and compilation (its ``settings``, the Estimator's ``Devices``).
      seconds: where the time went; tracing the model adds to ``'building'``.
      optimization: the Estimator's ``Optimization``: clipping, per-variable rules,
        moving average, micro-batches.
      config: the model_dir's config record, to name another model when its
        checkpoints do not fit this one.
      count_classes: a classifier's confusion matrix, in evaluation
        (``Summaries.confusion_matrix``).
    """

    def __init__(
        self,
        model_fn: ModelFn,
        optimizer,
        placement: Placement,
        seconds: collections.Counter,
        optimization: Optimization = Optimization(),  # noqa: B008 (frozen)
        *,
        config: checkpoints.ConfigRecord | None = None,
        count_classes: bool = True,
    ):
        self.model_fn, self.placement, self.optimization = model_fn, placement, optimization
        self.count_classes = count_classes
        self.classes: dict[str, dict] = {}  # its per-class figures, by eval set (the last)
        self.groups = optimizer_groups.declared(model_fn)
        optimizers = optimizer_groups.optimizers_for(self.groups, optimizer)
        optimizers, self.ema_decay = take_ema(optimizers, optimization.ema_decay)  # use_ema
        for group, given in optimizers.items():
            microbatch.check_optimizer(given, "the optimizer" + (f" of {group!r}" if group else ""))
        mixed = placement.settings.mixed_precision
        self.optimizers = {  # by group; None keys a model's one optimizer
            group: placement.adopt(precision.scaled(given, mixed))
            for group, given in optimizers.items()
        }
        self.own_step = custom_step.has_own_step(model_fn)
        self.keras_step = getattr(model_fn, "own_keras_step", False)  # trainer.keras_step
        if self.keras_step:
            keras_step.check(
                model_fn.model,
                distributed=placement.strategy is not None or len(placement.devices) > 1,
                optimization=optimization,
                groups=self.groups,
            )
        if self.own_step and optimization.slicing:
            setting = optimization.slicing.split(" = ")[0]
            raise UserError(
                f"{model_fn}.train_step computes its own gradients of the whole batch, which "
                f"{setting} would slice: unset it (and slice in train_step)"
            )
        if self.own_step and any(
            isinstance(o, keras.optimizers.LossScaleOptimizer) for o in self.optimizers.values()
        ):
            raise UserError(
                f"{model_fn}.train_step computes its own gradients, which loss scaling "
                "(mixed_float16) would have to scale: use mixed_bfloat16, or float32"
            )
        self.plan: optimizer_groups.Plan | None = None  # the units, once the variables exist
        self.by_group = False  # whether Spec.loss is a dict, one loss per group
        self.config = config  # the model_dir's record of the config it was trained with
        with placement.scope():
            self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.ema: WeightAverage | None = None
        self.steps: Steps | None = None  # built on first use, from the data's shapes
        self.traced: set[Mode] = set()  # modes whose metrics the steps know
        self._usable = False  # True once the weights in memory are trained or restored
        self._spoiled = False  # True while training has left them unusable (NaN, a failure)
        self._graph_written = False  # the compiled step's graph, to TensorBoard once
        self.seconds = seconds

    @property
    def optimizer(self):
        """The model's optimizer, or with optimizer groups a dict of them by group."""
        return self.optimizers.get(None) or dict(self.optimizers)

    @property
    def loss_by_group(self) -> bool:
        """Whether the steps take each group's gradients apart.

        So they do for a dict of losses, and for a model's own step over groups.
        """
        return self.by_group or (self.own_step and self.groups is not None)

    @property
    def step(self) -> int:
        """The global step: how many training steps the model has taken."""
        return int(self.global_step.numpy())

    def build(self, element_spec, mode: Mode) -> Steps:
        """Creates every variable once, by tracing the model; returns the compiled steps.

        Tracing on the dataset's element spec creates every variable without running
        a batch, so a checkpoint can be restored into them before the first step.
        """
        if self.steps is not None:
            if mode in (Mode.TRAIN, Mode.EVAL) and mode not in self.traced:
                self._find_metrics(element_spec, mode)  # a model's metrics may differ by mode
            return self.steps
        started = time.perf_counter()
        trace = self._trace(element_spec, mode)
        self.traced.add(mode)
        self.placement.adopt_metrics(trace.streamed.values())
        with self.placement.scope():
            self.model_fn.variables_made()  # a LoRA's base loaded and frozen, adapters made
        self.seconds["building"] += time.perf_counter() - started
        variables = self.model_fn.trainable_variables
        self._check_variables(variables, mode)
        with self.placement.scope():
            self.plan = optimizer_groups.plan(
                self.model_fn, self.groups, self.optimizers, self.optimization, self.global_step
            )
            for unit in self.plan.units:
                unit.optimizer.build(unit.variables)
            if self.ema_decay:
                self.ema = WeightAverage(variables, self.ema_decay)
            self.steps = Steps(
                self.model_fn, self.plan, self.global_step, trace, self.placement,
                self.optimization, ema=self.ema,
            )  # fmt: skip
            if mode == Mode.EVAL:
                self.steps.eval.observe(self._observers(trace.classifier))
        return self.steps

    def _find_metrics(self, element_spec, mode: Mode) -> None:
        """Traces the model in a mode not traced before and takes that mode's metrics.

        The steps were built from another mode's trace; a metric made in EVAL only
        (an AUC) or in TRAIN only is found here, before that mode's step is traced.
        """
        started = time.perf_counter()
        trace = self._trace(element_spec, mode)
        self.traced.add(mode)
        self.placement.adopt_metrics(trace.streamed.values())
        with self.placement.scope():
            self.steps.take_metrics(trace)
            if mode == Mode.EVAL:
                self.steps.eval.observe(self._observers(trace.classifier))
        self.seconds["building"] += time.perf_counter() - started

    def _observers(self, classifier: confusion.Classifier | None) -> list:
        """What evaluation feeds besides the metrics: a classifier's confusion matrix."""
        if classifier is None:
            return []
        return [confusion.ConfusionMatrix(classifier, self.placement.per_replica)]

    def checkpoint_items(self, optimizer: bool) -> dict:
        """What a checkpoint holds: weights, step, RNG and BN state, EMA, optimizer."""
        items = dict(self.model_fn.checkpointed(), step=self.global_step)
        if optimizer:
            units = self.plan.units
            single = len(units) == 1
            items["optimizer"] = (
                units[0].optimizer if single else {u.name: u.optimizer for u in units}
            )
        if self.ema is not None:
            items["ema"] = self.ema.averages
        return items

    def for_inference(
        self, element_spec, mode: Mode, model_dir: str, step: int | None = None
    ) -> Steps:
        """Built for ``mode``, then restored as ``restore_for_inference`` says; its steps."""
        steps = self.build(element_spec, mode)
        self.restore_for_inference(model_dir, step)
        return steps

    def restore_for_inference(self, model_dir: str, step: int | None = None) -> None:
        """Restores the checkpoint of ``step``, else the newest unless memory is trained."""
        if self._usable and step is None:
            return
        checkpointer = checkpoint_writer.Checkpointer(model_dir, **self.checkpoint_items(False))
        try:
            restored = checkpointer.restore_latest(partial=True, step=step)
        except checkpoints.Damaged:
            raise
        except UserError:
            another = self.config.another_model() if self.config is not None else None
            if another is None:
                raise
            raise UserError(
                f"{another}: evaluate, predict or export it with the config it was trained "
                f"with ({os.path.join(model_dir, checkpoints.OPERATIVE_CONFIG)})"
            ) from None
        own = getattr(self.model_fn, "holds_own_weights", False) and not self._spoiled
        if restored is None and own:
            tf.io.gfile.makedirs(model_dir)  # where its evaluations are written
            logging.info(
                "No checkpoint in %s: %s predicts and evaluates with its weights as they "
                "are, as Keras's predict and evaluate do",
                model_dir,
                self.model_fn,
            )
        elif restored is None:
            raise UserError(
                f"no checkpoint in {model_dir}: train first "
                "(--schedule train) or point --model_dir at a trained run"
            )
        self.weights_usable()

    def weights_usable(self, usable: bool = True) -> None:
        """Whether the weights in memory are worth using (trained or restored).

        Not when a step left them NaN, or training failed: evaluation, prediction and
        export then restore the newest checkpoint.
        """
        self._usable = usable
        self._spoiled = not usable

    def graph_due(self) -> bool:
        """True the first time it is asked: the compiled step's graph goes to TensorBoard once."""
        due, self._graph_written = not self._graph_written, True
        return due

    def record_classes(self, eval_set: str, per_class: dict) -> None:
        """Keeps an eval set's per-class figures (the last evaluation's) for the results."""
        self.classes[eval_set] = per_class

    def averaged_weights(self):
        """Within the block the model holds its EMA weights, if an EMA is kept."""
        return self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()

    def _trace(self, element_spec, mode: Mode) -> Trace:
        """Calls the model once on symbolic inputs; returns what it reports (``Trace``).

        That is the names of its per-example metrics, its streamed metrics (Keras
        metric objects) by name, the names of its scalars, how its loss is given, and
        in EVAL where its labels and class scores are if it is a classifier
        (``confusion.Classifier``).
        """
        features_spec, labels_spec = split_element(element_spec, mode)
        name = type(self.model_fn).__name__
        if isinstance(labels_spec, Weighted) and not self.model_fn.takes_sample_weights:
            raise UserError(
                f"the input_fn yields (features, labels, sample_weight), and {name} takes no "
                "sample weights (a compiled Keras model does): yield (features, labels) with "
                "the weights as a feature or label, and weight the loss in the model"
            )
        found = {}

        @tf.autograph.experimental.do_not_convert  # the model is, as the steps convert it
        def trace(features, labels=None):
            spec = self._spec_of(features, labels, mode)
            try:
                check_spec(spec, mode, name, self.groups or ())
            except ValueError as error:
                raise UserError(str(error)) from None
            per_example, streamed = split_metrics(spec.metrics)
            found["metrics"] = list(per_example)  # in the Spec's order, as Keras lists them
            losses = spec.loss if isinstance(spec.loss, Mapping) else {}
            self.by_group = self.by_group or bool(losses)
            found["accounting"] = accounting_of(spec.loss, features_spec)
            found["scalars"] = sorted([*spec.scalars, *map(loss_name, losses)])
            found["streamed"] = {name: value[0] for name, value in streamed.items()}
            found["streamed_specs"] = {
                name: specs_of(value[1:]) for name, value in streamed.items()
            }
            found["unfit"] = unfit_metric(name, streamed)  # traced, never run
            if mode == Mode.EVAL and self.count_classes:
                found["classifier"] = confusion.classifier(spec.predictions, labels)
            return spec.predictions

        args = (features_spec,) if labels_spec is None else (features_spec, labels_spec)
        try:
            self.placement.create_variables(self.model_fn, features_spec, labels_spec)
            with self.placement.scope():
                tf.function(trace).get_concrete_function(*args)
        except UserError:  # already one line (a KerasValueError is a ValueError too)
            raise
        except (ValueError, TypeError) as error:
            keyed = not isinstance(self.model_fn, KerasModel)  # a Keras model takes bare x too
            raise UserError(_cannot_take(name, features_spec, labels_spec, error, keyed)) from None
        except KeyError as error:
            given = {
                what: sorted(spec)
                for what, spec in (("features", features_spec), ("labels", labels_spec))
                if isinstance(spec, dict)
            }
            key = _missing_key(error)
            if isinstance(key, str) and not any(key in names for names in given.values()):
                raise UserError(self._missing_key_message(key, given)) from None
            raise  # not a feature or label the input_fn lacks: a bug to trace back
        if found.get("unfit"):
            raise UserError(found["unfit"])
        streamed = found.get("streamed", {})
        if mode == Mode.TRAIN:  # into copies that epochs reset (evaluation resets its own)
            with self.placement.scope():
                streamed = training_copies(streamed, found["streamed_specs"])
        return Trace(
            mode,
            metrics=tuple(found.get("metrics", ())),
            streamed=streamed,
            scalars=tuple(found.get("scalars", ())),
            by_group=self.loss_by_group,
            accounting=found.get("accounting", Examples()),
            classifier=found.get("classifier"),
        )

    def _spec_of(self, features, labels, mode: Mode):
        """The Spec the model gives in ``mode``: in TRAIN, its own step's if it has one."""
        if mode == Mode.TRAIN and self.keras_step:  # a Keras model's own train_step
            spec = self._traced_step(features, labels, keras_step.run)
        else:
            spec = converted(self.model_fn)(features, labels, mode)
        if mode == Mode.TRAIN and self.own_step:  # its Spec is what training reports
            spec = self._traced_step(features, labels)
        return spec

    def _traced_step(self, features, labels, keras_run=None):
        """The Spec of the model's own ``train_step``, traced as a replica runs it.

        With ``keras_run`` (``keras_step.run``), a Keras model's: the trace creates its
        optimizers' variables, so that a checkpoint restores into them.
        """
        names = list(self.groups) if self.groups is not None else [custom_step.MODEL]
        specs = []

        def step(features, labels):
            if keras_run is not None:
                specs.append(keras_run(self.model_fn.model, features, labels))
                return tf.constant(True)
            optimizers = {name: custom_step.Tracing() for name in names}  # apply nothing
            specs.append(converted(self.model_fn.train_step)(features, labels, optimizers))
            return tf.constant(True)

        self.placement.run(step, (features, labels))
        return specs[0]

    def _missing_key_message(self, key: str, given: dict[str, list[str]]) -> str:
        """The model looked up a feature or label the input_fn does not give."""
        name = type(self.model_fn).__name__
        names = [f"{what} {', '.join(map(repr, keys))}" for what, keys in given.items()]
        # A model's setting that holds the key (MLP.image_key) is the other fix.
        settings = [a for a, v in vars(self.model_fn).items() if isinstance(v, str) and v == key]
        fix = f", or set {name}.{settings[0]} to one of them" if settings else ""
        return (
            f"{name} looks up {key!r}, which the input_fn does not give "
            f"({'; '.join(names) or 'its features are not a dict'}): name it {key!r} in the "
            f"input_fn{fix}"
        )

    def _check_variables(self, variables: list, mode: Mode) -> None:
        """Refuses a model a checkpoint could not save whole, or one that cannot train.

        A Keras model of no trainable variable evaluates and predicts, as Keras's does.
        """
        name = type(self.model_fn).__name__
        keras_model = getattr(self.model_fn, "model", None)
        if not variables and isinstance(keras_model, keras.Model):
            if mode == Mode.TRAIN:
                _check_trains(keras_model)
        elif not variables:
            raise UserError(
                f"{name} has no trainable variables: create its Keras layers as attributes "
                "in __init__"
            )
        # Non-trainable state (BN statistics, dropout RNG) is saved as an explicit list.
        lost = checkpoints.unreachable(self.model_fn, variables)
        if lost:
            raise UserError(
                f"{name} holds variables a checkpoint cannot reach "
                f"({', '.join(v.path for v in lost[:4])}): Keras layers kept in a list inside "
                "a Keras layer are invisible to tf.train.Checkpoint; assign each one as an "
                "attribute (or hold the list in the ModelFn itself)"
            )


def _missing_key(error: KeyError):
    """The key a KeyError names (AutoGraph re-raises it as text: "... KeyError: 'x'")."""
    key = error.args[0] if error.args else None
    quoted = re.search(r"KeyError: (['\"].*['\"])\s*$", str(key), re.M)
    return ast.literal_eval(quoted.group(1)) if quoted else key


def _check_trains(model: keras.Model) -> None:
    """Refuses a Keras model of no trainable variable if it is frozen.

    Else the log says it trains only the state its call updates (``fit`` runs either).
    """
    if _frozen(model):
        raise UserError(
            f"Keras model {model.name!r} has no trainable variables (every layer is "
            "frozen): training would change nothing (fit runs it all the same); set "
            "trainable = True on the layers to train"
        )
    logging.warning(
        "Keras model %r has no trainable variables: training runs its call, which "
        "updates only its own state, as fit does",
        model.name,
    )


def _frozen(model: keras.Model) -> bool:
    """Whether every layer that holds variables of its own is set ``trainable = False``.

    A model whose call updates a variable of its own (a counter, a running statistic)
    has state that training changes, with no trainable variable: ``fit`` runs it.
    """
    return not any(
        layer.trainable and internals.own_variables(layer) for layer in internals.sublayers(model)
    )


def _cannot_take(name: str, features_spec, labels_spec, error: Exception, keyed=True) -> str:
    """Why the model failed on the input_fn's features and labels, and the fix."""
    if isinstance(error, tf.errors.OperatorNotAllowedInGraphError) or "as a Python `bool`" in str(
        error
    ):
        return (
            f"{name} uses a tensor as a Python bool (an if or while on a tensor), which a "
            "compiled step cannot run (nor can Keras fit): write it with tf.cond or tf.where "
            "(keras.ops.cond, keras.ops.where)"
        )
    if isinstance(features_spec, dict) and isinstance(labels_spec, tf.TensorSpec):
        return (
            f"{name} reads its labels by key, but the input_fn's labels are a bare tensor "
            f"({labels_spec.dtype.name} {labels_spec.shape.as_list()}): name them, e.g. end "
            "the input_fn with .map(lambda features, label: (features, {'label': label})) "
            "and read labels['label']"
        )
    if "singleton tf.Variables" in str(error):  # not the input's fault
        return (
            f"{name} makes new variables each time it is called (a Keras metric or layer "
            "created in __call__?): create it once, in __init__, and use it in __call__"
        )
    shapes = tf.nest.map_structure(lambda t: t.shape.as_list(), features_spec)
    return f"{name} cannot take the input_fn's features {shapes}: " + (
        (keyed and _not_dicts(features_spec, labels_spec)) or errors.first_line(error)
    )


def _not_dicts(features_spec, labels_spec) -> str | None:
    """What to write when an input_fn yields bare tensors where dicts of them are due."""
    if isinstance(features_spec, dict) and (labels_spec is None or isinstance(labels_spec, dict)):
        return None
    return (
        "features and labels must be dicts of tensors, not bare tensors: end the "
        "input_fn with dataset.map(lambda image, label: ({'image': image}, {'label': label})) "
        "and look them up by key in the model"
    )
