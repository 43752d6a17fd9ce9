"""The Estimator's settings, in groups: each a small frozen dataclass, checked when made.

``Estimator(model_fn, model_dir, checkpoints=Checkpoints(every_steps=500))`` in
Python; in a gin file each group binds directly (``Checkpoints.every_steps = 500``),
since ``python -m trainer`` hands the Estimator one of each, made with its bindings.
A group's defaults are the Estimator's: a group left out changes nothing.

``MOVED`` maps each flat Estimator argument that a group now holds to its group; a
gin file or a saved operative config with the flat name is told, or translated
(``trainer/cli/gin_errors.py``, ``trainer/config_diff.py``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence

from trainer import errors
from trainer.errors import UserError

NONFINITE_POLICIES = ("stop", "rollback")  # what a NaN or infinite loss does


def check_types(group) -> None:
    """Refuses a field whose value is not of its annotated type, naming the field.

    A string where a bool or a number belongs is the usual case: gin's ``'False'`` in
    quotes is a non-empty string, which Python reads as True.
    """
    hints = typing.get_type_hints(type(group))
    for field in dataclasses.fields(group):
        check_type(
            f"{type(group).__name__}.{field.name}", hints[field.name], getattr(group, field.name)
        )


def check_type(name: str, hint, value) -> None:
    """Refuses ``value`` if it is not of the type ``hint`` says, naming ``name``."""
    if not _accepts(hint, value):
        raise UserError(f"{name} must be {_described(hint)}, got {value!r}{_fix(hint, value)}")


def _fix(hint, value) -> str:
    """How to write what was meant: a quoted literal unquoted, one value as a list."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hints = typing.get_args(hint)
    else:
        hints = (hint,)
    listed = any(typing.get_origin(h) in (collections.abc.Sequence, tuple) for h in hints)
    if listed and not isinstance(value, list | tuple | dict):
        return f": write [{value!r}]"
    if not isinstance(value, str):
        return ""
    return errors.unquoted(value)


def _accepts(hint, value) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):  # a whole number is a number; a bool is neither
        kinds = (int,) if hint is int else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool)
    if hint is str:  # a path from pathlib is a path too (WarmStart.source)
        return isinstance(value, str | os.PathLike)
    if origin is collections.abc.Mapping:
        return isinstance(value, Mapping) and all(
            _accepts(args[0], k) and _accepts(args[1], v) for k, v in value.items()
        )
    if origin is collections.abc.Sequence:
        return isinstance(value, list | tuple) and all(_accepts(args[0], v) for v in value)
    if origin is tuple and args[-1:] == (Ellipsis,):  # tuple[str, ...]: gin writes a list
        return isinstance(value, list | tuple) and all(_accepts(args[0], v) for v in value)
    if origin is tuple:  # a gin file writes [a, b] as often as (a, b)
        return (
            isinstance(value, tuple | list)
            and len(value) == len(args)
            and all(_accepts(a, v) for a, v in zip(args, value, strict=True))
        )
    if origin is collections.abc.Callable:
        return callable(value)
    return True


def _described(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_described(arg) for arg in args)
    if origin is collections.abc.Mapping:
        return f"a dict of {_plural(args[0])} to {_plural(args[1])}"
    if origin is collections.abc.Sequence or (origin is tuple and args[-1:] == (Ellipsis,)):
        return f"a list of {_plural(args[0])}"
    if origin is tuple:
        return f"({', '.join(_described(a) for a in args)})"
    named = {type(None): "None", bool: "True or False", int: "a whole number", float: "a number"}
    named.update({str: "a string", collections.abc.Callable: "a function"})
    return named.get(origin or hint, getattr(hint, "__name__", str(hint)))


def _plural(hint) -> str:
    return {str: "strings", int: "whole numbers", float: "numbers"}.get(hint, _described(hint))


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """When checkpoints are written and which are kept.

    Args:
      every_steps: how often to checkpoint (also always at the end); None: at the end.
      keep: how many recent checkpoints to keep.
      keep_every_steps: also keep, for good, one at every multiple of this.
      keep_best: also keep the checkpoints of the best exports (``BestExport``).
      background: write them in a thread while training goes on; None: where it is
        safe (one device or towers, not under a tf.distribute strategy).
      input: resume the training input at the exact next batch, by its position
        (``datasets/`` pipelines) or its saved iterator (``trainer/inputs.py``).
    """

    every_steps: int | None = 1000
    keep: int = 5
    keep_every_steps: int | None = None
    keep_best: bool = False
    background: bool | None = None
    input: bool = True

    def __post_init__(self):
        errors.check_count("Checkpoints.every_steps", self.every_steps, optional=True)
        errors.check_count("Checkpoints.keep", self.keep)
        errors.check_count("Checkpoints.keep_every_steps", self.keep_every_steps, optional=True)
        check_types(self)


@dataclasses.dataclass(frozen=True)
class Devices:
    """Where training runs: devices, workers, precision and compilation.

    Args:
      distribution: ``'auto'``, ``'towers'`` (each batch split over this process's
        devices), ``'mirrored'`` or ``'multi_worker'`` (the machines of ``TF_CONFIG``);
        see ``trainer/distributed/placement.py``.
      count: ``'auto'`` (every GPU, else one CPU) or how many devices to use.
      mixed_precision: ``'mixed_bfloat16'`` or ``'mixed_float16'``; call
        ``set_precision`` before making the model (``python -m trainer`` does).
      jit_compile: compile each block of steps with XLA (training batches of one
        shape); faster for dense models on CPU: measure (benchmarks/throughput.py).
      prefetch: read each batch (and copy it to the device) during the step before
        it; None: on for one device without jit_compile (the only case it applies to).
      startup_timeout: multi_worker: seconds to wait for every worker to join.
      progress_timeout: multi_worker: seconds without progress by some worker before
        the run ends naming it (exit 75); longer than the longest evaluation.
    """

    distribution: str = "auto"
    count: int | str = "auto"
    mixed_precision: str | None = None
    jit_compile: bool = False
    prefetch: bool | None = None
    startup_timeout: float = 300
    progress_timeout: float = 600

    def __post_init__(self):
        errors.check_seconds("Devices.startup_timeout", self.startup_timeout)
        errors.check_seconds("Devices.progress_timeout", self.progress_timeout)
        check_types(self)


def _in_the_step(default, own_step: str):
    """An option that the framework's step carries out and a model's own step cannot.

    Set, it is refused to a model with its own ``train_step``, ``own_step`` the fix.
    """
    return dataclasses.field(default=default, metadata={"own_step": own_step})


@dataclasses.dataclass(frozen=True)
class Optimization:
    """How each update is made from the gradients, and what a bad loss does.

    Args:
      clip_gradient_norm: clip the gradients (each loss's) to this global norm.
      learning_rate_multipliers: ``{pattern: factor}``: variables whose Keras path
        matches ``pattern`` (``re.search``) train at ``factor`` times the rate.
      frozen_until_step: ``{pattern: step}``: those variables wait until that step.
      no_weight_decay: patterns left out of decoupled weight decay, e.g. ``['bias']``.
      ema_decay: evaluate and predict with a moving average of the weights (e.g. 0.999).
      microbatches: take each batch in this many slices inside the step, applying
        their summed gradients once: less memory, the same update (but for batch
        statistics, which each slice computes alone; ``trainer/microbatch.py``).
      microbatch_tokens: take each batch in as many slices as keep a slice within
        this many padded positions (its examples times its longest sequence): a
        batch of long examples in more slices, one of short examples whole, the
        same update. A token budget for memory, with ``lengths.group_batches``
        putting examples of one length together; instead of ``microbatches``.
      nonfinite_loss: on a NaN or infinite loss, ``'stop'`` (TrainingDiverged, the last
        checkpoint kept) or ``'rollback'`` (restore it and skip the batch).
      max_rollbacks: rollbacks allowed in one run before giving up.
    """

    clip_gradient_norm: float | None = _in_the_step(None, "clip in the step, or in its optimizers")
    learning_rate_multipliers: Mapping[str, float] | None = _in_the_step(  # None: {}, as gin says
        None, "scale or hold back those variables' updates in the step"
    )
    frozen_until_step: Mapping[str, int] | None = _in_the_step(
        None, "scale or hold back those variables' updates in the step"
    )
    no_weight_decay: Sequence[str] = ()
    ema_decay: float | None = None
    microbatches: int = _in_the_step(1, "remove it")
    microbatch_tokens: int | None = _in_the_step(None, "remove it")
    nonfinite_loss: str = "stop"
    max_rollbacks: int = 3

    def __post_init__(self):
        for name in ("learning_rate_multipliers", "frozen_until_step"):
            value = getattr(self, name)
            if value is None or isinstance(value, Mapping):  # else refused below
                object.__setattr__(self, name, dict(value or {}))
        errors.check_count("Optimization.microbatches", self.microbatches)
        if self.microbatch_tokens is not None:
            errors.check_count("Optimization.microbatch_tokens", self.microbatch_tokens)
            if self.microbatches > 1:
                raise UserError(
                    "Optimization.microbatches and Optimization.microbatch_tokens both slice "
                    "each batch: set one of them (microbatches = 1 to slice by tokens)"
                )
        errors.check_count("Optimization.max_rollbacks", self.max_rollbacks, minimum=0)
        if self.nonfinite_loss not in NONFINITE_POLICIES:
            raise UserError(
                "Optimization.nonfinite_loss must be 'stop' or 'rollback', "
                f"got {self.nonfinite_loss!r}"
            )
        check_types(self)
        for name, kind in (
            ("learning_rate_multipliers", "a number"),
            ("frozen_until_step", "a step"),
        ):
            for pattern, value in getattr(self, name).items():
                if value < 0:
                    raise UserError(
                        f"Optimization.{name}[{pattern!r}] must be {kind} >= 0, got {value!r}"
                    )

    @property
    def slicing(self) -> str | None:
        """How a batch is sliced, as its setting reads, or None when it is taken whole.

        E.g. ``'Optimization.microbatches = 4'``.
        """
        if self.microbatch_tokens:
            return f"Optimization.microbatch_tokens = {self.microbatch_tokens}"
        return f"Optimization.microbatches = {self.microbatches}" if self.microbatches > 1 else None

    def only_the_step(self) -> dict[str, str]:
        """The options set that only the framework's step carries out, with their fixes.

        Each fix says how a model's own ``train_step`` would do it instead
        (``keras_step.check`` refuses them).
        """
        return {
            f"Optimization.{field.name}": field.metadata["own_step"]
            for field in dataclasses.fields(self)
            if "own_step" in field.metadata
            and getattr(self, field.name)
            and getattr(self, field.name) != field.default
        }


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """Initial weights for a model_dir without a checkpoint (``trainer/warm_start.py``).

    Args:
      source: a checkpoint, model_dir, SavedModel or ``.keras`` file; None: none.
      pattern: take only the weights whose Keras path matches this.
      map: ``{pattern: replacement}`` renaming this model's variables into the
        source's (``re.sub``, the first pattern that matches).
    """

    source: str | None = None
    pattern: str = ".*"
    map: Mapping[str, str] | None = None  # None: {}

    def __post_init__(self):
        if self.map is None or isinstance(self.map, Mapping):  # else refused below
            object.__setattr__(self, "map", dict(self.map or {}))
        if isinstance(self.source, os.PathLike):  # a pathlib path, as a string
            object.__setattr__(self, "source", os.fspath(self.source))
        check_types(self)


@dataclasses.dataclass(frozen=True)
class BestExport:
    """Best exports: train_and_evaluate keeps the ``keep`` best in ``model_dir/export/best/``.

    Args:
      metric: the first eval set's metric they rank by; None: no best export.
      keep: how many best exports to keep.
      higher: True when a higher metric is better (accuracy, not loss).
    """

    metric: str | None = None
    keep: int = 1
    higher: bool = True

    def __post_init__(self):
        errors.check_count("BestExport.keep", self.keep)
        check_types(self)


@dataclasses.dataclass(frozen=True)
class EarlyStop:
    """Early stopping: train_and_evaluate stops once a metric stops improving.

    Args:
      metric: the first eval set's metric watched; None: never stop early.
      patience: evaluations without improvement before stopping.
      higher: True when a higher metric is better.
    """

    metric: str | None = None
    patience: int = 3
    higher: bool = True

    def __post_init__(self):
        errors.check_count("EarlyStop.patience", self.patience)
        check_types(self)


@dataclasses.dataclass(frozen=True)
class Summaries:
    """What is written to TensorBoard besides the scalars of each log step.

    Args:
      profile_steps: ``(start, stop)`` global steps to trace (TensorBoard's Profile tab).
      write_graph: write the compiled training step's graph, once.
      histogram_every_steps: write a histogram of every weight this often.
      image_every_steps: write eval images with predicted and true class this often.
      confusion_matrix: a classifier's evaluations also write its confusion matrix,
        PR curves and per-class precision and recall (``trainer.confusion``), for up
        to 1,000 classes.
    """

    profile_steps: tuple[int, int] | None = None
    write_graph: bool = True
    histogram_every_steps: int | None = None
    image_every_steps: int | None = None
    confusion_matrix: bool = True

    def __post_init__(self):
        steps = self.profile_steps
        steps = tuple(steps) if isinstance(steps, list | tuple) and steps else steps or None
        object.__setattr__(self, "profile_steps", steps)
        for name in ("histogram_every_steps", "image_every_steps"):
            errors.check_count(f"Summaries.{name}", getattr(self, name), optional=True)
        check_types(self)
        if steps is not None and not 0 <= steps[0] < steps[1]:
            raise UserError(
                f"Summaries.profile_steps must be (start, stop) with 0 <= start < stop, got {steps}"
            )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The run's configuration as text, and the check before a model_dir resumes.

    Args:
      text_fn: the config as text, kept in ``model_dir`` and TensorBoard.
      guard: ``guard(saved_text, new_text)`` before resuming; raises UserError when
        the change is not safe to resume with.
    """

    text_fn: Callable[[], str] | None = None
    guard: Callable[[str, str], None] | None = None


GROUPS = (Checkpoints, Devices, Optimization, WarmStart, BestExport, EarlyStop, Summaries)


# The Estimator's argument for each group, in the order of GROUPS, then RunConfig's.
ARGUMENTS = ("checkpoints", "devices", "optimization", "warm_start", "best_export")
ARGUMENTS += ("early_stop", "summaries", "config")


def check(*groups) -> None:
    """Refuses an Estimator argument that is not its group (a dict, a string, None).

    ``groups`` are the Estimator's arguments named in ``ARGUMENTS``, in that order.
    """
    for name, group, value in zip(ARGUMENTS, (*GROUPS, RunConfig), groups, strict=True):
        errors.check_instance(f"Estimator.{name}", value, group, f"a trainer.{group.__name__}")


def moved_argument(name: str) -> str:
    """What to pass instead of ``Estimator(name=...)``, an argument that moved to a group."""
    group, field = MOVED[name].split(".")
    argument = ARGUMENTS[[g.__name__ for g in GROUPS].index(group)]
    return (
        f"Estimator({name}=...) is {group}.{field} now: pass "
        f"Estimator(..., {argument}=trainer.{group}({field}=...))"
    )


# Each Estimator argument that moved into a group, to its binding now.
MOVED = {
    "save_checkpoints_steps": "Checkpoints.every_steps",
    "keep_checkpoint_max": "Checkpoints.keep",
    "keep_checkpoint_every_steps": "Checkpoints.keep_every_steps",
    "keep_best_checkpoints": "Checkpoints.keep_best",
    "async_checkpoints": "Checkpoints.background",
    "checkpoint_input": "Checkpoints.input",
    "distribution": "Devices.distribution",
    "num_devices": "Devices.count",
    "mixed_precision": "Devices.mixed_precision",
    "jit_compile": "Devices.jit_compile",
    "prefetch_to_device": "Devices.prefetch",
    "startup_timeout": "Devices.startup_timeout",
    "progress_timeout": "Devices.progress_timeout",
    "clip_gradient_norm": "Optimization.clip_gradient_norm",
    "learning_rate_multipliers": "Optimization.learning_rate_multipliers",
    "frozen_until_step": "Optimization.frozen_until_step",
    "no_weight_decay": "Optimization.no_weight_decay",
    "ema_decay": "Optimization.ema_decay",
    "microbatches": "Optimization.microbatches",
    "nonfinite_loss": "Optimization.nonfinite_loss",
    "max_rollbacks": "Optimization.max_rollbacks",
    "warm_start_from": "WarmStart.source",
    "warm_start_pattern": "WarmStart.pattern",
    "warm_start_map": "WarmStart.map",
    "export_best_metric": "BestExport.metric",
    "export_best_keep": "BestExport.keep",
    "export_best_higher": "BestExport.higher",
    "early_stopping_metric": "EarlyStop.metric",
    "early_stopping_patience": "EarlyStop.patience",
    "early_stopping_higher": "EarlyStop.higher",
    "profile_steps": "Summaries.profile_steps",
    "write_graph": "Summaries.write_graph",
    "histogram_every_steps": "Summaries.histogram_every_steps",
    "image_every_steps": "Summaries.image_every_steps",
}
