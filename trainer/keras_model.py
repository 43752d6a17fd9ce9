"""A Keras model as it is: ``KerasModel`` makes a ``keras.Model`` a ``ModelFn``.

``Estimator(model, ...)`` takes a compiled ``keras.Model`` (Sequential, functional or
subclassed) and wraps it in ``KerasModel(model)``, which trains it with the loss(es),
loss weights and metrics given to ``compile()``; ``KerasModel(model, loss=...,
metrics=..., loss_weights=...)`` does the same for a model that is not compiled.
The model keeps its own variables: after training it holds the trained weights, and
``model.predict`` or ``model.save('m.keras')`` work on it as ever.

How a batch meets the model:

* inputs: a model with one input takes the input_fn's one feature (or the feature
  named like the input); with several, each input takes the feature of its name;
* outputs: the predictions are the outputs by name (``'output'`` for a single
  unnamed one); with one output the one label is its target, with several each
  output's target is the label of its name;
* loss: each output's loss (a ``keras.losses`` name, function or object; ``'crossentropy'``
  chosen by shapes as Keras does), weighted by ``loss_weights`` and added up; the
  layers' regularization losses are added by the framework, as for any ModelFn;
* metrics: named as Keras names them (``'accuracy'``, or ``'kind_accuracy'`` with
  several outputs). Means of per-example values (accuracy, MAE) are reported in
  training and evaluation; stateful ``keras.metrics.Metric`` objects (AUC,
  precision) are streamed over the eval set (see ``Spec.metrics``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from trainer.errors import UserError
from trainer.model_fn import Mode, ModelFn, Spec


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
    """

    def __init__(
        self,
        model: keras.Model,
        loss: Any = None,
        metrics: Any = None,
        loss_weights: Sequence[float] | Mapping[str, float] | None = None,
    ):
        super().__init__(name="keras_model")
        if not isinstance(model, keras.Model):
            raise UserError(f"KerasModel takes a keras.Model, got {type(model).__name__}")
        compiled = _compiled(model)
        loss = compiled.get("loss") if loss is None else loss
        if loss is None:
            raise UserError(
                f"Keras model {model.name!r} has no loss: compile it with "
                "model.compile(loss=...), or pass trainer.KerasModel(model, loss=...)"
            )
        self.model = model
        # Kept out of the checkpoint's reach (a plain object is not tracked): compiled
        # metrics hold state of their own, which is not the model's.
        self._given = _Given(
            loss,
            _made_now(compiled.get("metrics") if metrics is None else metrics),
            compiled.get("loss_weights") if loss_weights is None else loss_weights,
        )

    def __str__(self) -> str:
        return f"Keras model {self.model.name!r}"

    @tf.autograph.experimental.do_not_convert  # plain TensorFlow calls: nothing to convert
    def __call__(self, features, labels, mode: Mode) -> Spec:
        """The model's outputs as predictions; with labels, its loss and metrics."""
        outputs = self.model(self._inputs(features), training=mode == Mode.TRAIN)
        predictions = _by_name(outputs, self._output_names(outputs))
        if labels is None:
            return Spec(predictions=predictions)
        if not isinstance(labels, Mapping):  # Keras's habit: one bare label tensor
            labels = {"label": labels}
        targets = self._targets(labels, list(predictions))
        per_output = self._resolve(targets, predictions)
        loss, metrics = 0.0, {}
        for name, loss_fn, weight, output_metrics in per_output:
            y, p = _same_rank(targets[name], predictions[name])
            output_loss = self._loss_of(name, loss_fn, y, p)  # per example
            loss += weight * tf.reduce_mean(output_loss)
            prefix = f"{name}_" if len(per_output) > 1 else ""
            if prefix:  # each output's loss, as Keras reports it
                metrics[f"{name}_loss"] = output_loss
            for metric_name, fn in output_metrics:
                streamed = isinstance(fn, keras.metrics.Metric)
                metrics[prefix + metric_name] = (
                    (fn, y, p) if streamed else _per_example(fn(y, p), p)
                )
        return Spec(predictions=predictions, loss=loss, metrics=metrics)

    def _loss_of(self, name: str, loss_fn, y: tf.Tensor, p: tf.Tensor) -> tf.Tensor:
        """The loss of each example of output ``name``.

        A ``keras.losses.Loss`` gives its values before its reduction: Keras's own
        divides by the replicas of a strategy in scope, and the framework weights
        each replica's loss itself. Labels are cast to the loss's type, as Keras does.
        """
        given = y.dtype.name
        dtype = getattr(loss_fn, "dtype", None) or tf.float32  # under mixed precision too
        y, p = tf.cast(y, dtype), tf.cast(p, dtype)
        try:
            values = loss_fn.call(y, p) if isinstance(loss_fn, keras.losses.Loss) else loss_fn(y, p)
            return _per_example(values, p)
        except (ValueError, TypeError, tf.errors.InvalidArgumentError):
            loss_name = getattr(loss_fn, "name", None) or getattr(loss_fn, "__name__", "loss")
            raise UserError(
                f"Keras model {self.model.name!r}: loss {loss_name!r} does not fit output "
                f"{name!r} of shape {tuple(p.shape)} and its label of shape {tuple(y.shape)} "
                f"({given}): compile with a loss for these labels (class ids take "
                "sparse_categorical_crossentropy)"
            ) from None

    # ------------------------------------------------------------ matching by name

    def _inputs(self, features: Mapping[str, tf.Tensor]):
        names = [t.name for t in getattr(self.model, "inputs", None) or []]
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
        if isinstance(getattr(self.model, "_inputs_struct", None), Mapping):  # dict inputs
            return {n: features[n] for n in names}
        return [features[n] for n in names]

    def _output_names(self, outputs) -> list[str]:
        if isinstance(outputs, Mapping):
            return sorted(outputs)
        names = list(getattr(self.model, "output_names", None) or [])
        count = len(outputs) if isinstance(outputs, list | tuple) else 1
        if count == 1 and names and self._auto_named(names[0]):
            names = []  # 'dense_2' is Keras's counter, not a name: 'output' every time
        return (
            names
            if len(names) == count
            else ["output"]
            if count == 1
            else [f"output_{i}" for i in range(count)]
        )

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
        if len(outputs) == 1 and len(labels) == 1:
            return {outputs[0]: next(iter(labels.values()))}
        missing = [n for n in outputs if n not in labels]
        if missing:
            raise UserError(
                f"Keras model {self.model.name!r} has outputs {outputs}, but the input_fn "
                f"gives labels {sorted(labels)}: name each output like its label"
            )
        return {n: labels[n] for n in outputs}

    # ------------------------------------------------------------ loss and metrics

    def _resolve(self, targets, predictions):
        """Per output: (name, loss, weight, [(metric name, per-example fn or Metric)])."""
        given = self._given
        if given.per_output is None:
            try:
                given.per_output = self._outputs_resolved(targets, predictions)
            except UserError as error:
                raise UserError(f"Keras model {self.model.name!r}: {error}") from None
        return given.per_output

    def _outputs_resolved(self, targets, predictions):
        given, names = self._given, list(predictions)
        losses = _per_output("loss", given.loss, names)
        weights = _per_output("loss_weights", given.loss_weights, names, default=1.0)
        metrics = _per_output("metrics", given.metrics, names, default=[], listed=True)
        return [
            (
                n,
                _loss(losses[n], targets[n], predictions[n]),
                float(weights[n]),
                [_metric(m, targets[n], predictions[n]) for m in metrics[n]],
            )
            for n in names
            if losses[n] is not None
        ]


@dataclasses.dataclass
class _Given:
    """The loss, metrics and loss weights as given, and per output once resolved."""

    loss: Any
    metrics: Any
    loss_weights: Any
    per_output: list | None = None  # [(name, loss, weight, [(metric name, fn)])]


def _compiled(model: keras.Model) -> dict:
    """What ``model.compile`` was given (the objects themselves: custom functions too)."""
    if not getattr(model, "compiled", False):
        return {}
    return dict(model._compile_config.config)  # Keras keeps compile's arguments


def _by_name(outputs, names: list[str]) -> dict[str, tf.Tensor]:
    if isinstance(outputs, Mapping):
        return {n: outputs[n] for n in names}
    if isinstance(outputs, list | tuple):
        return dict(zip(names, outputs, strict=True))
    return {names[0]: outputs}


def _per_output(what: str, given, names: list[str], default=None, listed=False) -> dict:
    """``given`` as a dict by output name: one for all, a list by position, or a dict."""
    if given is None:
        return {n: default for n in names}
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise UserError(f"{what} names outputs {unknown}; the model's outputs are {names}")
        return {n: given.get(n, default) for n in names}
    if listed and len(names) == 1:
        return {names[0]: list(given) if isinstance(given, list | tuple) else [given]}
    if isinstance(given, list | tuple):
        if len(given) != len(names):
            raise UserError(
                f"{what} has {len(given)} entries for the model's {len(names)} outputs "
                f"{names}: give one per output, or a dict by output name"
            )
        return dict(zip(names, given, strict=True))
    return {n: given for n in names}


def _per_example(values: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """``values`` as one float32 value per example: the mean over any other axes."""
    values = tf.reshape(tf.cast(values, tf.float32), [tf.shape(outputs)[0], -1])
    return tf.reduce_mean(values, axis=1)


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


def _made_now(metrics):
    """``metrics`` with each name of a stateful metric (``'auc'``) made into its object.

    Made now, eagerly: a metric's variables cannot be made while the step is traced.
    """
    if isinstance(metrics, Mapping):
        return {name: _made_now(given) for name, given in metrics.items()}
    if isinstance(metrics, list | tuple):
        return [_made_now(given) for given in metrics]
    if not isinstance(metrics, str) or metrics.lower() in ("accuracy", "acc"):
        return metrics
    try:
        metric = keras.metrics.get(metrics)
    except ValueError:
        return metrics  # named in one line when the model is traced
    stateful = isinstance(metric, keras.metrics.Metric) and not isinstance(
        metric, keras.metrics.MeanMetricWrapper
    )
    if not stateful:
        return metrics
    # Named as given, as Keras reports it: not 'auc_2', Keras's count of AUCs made so far.
    return type(metric).from_config({**metric.get_config(), "name": metrics})


def _shapes(y_true, y_pred) -> tuple[bool, bool]:
    """(binary, sparse categorical), as Keras tells them apart for 'accuracy'."""
    binary = y_pred.shape[-1] == 1
    sparse = y_true.shape.rank < y_pred.shape.rank or (
        y_true.shape[-1] == 1 and y_pred.shape[-1] > 1
    )
    return binary, sparse


def _loss(identifier, y_true, y_pred):
    if str(identifier).lower() in ("crossentropy", "ce"):
        binary, sparse = _shapes(y_true, y_pred)
        identifier = (
            "binary_crossentropy"
            if binary
            else "sparse_categorical_crossentropy"
            if sparse
            else "categorical_crossentropy"
        )
    try:
        return keras.losses.get(identifier)
    except ValueError as error:
        raise UserError(f"loss {identifier!r} is not a Keras loss: {error}") from None


def _metric(identifier, y_true, y_pred) -> tuple[str, Any]:
    """(name, function of one batch giving a value per example)."""
    name = identifier if isinstance(identifier, str) else None
    if str(identifier).lower() in ("accuracy", "acc"):
        binary, sparse = _shapes(y_true, y_pred)
        identifier = (
            keras.metrics.binary_accuracy
            if binary
            else keras.metrics.sparse_categorical_accuracy
            if sparse
            else keras.metrics.categorical_accuracy
        )
        return name, identifier
    try:
        metric = keras.metrics.get(identifier)
    except ValueError:
        known = [n for n in dir(keras.metrics) if not n.startswith("_") and n != "get"]
        close = difflib.get_close_matches(str(identifier), known + ["accuracy"], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(
            f"metric {identifier!r} is not a Keras metric: {hint}(name a keras.metrics "
            "function or class, or pass a keras.metrics.Metric)"
        ) from None
    if isinstance(metric, keras.metrics.MeanMetricWrapper):
        fn, kwargs = metric._fn, metric._fn_kwargs  # the per-example function Keras averages
        return name or metric.name, lambda y, p: fn(y, p, **kwargs)
    if isinstance(metric, keras.metrics.Metric):  # AUC, precision: streamed
        return name or metric.name, metric
    return name or getattr(metric, "__name__", "metric"), metric
