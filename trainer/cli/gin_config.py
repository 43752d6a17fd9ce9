"""Gin for the framework: what is configurable, parsing in one line, the resume guard.

Importing this module registers the configurables every experiment may use:
``Estimator`` (all but what the run itself gives) and its groups of settings
(``Checkpoints``, ``Devices``, ...: ``GROUPS``), ``KerasModel``, Keras optimizers under
``optimizers.``, learning-rate schedules under ``schedules.`` and losses under
``losses.``. ``parse`` reads the gin files and bindings and turns gin's errors into one
line with file, line and the closest real name (``gin_errors``). ``check_resumable``
compares two operative configs before a run resumes under a checkpoint, letting only
``RESUMABLE`` change.
"""

from __future__ import annotations

import dataclasses
import os
import tokenize

import gin
import keras

from trainer import (
    callbacks,
    config_diff,
    estimator,
    internals,
    keras_model,
    optimization,
    settings,
    tracking,
)
from trainer.checkpoints import OPERATIVE_CONFIG
from trainer.cli import gin_errors, gin_syntax
from trainer.errors import UserError

# The bindings that may change between runs of one model_dir: how long, how often,
# where and on what devices, not what is trained (Optimization.microbatches: the same
# update in less memory, so a run that ran out of memory resumes with more slices).
# Any ``data_dir`` may change too (where the data is, not what it is), and where the
# run is recorded (the tracker).
RESUMABLE = frozenset(
    [
        f"experiment.{name}"
        for name in ("max_steps", "eval_every_steps", "eval_steps", "eval_input_fns", "tracker")
    ]
    + [f"MLflow.{name}" for name in ("tracking_uri", "experiment", "run_name")]
    + [
        f"Estimator.{name}"
        for name in ("log_every_steps", "steps_per_loop", "eval_batch_size", "progress")
    ]
    + [f"Checkpoints.{field.name}" for field in dataclasses.fields(settings.Checkpoints)]
    + [f"BestExport.{field.name}" for field in dataclasses.fields(settings.BestExport)]
    + [f"EarlyStop.{field.name}" for field in dataclasses.fields(settings.EarlyStop)]
    + [f"Summaries.{field.name}" for field in dataclasses.fields(settings.Summaries)]
    + [
        f"Devices.{name}"
        for name in ("distribution", "count", "prefetch", "startup_timeout", "progress_timeout")
    ]
    + [
        f"Optimization.{name}"
        for name in ("microbatches", "microbatch_tokens", "nonfinite_loss", "max_rollbacks")
    ]
)

GROUPS = {  # each group of settings by its Estimator argument (not config), made with gin
    name: gin.external_configurable(group, module="trainer")
    for name, group in zip(settings.ARGUMENTS[:-1], settings.GROUPS, strict=True)
}
ConfiguredEstimator = gin.external_configurable(  # the Estimator with its gin bindings
    estimator.Estimator,
    name="Estimator",
    module="trainer",
    denylist=["model_fn", "model_dir", "seed", "config", "tracker", *GROUPS],
)
gin.external_configurable(keras_model.KerasModel, module="trainer")
Tracker = gin.external_configurable(tracking.MLflow, module="trainer")  # --tracking_uri's
for _cls in [
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
]:
    gin.external_configurable(_cls, module="optimizers")
gin.external_configurable(optimization.momentum, name="Momentum", module="optimizers")
for _cls in [  # for KerasModel.loss: a keras-hub task's masked loss, say
    keras.losses.SparseCategoricalCrossentropy,
    keras.losses.CategoricalCrossentropy,
    keras.losses.BinaryCrossentropy,
    keras.losses.MeanSquaredError,
    keras.losses.MeanAbsoluteError,
    keras.losses.Huber,
]:
    gin.external_configurable(_cls, module="losses")
gin.external_configurable(optimization.WarmupDecay, module="schedules")
for _cls in [
    keras.optimizers.schedules.ExponentialDecay,
    keras.optimizers.schedules.PiecewiseConstantDecay,
    keras.optimizers.schedules.CosineDecay,
    keras.optimizers.schedules.PolynomialDecay,
]:
    gin.external_configurable(_cls, module="schedules")
for _cls in [  # Keras's callbacks that work here (trainer.callbacks), for experiment.callbacks
    keras.callbacks.EarlyStopping,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.CSVLogger,
    keras.callbacks.TerminateOnNaN,
    keras.callbacks.LearningRateScheduler,
    keras.callbacks.RemoteMonitor,
]:
    gin.external_configurable(_cls, module="callbacks")
for _name in callbacks.REFUSED:  # a fit habit: refused in one line, with the framework's way
    gin.external_configurable(callbacks.refused_in_gin(_name), _name, module="callbacks")


def _safe_check(exists):
    """A gin file-existence check that says no instead of raising.

    gin's package-resource reader raises TypeError for a path whose first directory
    imports as a namespace package (``experiments/x.gin`` when the repository root is
    on ``sys.path``), before gin has tried its other search paths.
    """

    def check(path: str) -> bool:
        try:
            return exists(path)
        except (TypeError, ImportError, ValueError):
            return False

    check.safe = True
    return check


internals.gin_file_readers()[:] = [  # gin offers only register_file_reader
    (reader, exists if getattr(exists, "safe", False) else _safe_check(exists))
    for reader, exists in internals.gin_file_readers()
]


def parse(files: list[str], params: list[str], swept: list[str] = ()) -> None:
    """Parses the files, the --gin_param bindings, a sweep trial's; names any error's source.

    The files are there (``flags.missing_gin_file`` said so before TensorFlow loaded).
    An ``include`` is looked for from the working directory, then from each directory
    above the including files, so ``include 'experiments/base.gin'`` also works when
    the command runs elsewhere (``--gin_file ../experiments/x.gin``).
    """
    for directory in _above(files):
        gin.add_config_file_search_path(directory)
    sources = [(path, lambda path=path: gin.parse_config_file(path)) for path in files]
    sources.append(("--gin_param", lambda: gin.parse_config(params)))
    if swept:
        sources.append(("--sweep", lambda: gin.parse_config(swept)))
    for source, parse in sources:
        try:
            parse()
        except (
            ValueError,
            SyntaxError,
            ImportError,
            OSError,
            TypeError,
            tokenize.TokenError,
        ) as error:
            raise UserError(gin_errors.parse_error(error, source)) from None
    unused = gin_errors.unused_macro([*params, *swept])
    if unused:
        raise UserError(unused)
    gin_errors.check_binding_types()


def _above(files: list[str]) -> list[str]:
    """``gin_syntax.above``: the directories of ``files`` and above, but gin's own."""
    return [d for d in gin_syntax.above(files) if d not in internals.gin_include_paths()]


def check_resumable(model_dir: str, saved: str, new: str) -> None:
    """Refuses to resume when what is trained changed: any binding but ``RESUMABLE``.

    Args:
      model_dir: where ``saved`` was read from, to name it when it does not parse.
      saved: the operative config the checkpoints were trained with.
      new: this run's.

    Raises:
      ConfigChanged: naming the changes, another model first.
      UserError: ``saved`` does not parse (named with its line).
    """
    try:
        changes = config_diff.changes(saved, new, RESUMABLE)
    except (SyntaxError, ValueError, tokenize.TokenError) as error:
        where = gin_errors.parse_error(error, os.path.join(model_dir, OPERATIVE_CONFIG))
        raise UserError(
            f"{where}; it records the config this model_dir was trained with: restore it, "
            "or pass --overwrite_config to resume with this run's config"
        ) from None
    if changes:
        raise config_diff.ConfigChanged(changes)


def query(name: str, default):
    """The value bound to ``name`` ('Configurable.param'), or ``default``."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def value(name: str, default=None):
    """What ``name`` is bound to, as a call receives it; ``default`` when it is unbound.

    A macro's value, ``@Model()`` made now, ``@input_fn`` the function.
    """
    found = query(name, default)
    if isinstance(found, gin.config.ConfigurableReference):
        return found.scoped_configurable_fn() if found.evaluate else found.scoped_configurable_fn
    return found
