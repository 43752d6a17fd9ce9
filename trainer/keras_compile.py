"""What ``model.compile()`` was given, resolved per output, honoured or refused.

``KerasModel`` trains a Keras model with its compiled loss, loss weights, metrics and
weighted metrics. This module reads them from the model, makes each a thing the
step can call (a loss and its reduction, metrics by the names Keras gives them), and
says in one line what the framework cannot honour instead of doing something else:

* honoured: the loss (a name, function or ``keras.losses.Loss``; its reduction
  ``'sum_over_batch_size'``, ``'mean_with_sample_weight'`` or ``'sum'``), loss
  weights, metrics, weighted metrics (with the input_fn's sample weights), and the
  optimizer unless the Estimator is given one (which the log then says);
* run as it is: a model's own ``train_step`` (``keras_step``), and the
  ``compute_loss`` it calls;
* refused: a loss with ``reduction=None`` (Keras would add its values up unsaid), a
  model that overrides ``test_step``, ``predict_step``, or ``compute_loss`` without
  ``train_step`` (the framework evaluates and trains with the compiled loss;
  ``trainer.ModelFn`` is the way to write another), and one metric object under two
  names (they would share state);
* said in the log: ``steps_per_execution``, ``jit_compile`` and ``run_eagerly``
  given to compile, which the Estimator's own settings replace.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import keras
from absl import logging

from trainer import internals, keras_step
from trainer.errors import KerasValueError

OWN_STEPS = {  # a method the framework does not call: what it does instead
    "test_step": "it evaluates with the model's call and its compiled loss and metrics",
    "predict_step": "it predicts with the model's call",
    "compute_loss": "its own step takes the compiled loss; a train_step that calls "
    "compute_loss is run as it is",
}
REDUCTIONS = {  # Keras's reduction: how the framework reduces the weighted values
    "sum_over_batch_size": "mean",
    "mean": "mean",
    "mean_with_sample_weight": "weighted mean",
    "sum": "sum",
}
REPLACED = {  # compile() argument: (Keras's default, the Estimator setting used instead)
    "steps_per_execution": (1, "Estimator.steps_per_loop"),
    "jit_compile": ("auto", "Devices.jit_compile"),
    "run_eagerly": (False, "the framework's compiled step"),
}


@dataclasses.dataclass
class Output:
    """One output's loss and metrics, as compile() gave them and Keras names them."""

    name: str
    loss: Any  # a callable of (y_true, y_pred), or a keras.losses.Loss
    weight: float
    reduction: str  # 'mean', 'weighted mean' or 'sum'
    metrics: list[tuple[str, Any, bool]]  # (name, per-example fn or Metric, weighted)


@dataclasses.dataclass
class Given:
    """The loss, metrics and loss weights as given, and per output once resolved."""

    loss: Any
    metrics: Any
    weighted_metrics: Any
    loss_weights: Any
    outputs: list[Output] | None = None


def given(model: keras.Model, loss, metrics, weighted_metrics, loss_weights) -> Given:
    """What compile() was given, unless given here; refuses what cannot be honoured."""
    compiled = _compiled(model)
    own = keras_step.overrides(model)  # run as it is; the compute_loss it calls too
    for method, instead in OWN_STEPS.items():
        if own and method == "compute_loss":
            continue
        if getattr(type(model), method) is not getattr(keras.Model, method):
            raise KerasValueError(
                f"Keras model {model.name!r} overrides {method}, which the framework never "
                f"calls ({instead}): write it as a trainer.ModelFn, or use model.fit"
            )
    loss = compiled.get("loss") if loss is None else loss  # None: it predicts (no_loss)
    for name, (default, instead) in REPLACED.items():
        if compiled.get(name, default) != default:
            logging.info(
                "compile()'s %s=%r is not used: %s decides it", name, compiled[name], instead
            )
    weighted_metrics = (
        compiled.get("weighted_metrics") if weighted_metrics is None else weighted_metrics
    )
    return Given(
        loss,
        _made_now(compiled.get("metrics") if metrics is None else metrics),
        _made_now(weighted_metrics),
        compiled.get("loss_weights") if loss_weights is None else loss_weights,
    )


def no_loss(model: keras.Model, own_step: bool) -> KerasValueError:
    """The refusal to train or evaluate a model with no loss, as ``fit`` refuses it.

    Its ``predict`` needs none, as Keras's does not.
    """
    if own_step:
        return KerasValueError(
            f"Keras model {model.name!r} trains with its own train_step and has no "
            "compiled loss to evaluate with: train it (--schedule train), or compile it "
            "with a loss"
        )
    return KerasValueError(
        f"Keras model {model.name!r} has no loss: compile it with "
        "model.compile(loss=...), or pass trainer.KerasModel(model, loss=...)"
    )


def optimizer(model: keras.Model, given_optimizer):
    """The optimizer to train ``model`` with: the Estimator's if given, else compile()'s.

    When both are given the log says which one trains.
    """
    compiled = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    keras_step.check(model, optimizer=given_optimizer if keras_step.overrides(model) else None)
    if given_optimizer is None or compiled is None or given_optimizer is compiled:
        return given_optimizer or compiled
    logging.info(
        "Training Keras model %r with the optimizer given to the Estimator "
        "(Estimator.optimizer in gin), %s, not the %s given to compile()",
        model.name,
        type(given_optimizer).__name__,
        type(compiled).__name__,
    )
    return given_optimizer


def scored(given: Given, names: list[str]) -> list[str]:
    """The outputs that have a loss: only they take a label, as under ``fit``.

    ``loss=[fn, None]`` leaves the second output out.
    """
    losses = _per_output("loss", given.loss, names)
    return [n for n in names if losses[n] is not None]


def resolve(given: Given, targets, predictions) -> list[Output]:
    """Each output's loss, weight, reduction and metrics (outputs without a loss left out)."""
    names = list(predictions)
    losses = _per_output("loss", given.loss, names)
    weights = _per_output("loss_weights", given.loss_weights, names, default=1.0)
    plain = _per_output("metrics", given.metrics, names, default=[], listed=True)
    weighted = _per_output("weighted_metrics", given.weighted_metrics, names, [], listed=True)
    _check_shared(plain, weighted)
    outputs = []
    for n in names:
        if losses[n] is None:
            continue
        y, p = targets[n], predictions[n]
        metrics = [(*_metric(m, y, p), False) for m in plain[n]]
        taken = {name for name, _, _ in metrics}
        for name, fn in (_metric(m, y, p) for m in weighted[n]):
            metrics.append((f"weighted_{name}" if name in taken else name, fn, True))
        loss = _loss(losses[n], y, p)
        outputs.append(Output(n, loss, float(weights[n]), _reduction(loss), metrics))
    if len({o.reduction == "sum" for o in outputs}) > 1:
        found = {o.name: getattr(o.loss, "reduction", "sum_over_batch_size") for o in outputs}
        raise KerasValueError(
            f"the outputs' losses are reduced differently ({found}): give every output's "
            "loss the same reduction, 'sum' or a mean"
        )
    return outputs


def _compiled(model: keras.Model) -> dict:
    """What ``model.compile`` was given (the objects themselves: custom functions too)."""
    if not getattr(model, "compiled", False):
        return {}
    return internals.compile_arguments(model)


def _reduction(loss) -> str:
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if reduction not in REDUCTIONS:
        raise KerasValueError(
            f"loss {getattr(loss, 'name', loss)!r} has reduction={reduction!r}, which leaves "
            "a value per example for Keras to add up unsaid: give it reduction='sum' or "
            "'sum_over_batch_size' (the mean)"
        )
    return REDUCTIONS[reduction]


def _check_shared(*metric_lists: Mapping[str, list]) -> None:
    """Refuses one stateful metric object given twice: its state would mix."""
    seen: dict[int, str] = {}
    for metrics in metric_lists:
        for output, given_metrics in metrics.items():
            for metric in given_metrics:
                if not isinstance(metric, keras.metrics.Metric):
                    continue
                where = f"{output!r}"
                if id(metric) in seen:
                    raise KerasValueError(
                        f"one {type(metric).__name__} object, {metric.name!r}, is given for "
                        f"{seen[id(metric)]} and again for {where}: it would add both up in "
                        "one state; give each place its own metric object"
                    )
                seen[id(metric)] = where


def _per_output(what: str, given, names: list[str], default=None, listed=False) -> dict:
    """``given`` as a dict by output name: one for all, a list by position, or a dict.

    ``listed``: each output's value is a list (of metrics): one given alone is listed.
    """
    if listed and len(names) == 1 and given is not None and not isinstance(given, Mapping):
        return {names[0]: list(given) if isinstance(given, list | tuple) else [given]}
    found = _by_output(what, given, names, default)
    if listed:
        found = {n: list(v) if isinstance(v, list | tuple) else [v] for n, v in found.items()}
    return found


def _by_output(what: str, given, names: list[str], default) -> dict:
    if given is None:
        return {n: default for n in names}
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise KerasValueError(
                f"{what} names outputs {unknown}; the model's outputs are {names}"
            )
        return {n: given.get(n, default) for n in names}
    if isinstance(given, list | tuple):
        if len(given) != len(names):
            raise KerasValueError(
                f"{what} has {len(given)} entries for the model's {len(names)} outputs "
                f"{names}: give one per output, or a dict by output name"
            )
        return dict(zip(names, given, strict=True))
    return {n: given for n in names}


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
        raise KerasValueError(f"loss {identifier!r} is not a Keras loss: {error}") from None


def _metric(identifier, y_true, y_pred) -> tuple[str, Any]:
    """(name, function of one batch giving a value per example, or a streamed Metric)."""
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
        raise KerasValueError(
            f"metric {identifier!r} is not a Keras metric: {hint}(name a keras.metrics "
            "function or class, or pass a keras.metrics.Metric)"
        ) from None
    if isinstance(metric, keras.metrics.MeanMetricWrapper):
        return name or metric.name, internals.mean_metric_function(metric)
    if isinstance(metric, keras.metrics.Metric):  # AUC, precision: streamed
        return name or metric.name, metric
    return name or getattr(metric, "__name__", "metric"), metric
