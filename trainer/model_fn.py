"""The contract between research code and the framework.

Research code provides two things:

* an ``input_fn(mode, params) -> tf.data.Dataset`` whose elements are
  ``(features, labels)``: two dicts of batched tensors. In PREDICT the dataset may
  yield ``features`` alone; labels are never given to the model then. A third item,
  per-example weights ``(features, labels, sample_weight)`` as Keras ``fit`` takes
  them, reaches a model that says it ``takes_sample_weights`` (``KerasModel``).
* a ``ModelFn`` subclass that owns its layers (built once, in ``__init__``) and maps
  ``(features, labels, mode)`` to a ``Spec``.

The framework does the rest: compiled steps, optimizer, checkpoints, summaries.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import keras
import tensorflow as tf
from absl import logging

from trainer import dataset_marks, errors, layer_losses
from trainer.metrics import check_metric


class Mode(str, enum.Enum):
    """What the model is asked to do; the values are Estimator's mode strings."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


@dataclasses.dataclass(frozen=True)
class InputParams:
    """What the framework tells an ``input_fn``.

    Attributes:
      batch_size: examples per batch this pipeline must yield. With one input
        pipeline it equals ``global_batch_size``.
      global_batch_size: examples per training step summed over all devices.
      seed: seed for shuffling and augmentation; None means nondeterministic.
      num_input_pipelines: how many pipelines feed the step (one per worker).
      input_pipeline_id: which of them this one is, for sharding the files.
      start_example: in TRAIN, how many examples of the training stream earlier
        steps have read: where a positioned dataset (see ``positioned``) starts.
        Other datasets ignore it and are resumed by the Estimator instead.
    """

    batch_size: int
    global_batch_size: int
    seed: int | None = None
    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    start_example: int = 0


def positioned(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Marks a training dataset that starts where ``params.start_example`` says.

    Its order must be a function of the stream position alone (as the index-based
    pipelines in ``datasets/`` are), so that the Estimator resumes it by arithmetic:
    it neither saves the iterator in checkpoints nor replays batches, and a run may
    resume on another number of devices or workers. A ``.map()`` or ``.prefetch()``
    after it keeps the mark (``trainer/dataset_marks.py``).
    """
    return dataset_marks.put(dataset, "positioned", True)


def is_positioned(dataset: tf.data.Dataset) -> bool:
    """Whether ``positioned`` marked ``dataset`` (or what it maps)."""
    return bool(
        dataset_marks.find(
            dataset,
            "positioned",
            through_maps=True,
            dropped="training resumes it as any other input (by its saved iterator, or replaying "
            "its batches), not at its position",
        )
    )


def sized_by(dataset: tf.data.Dataset, after: Callable[[int, int], int]) -> tf.data.Dataset:
    """Marks a positioned training dataset whose batches vary in how many examples they take.

    ``after(position, steps)`` is where the stream stands ``steps`` batches on from
    ``position``: the Estimator moves its position so, rather than by steps times
    ``global_batch_size`` (``lengths.token_budget``, ``datasets/token_budget.py``).
    """
    return dataset_marks.put(dataset, "sized_by", after)


def batch_sizes(dataset: tf.data.Dataset) -> Callable[[int, int], int] | None:
    """The ``after`` that ``sized_by`` gave ``dataset`` (or what it maps), or None."""
    return dataset_marks.find(
        dataset,
        "sized_by",
        through_maps=True,
        dropped="its position moves by global_batch_size examples a step, which its "
        "batches do not take",
    )


def counted(dataset: tf.data.Dataset, num_examples: int) -> tf.data.Dataset:
    """Marks an eval or predict dataset with how many examples it yields in all.

    An evaluation's progress bar then counts to the real total, not to its batches
    times the batch size (the last batch may be partial).
    """
    return dataset_marks.put(dataset, "num_examples", int(num_examples))


def num_examples(dataset: tf.data.Dataset) -> int | None:
    """The count ``counted`` gave ``dataset`` (or what it maps), or None."""
    return dataset_marks.find(
        dataset,
        "num_examples",
        through_maps=True,
        dropped="an evaluation's progress counts batches, not examples",
    )


LOSS_REDUCTIONS = ("mean", "sum")


class Weighted(NamedTuple):
    """Labels with the per-example weights an input_fn yields as its third item.

    ``mean_weight`` is the mean of ``sample_weight`` over the step's whole batch (every
    micro-batch slice, tower, replica and worker; in evaluation, the eval batch's), a
    scalar or a dict like ``sample_weight``, filled in before the batch is cut: a
    weighted mean (sum of weight x loss over sum of weights) is then
    ``mean(weight * loss) / mean_weight`` in every part, and the parts, weighted by
    their share of the examples as every loss is, add up to the whole batch's exactly.
    """

    labels: Any
    sample_weight: Any
    mean_weight: Any = None


@tf.autograph.experimental.do_not_convert
def labeled(element_spec) -> bool:
    """Whether a dataset's elements are ``(features, labels[, sample_weight])``."""
    return isinstance(element_spec, tuple) and len(element_spec) in (2, 3)


def split_element(element, mode: Mode):
    """Splits a dataset element into ``(features, labels)``; labels are None in PREDICT.

    An element ``(features, labels, sample_weight)`` gives ``Weighted`` labels; a
    1-tuple ``(features,)`` is its features, as ``fit`` takes it.
    """
    if isinstance(element, tuple) and len(element) == 1:
        features, labels = element[0], None
    elif isinstance(element, tuple) and len(element) == 3:
        features, labels = element[0], Weighted(*element[1:])
    elif isinstance(element, tuple) and len(element) == 2:
        features, labels = element
    else:
        features, labels = element, None
    return features, (None if mode == Mode.PREDICT else labels)


def blank_element(features_spec, labels_spec=None):
    """``(features, labels)`` of one example, of zeros, as the specs give them.

    Enough to call a model once and make its variables. Float labels of rank 2 or more
    are a distribution over their last axis (soft labels: MixUp, CutMix, smoothed),
    which a model may check: they are filled evenly. Labels' ``None`` parts (Weighted
    labels' mean weight, filled in by the step) stay None.
    """

    def blank(spec: tf.TensorSpec | None, label: bool = False) -> tf.Tensor | None:
        if spec is None:
            return None
        shape = [1 if d is None else d for d in spec.shape]
        if spec.dtype == tf.string:
            return tf.fill(shape, "")
        if label and spec.dtype.is_floating and len(shape) > 1:
            return tf.fill(shape, tf.constant(1 / shape[-1], spec.dtype))
        return tf.zeros(shape, spec.dtype)

    features = tf.nest.map_structure(blank, features_spec)
    if labels_spec is None:
        return features, None
    return features, tf.nest.map_structure(lambda s: blank(s, label=True), labels_spec)


@dataclasses.dataclass
class Spec:
    """What a ``ModelFn`` returns for one batch.

    Attributes:
      predictions: dict of tensors whose first dimension is the batch.
      loss: scalar, the mean loss over the batch (its sum, with ``loss_reduction``
        ``'sum'``). Required in TRAIN and EVAL. A sequence model's loss per token is
        ``trainer.token_mean(per_token_losses, weights)``: the mean over the real
        tokens of each step's whole batch, however it is cut (``trainer/tokens.py``).
        A model with ``optimizer_groups`` may give a dict of one loss per group (a
        GAN's generator and discriminator losses): each group's optimizer minimises
        its own, and each is reported as ``<group>_loss`` beside ``loss``, their sum.
      metrics: dict of per-example values, each of shape ``[batch]``. The framework
        streams their mean over the whole eval set (and over all devices), so
        accuracy is ``tf.cast(tf.equal(predicted, label), tf.float32)``. A pair
        ``(values, weights)`` of two ``[batch]`` tensors is a weighted mean
        (sum of weight x value over sum of weights), as Keras's weighted metrics. A metric
        that is not such a mean (AUC, precision, recall) is a tuple ``(metric,
        *args)``: a ``keras.metrics.Metric`` the model holds, which the framework
        updates with ``metric.update_state(*args)`` on every eval batch and reports
        ``metric.result()`` of over the whole eval set (its state added up over
        devices, replicas and workers); it is evaluated only, not logged in training.
      activations: optional intermediate outputs by layer name, written as
        TensorBoard histograms when ``Summaries.histogram_every_steps`` is set.
      loss_reduction: ``'mean'``, or ``'sum'`` for a loss that is the *sum* over the
        batch (Keras's ``reduction='sum'``, tf.estimator's ``Reduction.SUM``): then
        ``loss`` is the sum over the examples this call was given, and the framework
        trains and reports the sum over each step's whole batch (all devices and
        workers) and, in evaluation, the mean of the eval batches' sums.
      scalars: optional per-batch scalars to report beside the loss, in training
        and evaluation (a GAN's two losses, a multi-task model's parts): averaged
        over batches, devices, replicas and workers as the loss is, and written to
        TensorBoard and metrics.jsonl under their names.
    """

    predictions: Mapping[str, tf.Tensor]
    loss: tf.Tensor | Mapping[str, tf.Tensor] | None = None
    metrics: Mapping[str, tf.Tensor] = dataclasses.field(default_factory=dict)
    activations: Mapping[str, tf.Tensor] = dataclasses.field(default_factory=dict)
    loss_reduction: str = "mean"
    scalars: Mapping[str, tf.Tensor] = dataclasses.field(default_factory=dict)


class ModelFn(tf.Module):
    """Base class of models: create layers in ``__init__``, compute in ``__call__``.

    Keras layers (and ``keras.Variable``/``tf.Variable``) held as attributes, directly
    or inside lists and dicts, are found by the framework: their variables are
    trained and checkpointed. Subclasses may be ``@gin.configurable`` directly.

    A model trained by several optimizers (a GAN) names its groups of variables in
    ``optimizer_groups``; the Estimator's ``optimizer`` is then one per group.

    A model that sets ``takes_sample_weights = True`` accepts an input_fn that yields
    ``(features, labels, sample_weight)``: its labels then arrive as ``Weighted(labels,
    sample_weight)``. Others refuse such an input_fn, naming this.

    A model that sets ``input_map``, a function ``(dataset, mode) -> dataset``, has
    every input_fn's dataset go through it first: a keras-hub task's preprocessor
    (``trainer.keras_hub_tasks``). It maps batches one to one, so that a positioned
    stream keeps its place.

    Example::

        class Linear(ModelFn):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(1)

            def __call__(self, features, labels, mode):
                y = self.dense(features["x"])[:, 0]
                if labels is None:
                    return Spec(predictions={"y": y})
                error = y - labels["y"]
                return Spec({"y": y}, loss=tf.reduce_mean(error**2),
                            metrics={"mae": tf.abs(error)})
    """

    takes_sample_weights = False
    # Its weights as made are worth predicting with before any training, as a Keras
    # model's own (pretrained, or as its user made it) are to ``model.predict``.
    holds_own_weights = False
    input_map: Callable[[tf.data.Dataset, Mode], tf.data.Dataset] | None = None
    # The setting a model that loads its own weights loads them from (``'LoRA.base'``):
    # ``WarmStart.source`` beside it is refused.
    weights_from: str | None = None

    def __call__(
        self, features: Mapping[str, tf.Tensor], labels: Mapping[str, tf.Tensor] | None, mode: Mode
    ) -> Spec:
        """Maps a batch to a ``Spec``; ``labels`` is None in PREDICT."""
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    def __str__(self) -> str:
        """How the console names the model: its class."""
        return type(self).__name__

    def variables_made(self) -> None:
        """Called once its variables exist, before a checkpoint is restored into them.

        A model whose weights come from elsewhere loads them here (``models.lora``:
        its base, frozen, and the adapters made).
        """

    def checkpointed(self) -> dict:
        """What a checkpoint holds of it: ``{'model': weights, 'rng': [other state]}``.

        All of it, with its non-trainable state (batch-norm statistics, dropout RNG);
        a model that trains a part of itself over a base read elsewhere (a LoRA's
        adapters) holds that part alone.
        """
        return {"model": self, "rng": self.non_trainable_variables}

    @contextlib.contextmanager
    def merged(self) -> Iterator[ModelFn]:
        """The model as an export saves it (a LoRA's adapters merged into its kernels)."""
        yield self

    def train_step(self, features, labels, optimizers: Mapping[str, Any]) -> Spec:
        """Optional: the model's own training step, for what a loss per group cannot say.

        A gradient penalty (gradients of gradients), gradients transformed before
        they are applied: compute the gradients of this batch's mean loss and give each
        group's to ``optimizers[group].apply(gradients, variables)`` once (a model
        without groups has one, ``optimizers['model']``); return the batch's Spec, whose
        loss, metrics and scalars are reported. The framework applies the gradients
        after the step, summed over towers and replicas, so the step runs unchanged on
        any devices; when groups take turns, ``optimizers`` holds the groups whose turn
        it is. Evaluation and prediction still call ``__call__``. See
        ``trainer/custom_step.py`` for what a step must not do.
        """
        raise NotImplementedError(f"{type(self).__name__} has no train_step of its own")

    def optimizer_groups(self) -> Mapping[str, Any] | None:
        """Named groups of variables, each updated by its own optimizer; None for one.

        Return ``{'generator': trainer.Group(self.generator), 'discriminator':
        trainer.Group(self.discriminator)}``: every trainable variable in exactly one
        group (by layer, variable or a pattern on its path). ``Spec.loss`` is then one
        loss for all, or a dict of one loss per group; ``Group(steps=k)`` makes the
        groups take turns (see ``trainer/optimizer_groups.py``).
        """
        return None

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The Keras layers held as attributes, at any depth of lists and dicts."""
        return [x for x in _walk(self) if isinstance(x, keras.layers.Layer)]

    @property
    def trainable_variables(self) -> list[tf.Variable]:
        """The variables the optimizer updates (Keras 3 ones included)."""
        return self._collect(trainable=True)

    @property
    def non_trainable_variables(self) -> list[tf.Variable]:
        """Other state: batch-norm statistics and the dropout RNG state."""
        return self._collect(trainable=False)

    @property
    def regularization_losses(self) -> list[tf.Tensor]:
        """What the layers add to the loss: weight penalties, ``add_loss`` values of the last call.

        Each layer and variable counts once, however often it is reachable
        (``trainer/layer_losses.py``).
        """
        return layer_losses.current(self.layers, self.trainable_variables)

    def _collect(self, trainable: bool) -> list[tf.Variable]:
        found, seen = [], set()
        for item in _walk(self):
            if isinstance(item, keras.layers.Layer):
                variables = item.trainable_variables if trainable else item.non_trainable_variables
            elif isinstance(item, keras.Variable | tf.Variable):
                variables = [item] if item.trainable == trainable else []
            else:
                continue
            for v in variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    found.append(v)
        return found


def converted(call: Callable) -> Callable:
    """A model's ``__call__`` or ``train_step`` as the traced steps call it.

    It is converted by AutoGraph, so that the model may branch and loop on tensors (an
    ``if`` on a tensor becomes a ``tf.cond``, a ``for`` over ``tf.range`` a while loop).

    The framework's own code on the way there branches on Python values only and is
    not converted (``trainer/step.py``), as Keras does not convert its step: parsing
    each function's source costs 0.02-0.4 s in every process. The model is converted
    at this one door instead (AutoGraph keeps each conversion for the process). A
    method AutoGraph cannot convert (its source is not at hand) runs as written, as
    AutoGraph itself runs it then.
    """
    if tf.config.functions_run_eagerly():  # nothing is traced: it runs as Python
        return call
    function, owner = (call.__func__, call.__self__) if inspect.ismethod(call) else (None, call)
    if function is None:
        function = type(call).__call__
    graph = _graph_function(function)
    return call if graph is None else functools.partial(graph, owner)


@functools.cache
def _graph_function(function: Callable) -> Callable | None:
    """``function`` converted by AutoGraph, or None (said once) if it cannot be."""
    try:
        return tf.autograph.to_graph(function)
    except Exception as error:  # noqa: BLE001 - what AutoGraph raises varies; it runs as written
        logging.warning(
            "AutoGraph cannot convert %s (%s): it runs as written, so a Python if or for on "
            "a tensor in it fails; use tf.cond or tf.while_loop there",
            getattr(function, "__qualname__", function),
            errors.first_line(error) or type(error).__name__,
        )
        return None


def _walk(root):
    """Yields attribute values of ``root`` depth-first, descending into containers.

    Keras layers are yielded but not entered (they report their own variables);
    nested ``tf.Module``s are entered.
    """
    stack, visited = [root], {id(root)}
    while stack:
        obj = stack.pop()
        if isinstance(obj, tf.Module):
            children = [v for k, v in sorted(vars(obj).items()) if not k.startswith("_tf_")]
        elif isinstance(obj, Mapping):
            children = [obj[k] for k in sorted(obj, key=str)]
        elif isinstance(obj, collections.abc.Sequence) and not isinstance(obj, str | bytes):
            children = list(obj)
        else:
            continue
        for child in reversed(children):
            if id(child) in visited:
                continue
            visited.add(id(child))
            if isinstance(child, keras.layers.Layer | keras.Variable | tf.Variable):
                yield child
            elif isinstance(child, tf.Module | Mapping | collections.abc.Sequence):
                stack.append(child)


@tf.autograph.experimental.do_not_convert
def check_spec(
    spec: Spec, mode: Mode, model_name: str, groups: collections.abc.Collection = ()
) -> None:
    """Raises ValueError when a ModelFn's Spec breaks the contract for ``mode``.

    ``groups``: the model's optimizer groups, which a dict of losses must name.
    Called while tracing, so it sees static shapes only.
    """
    where = f"{model_name}(mode={mode.value!r})"
    if not isinstance(spec, Spec):
        raise ValueError(f"{where} returned {type(spec).__name__}; return a trainer.Spec")
    if not isinstance(spec.predictions, Mapping) or not spec.predictions:
        raise ValueError(f"{where}: Spec.predictions must be a non-empty dict of tensors")
    if mode != Mode.PREDICT:
        if spec.loss is None:
            raise ValueError(f"{where}: Spec.loss is required in {mode.value} mode")
        _check_loss(where, spec.loss, groups)
        if spec.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"{where}: Spec.loss_reduction must be one of {', '.join(LOSS_REDUCTIONS)}, "
                f"got {spec.loss_reduction!r}"
            )
    for name, value in spec.metrics.items():
        check_metric(where, name, value)
    for name, value in spec.scalars.items():
        if not tf.is_tensor(value) or value.shape.rank != 0:
            shape = getattr(value, "shape", type(value).__name__)
            raise ValueError(f"{where}: scalar {name!r} must be one number, got {shape}")
        group_losses = [f"{g}_loss" for g in spec.loss] if isinstance(spec.loss, Mapping) else []
        if name in spec.metrics or name in ("loss", "regularization_loss", *group_losses):
            raise ValueError(
                f"{where}: scalar {name!r} has the name of a metric or of the loss; "
                "give it its own name"
            )


@tf.autograph.experimental.do_not_convert
def _check_loss(where: str, loss, groups: collections.abc.Collection) -> None:
    if isinstance(loss, Mapping):
        if not groups:
            raise ValueError(
                f"{where}: Spec.loss is a dict ({', '.join(map(repr, loss))}) but the model "
                "declares no optimizer_groups(): return one loss, or declare a group for each"
            )
        if set(loss) != set(groups):
            raise ValueError(
                f"{where}: Spec.loss names {', '.join(map(repr, sorted(loss)))} but the "
                f"optimizer groups are {', '.join(map(repr, groups))}: give one loss per group"
            )
    if hasattr(loss, "check"):  # a loss of its own kind (trainer.accounting) checks itself
        loss.check(where)
        return
    for name, value in loss.items() if isinstance(loss, Mapping) else [("", loss)]:
        if not tf.is_tensor(value) or value.shape.rank != 0:
            shape = getattr(value, "shape", type(value).__name__)
            raise ValueError(
                f"{where}: Spec.loss{f'[{name!r}]' if name else ''} must be a scalar "
                f"(mean over the batch), got shape {shape}"
            )


@tf.autograph.experimental.do_not_convert
def check_class_ids(labels: tf.Tensor, num_classes: int, what: str, hint: str = "") -> tf.Tensor:
    """``labels`` (int64), once every value is checked to be in ``[0, num_classes)``.

    Float labels are taken when every value is a whole number; 3.5 is refused, not
    truncated to class 3.

    The error lists the offending values: "assertion failed: [label out of range
    [0, 10); is num_classes right?] [12 11]".
    """
    if labels.dtype.is_floating:  # a class id must be whole: 3.5 is not class 3
        whole = tf.equal(labels, tf.round(labels))
        check_whole = tf.debugging.Assert(
            tf.reduce_all(whole),
            [f"{what} must be a whole class id", tf.boolean_mask(labels, ~whole)],
            summarize=8,
        )
        with tf.control_dependencies([check_whole]):
            labels = tf.identity(labels)
    labels = tf.cast(labels, tf.int64)
    valid = (labels >= 0) & (labels < num_classes)
    check = tf.debugging.Assert(
        tf.reduce_all(valid),
        [f"{what} out of range [0, {num_classes}){hint}", tf.boolean_mask(labels, ~valid)],
        summarize=8,
    )
    with tf.control_dependencies([check]):  # nothing downstream runs before the check
        return tf.identity(labels)
