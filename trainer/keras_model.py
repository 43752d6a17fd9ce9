"""A Keras model as it is: ``KerasModel`` makes a ``keras.Model`` a ``ModelFn``.

``Estimator(model, ...)`` takes a compiled ``keras.Model`` (Sequential, functional or
subclassed) and wraps it in ``KerasModel(model)``, which trains it with the loss(es),
loss weights, metrics and weighted metrics given to ``compile()`` (what of compile()
is honoured and what refused: ``keras_compile``); ``KerasModel(model, loss=...,
metrics=..., ...)`` does the same for a model that is not compiled.
The model keeps its own variables: after training it holds the trained weights, and
``model.predict`` or ``model.save('m.keras')`` work on it as ever. A model with its
own ``train_step`` is trained by it (``keras_step``); it is evaluated and predicts
as below.

How a batch meets the model:

* inputs: a model with one input takes the input_fn's one feature (or the feature
  named like the input); with several, each input takes the feature of its name;
* outputs: the predictions are the outputs by name (``'output'`` for a single
  unnamed one); with one output the one label is its target, with several each
  output's target is the label of its name;
* loss: each output's loss (a ``keras.losses`` name, function or object; ``'crossentropy'``
  chosen by shapes as Keras does), reduced as the loss object says (the mean, or
  the sum over each step's batch), weighted by ``loss_weights`` and added up; the
  layers' regularization losses are added by the framework, as for any ModelFn;
* sample weights: an input_fn that yields ``(features, labels, sample_weight)``
  weights each example's loss and the weighted metrics, as Keras ``fit`` does;
* metrics: named as Keras names them (``'accuracy'``, or ``'kind_accuracy'`` with
  several outputs). Means of per-example values (accuracy, MAE) are reported in
  training and evaluation; stateful ``keras.metrics.Metric`` objects (AUC,
  precision) are streamed over the eval set (see ``Spec.metrics``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from trainer import internals, keras_compile, keras_hub_tasks, keras_step, tokens
from trainer.errors import UserError
from trainer.model_fn import Mode, ModelFn, Spec, Weighted
from trainer.tokens import TokenMean

# Keras losses of class distributions: given class ids, they take them one-hot.
DISTRIBUTION_LOSSES = ("categorical_crossentropy", "categorical_focal_crossentropy")


class KerasModel(ModelFn):
    """A ``keras.Model`` trained with its compiled (or the given) loss and metrics.

    Args:
      model: a ``keras.Model``.
      loss: one loss for every output, a list by output, or a dict by output name;
        None takes the one given to ``model.compile``.
      metrics: metric names or ``keras.metrics`` objects: a list for a single output,
        a list of lists or a dict by output name for several; None takes
        ``compile``'s.
      loss_weights: a list or dict of each output's weight in the loss; None takes
        ``compile``'s, else 1 each.
      weighted_metrics: metrics weighted by the input's sample weights, given as
        ``metrics`` is; None takes ``compile``'s.
      generates: a keras-hub causal LM predicts by continuing its prompts, as its
        ``generate`` does; False: it predicts its outputs (the logits), as its
        ``predict`` does.
    """

    takes_sample_weights = True  # an input_fn may yield (features, labels, sample_weight)
    # Predict, evaluate and export take its weights as they are where no checkpoint is,
    # as Keras does: a built model's (a keras-hub task, a model of keras.Input), or those
    # its initializers make as it is built.
    holds_own_weights = True

    def __init__(
        self,
        model: keras.Model,
        loss: Any = None,
        metrics: Any = None,
        loss_weights: Sequence[float] | Mapping[str, float] | None = None,
        weighted_metrics: Any = None,
        generates: bool = True,
    ):
        super().__init__(name="keras_model")
        if not isinstance(model, keras.Model):
            raise UserError(f"KerasModel takes a keras.Model, got {type(model).__name__}")
        self.model = model
        self.own_keras_step = keras_step.overrides(model)  # run by trainer.keras_step
        self.input_map = keras_hub_tasks.input_map(model, generates)  # a task's preprocessor
        self.generate = keras_hub_tasks.generator(model) if generates else None  # a causal LM's
        # Kept out of the checkpoint's reach (a plain object is not tracked): compiled
        # metrics hold state of their own, which is not the model's.
        self._given = keras_compile.given(model, loss, metrics, weighted_metrics, loss_weights)

    def __str__(self) -> str:
        return f"Keras model {self.model.name!r}"

    @tf.autograph.experimental.do_not_convert  # plain TensorFlow calls: nothing to convert
    def __call__(self, features, labels, mode: Mode) -> Spec:
        """The model's outputs as predictions; with labels, its loss and metrics."""
        if labels is not None and self._given.loss is None:
            raise keras_compile.no_loss(self.model, self.own_keras_step)
        if mode == Mode.PREDICT and self.generate is not None:
            return Spec(predictions=self.generate(features))
        outputs = self.model(self._inputs(features), training=mode == Mode.TRAIN)
        predictions = _by_name(outputs, self._output_names(outputs))
        if labels is None:
            return Spec(predictions=predictions)
        weights = mean_weights = None
        if isinstance(labels, Weighted):  # the input_fn's (features, labels, sample_weight)
            labels, weights, mean_weights = labels
        # A list of labels (and of weights) for a list of outputs, as fit takes y.
        labels, weights, mean_weights = (
            _by_position(value, list(predictions)) for value in (labels, weights, mean_weights)
        )
        if not isinstance(labels, Mapping):  # Keras's habit: one bare label tensor
            labels = {"label": labels}
        scored = keras_compile.scored(self._given, list(predictions))
        targets = self._targets(labels, scored)
        resolved = self._resolve(targets, predictions)
        sequence = self._sequence_output(resolved, predictions, weights)
        if sequence is not None:
            return self._token_spec(sequence, targets, predictions, weights, mode)
        loss, metrics = 0.0, {}
        for output in resolved:
            y, p = _same_rank(targets[output.name], predictions[output.name])
            w = self._weights(weights, output.name, p)
            # The loss takes an eval set's class ids one-hot (metrics resolve to ids).
            as_scored = y if mode == Mode.TRAIN else _distributions_for(output.loss, y, p)
            values, _ = self._loss_of(output.name, output.loss, as_scored, p)  # per example
            mean_weight = _of_output(mean_weights, output.name)
            output_loss, per_example = _reduced(values, w, output.reduction, mean_weight)
            loss += output.weight * output_loss
            prefix = f"{output.name}_" if len(resolved) > 1 else ""
            if prefix:  # each output's loss, as Keras reports it
                metrics[f"{output.name}_loss"] = per_example
            for name, fn, weighted in output.metrics:
                metrics[prefix + name] = _metric_value(fn, y, p, w if weighted else None)
        summed = any(output.reduction == "sum" for output in resolved)
        return Spec(
            predictions=predictions,
            loss=loss,
            loss_reduction="sum" if summed else "mean",
            metrics=metrics,
        )

    def _sequence_output(self, resolved, predictions, weights):
        """The one output whose loss is a mean over tokens, or None.

        So is an output that carries a Keras mask (``Embedding(mask_zero=True)``), whose
        sample weights are one per token (``[batch, length]``), or whose loss leaves a
        class out (``ignore_class``), as under ``fit``.
        """
        found = [
            o
            for o in resolved
            if internals.keras_mask(predictions[o.name]) is not None
            or _per_token(_of_output(weights, o.name))
            or _ignored_class(o.loss) is not None
        ]
        if found and len(resolved) > 1:
            raise UserError(
                f"Keras model {self.model.name!r}: output {found[0].name!r} takes a loss per "
                "token (masked, weighted per token, or leaving a class out), which is taken "
                "for a model of one scored output only: give the sequence output a model of "
                "its own"
            )
        return found[0] if found else None

    def _token_spec(self, output, targets, predictions, weights, mode: Mode) -> Spec:
        """The Spec of a sequence output: a token mean (or sum) and per-token metrics.

        Each position weighs its mask times its sample weight, as Keras's losses and
        metrics weigh it; the mean is over the mask (``'mean_with_sample_weight'``: over
        the weights), over the step's whole batch (``trainer.tokens``). The loss's own
        mask (the positions ``ignore_class`` keeps) masks the loss, not the metrics, as
        in Keras's ``Loss.__call__``.
        """
        mask = internals.keras_mask(predictions[output.name])
        y, p = _same_rank(targets[output.name], predictions[output.name])
        as_scored = y if mode == Mode.TRAIN else _distributions_for(output.loss, y, p)
        values, kept = self._loss_of(output.name, output.loss, as_scored, p, per_token=True)
        shown = tf.ones_like(values)
        if mask is not None:  # a mask per example (an output of rank 1) too
            shown = tf.reshape(tf.cast(mask, tf.float32), tf.shape(values))
        given = _of_output(weights, output.name)
        weighted = shown if given is None else shown * _per_position(given, values)
        scored, counted = weighted, shown
        if kept is not None:  # the loss's own mask
            kept = tf.reshape(tf.cast(kept, tf.float32), tf.shape(values))
            scored, counted = weighted * kept, shown * kept
        sums = tf.reduce_sum(values * scored, axis=1)
        if output.reduction == "sum":
            loss, reduction = tf.reduce_sum(sums) * output.weight, "sum"
        else:
            if output.reduction == "weighted mean":
                counted = scored
            entropy = "crossentropy" in _name_of(output.loss).replace("_", "")
            positions = tokens.positions_of(values)
            loss = TokenMean(sums * output.weight, tf.reduce_sum(counted, 1), entropy, positions)
            reduction = "mean"
        metrics = {
            # Keras hands a metric weights where an output mask or sample weights are.
            name: _token_metric(
                fn, y, p, weighted if is_weighted else shown,
                weighs=mask is not None or (is_weighted and given is not None),
            )
            for name, fn, is_weighted in output.metrics
        }  # fmt: skip
        return Spec(predictions=predictions, loss=loss, loss_reduction=reduction, metrics=metrics)

    def _weights(self, weights, output: str, p: tf.Tensor) -> tf.Tensor | None:
        """The sample weights of ``output`` (one for all, or a dict by output) as ``[batch]``."""
        weights = _of_output(weights, output)
        if weights is None:
            return None
        shape = weights.shape
        if shape.rank not in (1, 2) or (shape.rank == 2 and shape[-1] != 1):
            raise UserError(
                f"Keras model {self.model.name!r}: the input_fn's sample_weight has shape "
                f"{tuple(shape)}; give one weight per example, shape [batch]"
            )
        return tf.reshape(tf.cast(weights, tf.float32), [tf.shape(p)[0]])

    def _loss_of(self, name: str, loss_fn, y, p, per_token: bool = False):
        """``(values, the loss's own mask or None)`` of output ``name``.

        The values are one per example (``per_token``: per position).
        A ``keras.losses.Loss`` gives its values before its reduction: Keras's own
        divides by the replicas of a strategy in scope, and the framework weights
        each replica's loss itself. Labels are cast to the loss's type, as Keras does.
        The mask is the one Keras's loss sets on its values (``ignore_class``'s kept
        positions), which its ``__call__`` reads.
        """
        given, shape = y.dtype.name, tuple(y.shape)
        loss_name = _name_of(loss_fn)
        dtype = getattr(loss_fn, "dtype", None) or tf.float32  # under mixed precision too
        y, p = tf.cast(y, dtype), tf.cast(p, dtype)
        try:
            values = loss_fn.call(y, p) if isinstance(loss_fn, keras.losses.Loss) else loss_fn(y, p)
            kept = internals.keras_mask(values)
            if per_token:
                return tf.reshape(tf.cast(values, tf.float32), [tf.shape(p)[0], -1]), kept
            return _per_example(values, p), kept
        except (ValueError, TypeError, tf.errors.InvalidArgumentError):
            takes = (
                "class distributions (MixUp, CutMix, soft labels) take categorical_crossentropy"
                if len(shape) == p.shape.rank
                else "class ids take sparse_categorical_crossentropy"
            )
            raise UserError(
                f"Keras model {self.model.name!r}: loss {loss_name!r} does not fit output "
                f"{name!r} of shape {tuple(p.shape)} and its label of shape {shape} "
                f"({given}): compile with a loss for these labels ({takes})"
            ) from None

    # ------------------------------------------------------------ matching by name

    def _inputs(self, features):
        names = [t.name for t in getattr(self.model, "inputs", None) or []]
        if not isinstance(features, Mapping):  # Keras's habit: x as a tensor, or a tuple
            return self._unnamed_inputs(features, names)
        if not names:  # subclassed: it takes what the input_fn gives
            return next(iter(features.values())) if len(features) == 1 else dict(features)
        if len(names) == 1:
            if names[0] in features:
                return features[names[0]]
            if len(features) == 1:
                return next(iter(features.values()))
        missing = [n for n in names if n not in features]
        if missing:
            raise UserError(
                f"Keras model {self.model.name!r} has inputs {names}, but the input_fn gives "
                f"features {sorted(features)}: name each keras.Input like the feature it takes "
                f"(keras.Input(..., name={sorted(features)[0]!r}))"
            )
        if internals.takes_dict_inputs(self.model):
            return {n: features[n] for n in names}
        return [features[n] for n in names]

    def _unnamed_inputs(self, features, names: list[str]):
        """Features given as Keras ``fit`` takes ``x``: one tensor, or one per input in order."""
        if not names or not isinstance(features, list | tuple):
            return features  # one tensor for one input; a subclassed model takes x as it is
        if len(features) != len(names):
            raise UserError(
                f"Keras model {self.model.name!r} has {len(names)} inputs {names}, but the "
                f"input_fn gives {len(features)} features in a tuple: give one per input, in "
                "order, or a dict by input name"
            )
        if len(names) == 1:
            return features[0]
        if internals.takes_dict_inputs(self.model):
            return dict(zip(names, features, strict=True))
        return list(features)

    def _output_names(self, outputs) -> list[str]:
        if isinstance(outputs, Mapping):
            return sorted(outputs)
        names = list(getattr(self.model, "output_names", None) or [])
        count = len(outputs) if isinstance(outputs, list | tuple) else 1
        if count == 1 and names and self._auto_named(names[0]):
            names = []  # 'dense_2' is Keras's counter, not a name: 'output' every time
        if len(names) == count and len(set(names)) == count:
            return names
        # One tensor given as several outputs ([x, x, x]) has one name: by position.
        return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]

    def _auto_named(self, name: str) -> bool:
        """Whether a layer's name is the one Keras made up from its class and a count."""
        try:
            layer = self.model.get_layer(name)
        except ValueError:
            return False
        made_up = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", type(layer).__name__)
        made_up = re.sub(r"([a-z])([A-Z])", r"\1_\2", made_up).lower()  # Keras's snake case
        return re.fullmatch(rf"{re.escape(made_up)}(_\d+)?", name) is not None

    def _targets(self, labels: Mapping[str, tf.Tensor], outputs: list[str]):
        """Each of ``outputs`` (those with a loss) and its label.

        One output takes the one label, as ``fit`` gives it ``y``; else each takes the
        label of its name.
        """
        if len(outputs) == 1 and len(labels) == 1:
            return {outputs[0]: next(iter(labels.values()))}
        missing = [n for n in outputs if n not in labels]
        if missing:
            raise UserError(
                f"Keras model {self.model.name!r} has outputs {outputs} with a loss, but the "
                f"input_fn gives labels {sorted(labels)}: name each such output like its label"
            )
        return {n: labels[n] for n in outputs}

    # ------------------------------------------------------------ loss and metrics

    def _resolve(self, targets, predictions) -> list[keras_compile.Output]:
        """Per output: its loss, weight, reduction and metrics, resolved on first call."""
        given = self._given
        if given.outputs is None:
            try:
                given.outputs = keras_compile.resolve(given, targets, predictions)
            except UserError as error:  # of its kind: a KerasValueError stays one
                raise type(error)(f"Keras model {self.model.name!r}: {error}") from None
        return given.outputs


def _by_position(value, outputs: list[str]):
    """``value`` (labels, weights) given as a list of one per output: a dict by output."""
    if isinstance(value, list | tuple) and len(outputs) > 1 and len(value) == len(outputs):
        return dict(zip(outputs, value, strict=True))
    return value


def _of_output(value, output: str):
    """``value`` (sample weights, or their mean) for ``output``: one for all, or by output."""
    return value.get(output) if isinstance(value, Mapping) else value


def _by_name(outputs, names: list[str]) -> dict[str, tf.Tensor]:
    if isinstance(outputs, Mapping):
        return {n: outputs[n] for n in names}
    if isinstance(outputs, list | tuple):
        return dict(zip(names, outputs, strict=True))
    return {names[0]: outputs}


def _reduced(values: tf.Tensor, weights: tf.Tensor | None, reduction: str, mean_weight=None):
    """``(the batch's loss, its per-example values)``: reduced as the loss says, weighted.

    As Keras does: the mean is over the examples (weighted or not), the weighted mean
    over the weights, the sum over the batch (the framework sums it over the step).
    The weighted mean divides by ``mean_weight`` (the step's whole batch's mean weight,
    ``Weighted.mean_weight``) where given, so that a slice, tower or replica's part is
    its share of the whole batch's weighted mean.
    """
    weighted = values if weights is None else values * weights
    if reduction == "sum":
        batch = tf.cast(tf.shape(values)[0], values.dtype)
        return tf.reduce_sum(weighted), weighted * batch
    if reduction == "weighted mean" and weights is not None:
        mean_weight = tf.reduce_mean(weights) if mean_weight is None else mean_weight
        return tf.math.divide_no_nan(tf.reduce_mean(weighted), mean_weight), (values, weights)
    return tf.reduce_mean(weighted), weighted


def _ignored_class(loss_fn):
    """The class a Keras loss leaves out of its mean (``ignore_class``), or None."""
    try:
        return loss_fn.get_config().get("ignore_class")
    except (AttributeError, NotImplementedError, TypeError):  # a function, or no config
        return None


def _metric_value(fn, y: tf.Tensor, p: tf.Tensor, weights: tf.Tensor | None):
    """A Spec metric: ``(Metric, *args)`` streamed, or per-example values (and weights).

    Where sample weights are, a metric function's own mask on its values (the positions
    ``ignore_class`` keeps) masks them, as Keras's ``Mean.update_state`` reads it.
    """
    if isinstance(fn, keras.metrics.Metric):
        return (fn, y, p) if weights is None else (fn, y, p, weights)
    values = fn(y, p)
    if weights is None or internals.keras_mask(values) is None:
        values = _per_example(values, p)
        return values if weights is None else (values, weights)
    positions = tf.shape(tf.reshape(values, [tf.shape(p)[0], -1]))
    per_position = tf.broadcast_to(tf.reshape(weights, [-1, 1]), positions)
    return _position_mean(values, _kept(values, per_position))


def _per_token(weights) -> bool:
    """Whether sample weights are one per position (``[batch, length]``), not per example."""
    return weights is not None and weights.shape.rank == 2 and weights.shape[-1] != 1


def _per_position(weights: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """Sample weights as ``values``' ``[batch, positions]``: per token, or per example."""
    weights = tf.cast(weights, tf.float32)
    if _per_token(weights):
        return tf.reshape(weights, tf.shape(values))
    return tf.reshape(weights, [-1, 1])


def _token_metric(fn, y: tf.Tensor, p: tf.Tensor, weights: tf.Tensor, weighs: bool):
    """A metric of a sequence output, each position weighted as its loss is.

    A Keras metric object is streamed with the weights per position; a function's
    values are each example's weighted mean, weighted by its weights' sum. ``weighs``:
    whether Keras would give the metric weights (an output mask, or sample weights),
    beside which it reads the metric's own mask on its values.
    """
    if isinstance(fn, keras.metrics.Metric):
        return fn, y, p, tf.reshape(weights, tf.shape(y))
    values = fn(y, p)
    return _position_mean(values, _kept(values, weights) if weighs else weights)


def _kept(values: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """``weights`` (``[batch, positions]``) times the mask a metric set on its ``values``."""
    kept = internals.keras_mask(values)
    if kept is None:
        return weights
    return weights * tf.reshape(tf.cast(kept, tf.float32), tf.shape(weights))


def _position_mean(values: tf.Tensor, weights: tf.Tensor):
    """(each example's weighted mean of its positions' ``values``, its weights' sum)."""
    values = tf.reshape(tf.cast(values, tf.float32), tf.shape(weights))
    total = tf.reduce_sum(weights, axis=1)
    return tf.math.divide_no_nan(tf.reduce_sum(values * weights, axis=1), total), total


def _per_example(values: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """``values`` as one float32 value per example: the mean over any other axes.

    One value for the batch (a metric function returning a constant) is each example's.
    """
    values = tf.cast(values, tf.float32)
    if values.shape.rank == 0:
        return tf.fill([tf.shape(outputs)[0]], values)
    return tf.reduce_mean(tf.reshape(values, [tf.shape(outputs)[0], -1]), axis=1)


def _name_of(loss_fn) -> str:
    return getattr(loss_fn, "name", None) or getattr(loss_fn, "__name__", "loss")


def _distributions_for(loss_fn, y: tf.Tensor, p: tf.Tensor) -> tf.Tensor:
    """Class ids one-hot, for a loss of class distributions; other labels as they are.

    The evaluation of a model trained on mixed labels (MixUp, CutMix) with
    ``categorical_crossentropy``: its eval set keeps class ids. In training, ids given
    to such a loss are refused, as ``fit`` refuses them.
    """
    if _name_of(loss_fn) not in DISTRIBUTION_LOSSES or not y.dtype.is_integer:
        return y
    if y.shape.rank != p.shape.rank - 1:
        return y
    return tf.one_hot(y, tf.shape(p)[-1], dtype=p.dtype)


def _same_rank(y_true, y_pred):
    """Labels and outputs made the same rank, as Keras does before losses and metrics.

    Labels of shape [batch] beside an output of [batch, 1] gain an axis; labels of
    [batch, 1] beside an output of rank 1 lose it.
    """
    if y_true.shape.rank == y_pred.shape.rank - 1 and y_pred.shape[-1] == 1:
        return tf.expand_dims(y_true, -1), y_pred
    if y_true.shape.rank == y_pred.shape.rank + 1 and y_true.shape[-1] == 1:
        return tf.squeeze(y_true, -1), y_pred
    return y_true, y_pred
