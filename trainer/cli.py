"""The command line: ``python -m trainer --gin_file experiments/digits_mlp.gin``.

Its flags are parsed in ``command`` before it is imported. It parses the gin files
(with ``gin_config``, which makes ``Estimator``, Keras optimizers and learning-rate
schedules configurable) and calls ``experiment``, which builds the objects and runs
one schedule. Bad input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time
import tokenize
import uuid

import gin
import keras
import numpy as np
import tensorflow as tf
from absl import logging

import trainer
from trainer import (
    checkpoints,
    cluster,
    command,
    errors,
    evaluation,
    files,
    gin_config,
    gin_errors,
    hparams,
    logs,
    parallel,
    preemption,
    summaries,
    sweep,
    workers,
    writer_lock,
)
from trainer.checkpoints import OPERATIVE_CONFIG
from trainer.command import FLAGS
from trainer.errors import Preempted, TrainingDiverged, UserError
from trainer.estimator import RESUMABLE_SETTINGS
from trainer.precision import set_precision

_CLOCK: dict[str, float] = {}  # seconds spent importing and parsing the config
_CREATED_DIRS: list[str] = []  # directories this run made, deepest first

# Experiment settings that may change between runs of one model_dir: how long and
# how often, not what is trained (estimator.RESUMABLE_SETTINGS lists the
# Estimator's).
RESUMABLE = ("max_steps", "eval_every_steps", "eval_steps", "eval_input_fns")
INFERENCE = ("evaluate", "predict", "export")  # the schedules --checkpoint applies to


@gin.configurable(
    "experiment",
    denylist=["model_dir", "schedule", "overwrite_config", "profile_steps", "checkpoint"],
)
def experiment(
    model_dir: str,
    schedule: str,
    overwrite_config: bool = False,
    profile_steps: tuple[int, int] | None = None,
    checkpoint: int | None = None,
    model_fn=gin.REQUIRED,
    input_fn=gin.REQUIRED,
    eval_input_fns=None,
    max_steps: int = gin.REQUIRED,
    eval_every_steps: int | None = None,
    eval_steps: int | None = None,
    seed: int | None = 0,
    deterministic: bool = False,
) -> dict:
    """Builds the Estimator and runs ``schedule``; bound by the experiment's gin file.

    Args:
      model_dir: from ``--model_dir``.
      schedule: from ``--schedule``.
      overwrite_config: from ``--overwrite_config``: resume under a changed config.
      profile_steps: from ``--profile_steps``.
      checkpoint: from ``--checkpoint``: the step whose checkpoint evaluate, predict and
        export use instead of the newest.
      model_fn: the model, e.g. ``@MLP()``.
      input_fn: ``input_fn(mode, params)`` for training (and eval, unless
        ``eval_input_fns`` is given), e.g. ``@digits.input_fn``.
      eval_input_fns: dict of eval-set name to input_fn; default ``{'eval': input_fn}``.
      max_steps: the global step training stops at.
      eval_every_steps: evaluation cadence during train_and_evaluate.
      eval_steps: batches per evaluation; None evaluates the whole eval set.
      seed: seeds Keras, TF, NumPy and the input pipelines; None for no seeding.
      deterministic: make TF ops deterministic, so that a run and a killed-and-resumed
        run end bitwise equal (applied by ``main`` before anything runs).

    Returns:
      ``{'global_step', 'model_dir', 'metrics': {eval_set: {metric: value}}}`` or, for
      predict, ``{'predictions': iterator of per-example dicts}``.
    """
    del deterministic  # read by main() before any op runs; bound here to be recorded
    errors.check_count("experiment.max_steps", max_steps, minimum=0)
    errors.check_count("experiment.eval_every_steps", eval_every_steps, optional=True)
    errors.check_count("experiment.eval_steps", eval_steps, optional=True)
    estimator = gin_config.ConfiguredEstimator(
        model_fn=model_fn,
        model_dir=model_dir,
        seed=seed,
        config_text_fn=gin.operative_config_str,
        config_guard=None if overwrite_config else functools.partial(_config_guard, model_dir),
        **({"profile_steps": profile_steps} if profile_steps else {}),
    )
    eval_input_fns = evaluation.eval_sets(eval_input_fns or input_fn)
    metrics = {}
    chief = estimator.placement.worker is None
    recorded = hparams.session(model_dir, gin.operative_config_str, _resumable(), chief)
    if schedule == "train":
        with recorded:
            estimator.train(input_fn, max_steps)
    elif schedule == "evaluate":
        metrics = {
            name: estimator.evaluate(fn, eval_steps, name, checkpoint)
            for name, fn in eval_input_fns.items()
        }
    elif schedule == "train_and_evaluate":
        with recorded:
            metrics = estimator.train_and_evaluate(
                input_fn, eval_input_fns, max_steps, eval_every_steps, eval_steps
            )
    elif schedule == "continuous_eval":
        metrics = estimator.continuous_evaluate(eval_input_fns, max_steps, eval_steps)
    elif schedule == "predict":
        return {"predictions": estimator.predict(input_fn, checkpoint), "model_dir": model_dir}
    elif schedule == "export":
        path = estimator.export(input_fn, checkpoint=checkpoint)
        return {
            "global_step": estimator.step,
            "model_dir": model_dir,
            "export_dir": path,
            "metrics": {},
        }
    return {
        "global_step": estimator.step,
        "model_dir": model_dir,
        "metrics": metrics,
        "best": _best(estimator),
        "seconds": dict(estimator.seconds),
    }


def _best(estimator: trainer.Estimator) -> dict[str, dict]:
    """The best evaluation by the best-export and the early-stopping metric, where set."""
    found = {}
    exporter, stopping = estimator.best_exporter, estimator.early_stopping
    if exporter is not None and exporter.kept:
        top = exporter.kept[0]
        path = os.path.join(exporter.directory, str(top["step"]))
        found["export"] = {"metric": exporter.metric, **top, "path": path}
    if stopping is not None and stopping.best is not None:
        found["early_stopping"] = {
            "metric": stopping.metric,
            "value": stopping.best,
            "step": stopping.best_step,
        }
    return found


# ---------------------------------------------------------------- main


def main() -> None:
    """Parses gin, runs the experiment, writes results; one line and exit code on failure.

    The flags are parsed (``command.parse_flags``) before this module is imported.
    """
    _CLOCK["imports"] = time.perf_counter() - trainer.STARTED
    logs.use_console()
    try:
        failure = _sweep() if FLAGS.sweep else _run(FLAGS.gin_param, FLAGS.model_dir, FLAGS.results)
    except preemption.Interrupted:  # said by the command line; a new model_dir goes
        writer_lock.remove_unused(_CREATED_DIRS)
        raise
    logs.keep_native()
    if failure:  # a run failed before training: no directory (the workers' other runs ended)
        writer_lock.remove_unused(_CREATED_DIRS, 10 if parallel.multi_worker_started() else 0)
    if parallel.multi_worker_started():  # Python's own exit can take tens of seconds
        workers.exit_now(*(failure or ("", 0, "")))
    if failure:
        # Free the failed run (its iterators log from C++ as they die) before the last line.
        gc.collect()
        _fail(*failure)


def _sweep() -> tuple[str, int, str] | None:
    """``--sweep``: the trials of the grid, then their table (``sweep.Sweep``)."""
    try:
        if FLAGS.schedule not in ("train", "train_and_evaluate"):
            raise UserError(
                f"--sweep trains, but --schedule={FLAGS.schedule}: use train_and_evaluate "
                "(the default) or train, and --model_dir=<a trial's directory> for the rest"
            )
        trials = sweep.Sweep(
            trials=sweep.grid(FLAGS.sweep),
            files=FLAGS.gin_file,
            params=FLAGS.gin_param,
            model_dir=_model_dir(FLAGS.model_dir),
            argv=sys.argv[1:],
            run_here=_run,
            separate=FLAGS.workers is not None,
        )
        return trials.run(FLAGS.results)
    except UserError as error:
        return errors.first_line(error), error.exit_code, "error"


def _model_dir(flag: str | None) -> str:
    """``--model_dir``, or the default for the experiment, ``{timestamp}`` made now."""
    chosen = flag or _default_model_dir(FLAGS.gin_file)
    return chosen.replace("{timestamp}", time.strftime("%Y%m%d-%H%M%S"))


def _run(params: list[str], model_dir: str | None, results: str | None):
    """Runs the command with these bindings, model_dir and results file.

    Returns (message, exit code, prefix) if it failed cleanly, else None.
    """
    try:
        started = time.perf_counter()
        if "config" in _CLOCK:  # a sweep's next trial: its time counts from here
            _CLOCK.clear()
            _CLOCK["since"] = started
        gin_config.parse(FLAGS.gin_file, params)  # imports the experiment's modules
        _CLOCK["config"] = time.perf_counter() - started
        model_dir = _model_dir(model_dir)
        _CREATED_DIRS[:] = writer_lock.missing_dirs(model_dir)
        _check_writable(model_dir, "--model_dir")
        if FLAGS.checkpoint is not None and FLAGS.schedule not in INFERENCE:
            raise UserError(
                f"--checkpoint={FLAGS.checkpoint} names the checkpoint --schedule evaluate, "
                f"predict or export uses; --schedule={FLAGS.schedule} trains on from the newest"
            )
        if FLAGS.schedule == "predict" and not results:
            raise UserError("--schedule=predict needs --results=PATH.jsonl to write to")
        if results:
            _check_results(results, model_dir)
        if FLAGS.num_devices:
            value = FLAGS.num_devices
            gin.bind_parameter("Estimator.num_devices", int(value) if value.isdigit() else value)
        devices = gin_config.query("Estimator.num_devices", "auto")
        if parallel.split_cpu_for(devices):  # before any op runs
            logging.info(
                "No GPU here: the CPU is split into %d logical devices to try multi-device "
                "training on (for trying and testing: it is not faster than one)",
                devices,
            )
        precision = gin_config.query("Estimator.mixed_precision", None)
        set_precision(precision)  # before the model is made
        if gin_config.query("Estimator.distribution", "auto") == "multi_worker":
            logs.hold_native_stderr()  # a lost peer's gRPC errors go to trainer.log
            timeout = gin_config.query("Estimator.startup_timeout", cluster.STARTUP_TIMEOUT)
            parallel.make_strategy("multi_worker", [], timeout)  # before any op runs
        seed = gin_config.query("experiment.seed", 0)
        if seed is not None:
            keras.utils.set_random_seed(seed)
        if FLAGS.run_eagerly:
            tf.config.run_functions_eagerly(True)
        if gin_config.query("experiment.deterministic", False):
            tf.config.experimental.enable_op_determinism()
        tf.get_logger().setLevel("WARNING")  # TF's per-save INFO lines are noise here
        logging.info("model_dir: %s", model_dir)
        profile = _profile_steps(FLAGS.profile_steps)
        result = experiment(
            model_dir=model_dir,
            schedule=FLAGS.schedule,
            overwrite_config=FLAGS.overwrite_config,
            profile_steps=profile,
            checkpoint=FLAGS.checkpoint,
        )
        logs.keep_log(model_dir)
        _report(result, FLAGS.schedule, results)
    except workers.PEER_ERRORS as error:  # the training loop names its own lost peers
        if not parallel.multi_worker_started():
            raise
        error = workers.lost_before_training(error, parallel.joined_cluster())
        return errors.first_line(error), error.exit_code, error.prefix
    except Preempted as error:  # or a lost peer: restarting resumes either
        return errors.first_line(error), error.exit_code, error.prefix
    except TrainingDiverged as error:  # training ran: its log says how it got there
        logs.keep_log(model_dir)
        return errors.first_line(error), error.exit_code, "error"
    except UserError as error:
        return errors.first_line(error), error.exit_code, "error"
    except (TypeError, ValueError, RuntimeError) as error:  # raised through gin's calls
        message = gin_errors.call_error(error)
        if message is None:
            raise
        return message, UserError.exit_code, "error"
    return None


def _resumable() -> set[str]:
    """The bindings that only say where, how long or how often: ``'Estimator.steps_per_loop'``."""
    return {f"experiment.{name}" for name in RESUMABLE} | {
        f"Estimator.{name}" for name in RESUMABLE_SETTINGS
    }


def _profile_steps(values: list[str] | None) -> tuple[int, int] | None:
    """``--profile_steps=100,110`` as ``(100, 110)``."""
    if not values:
        return None
    try:
        start, stop = (int(v) for v in values)
    except ValueError:
        start = stop = -1
    if not 0 <= start < stop:
        raise UserError(
            f"--profile_steps={','.join(values)}: give START,STOP global steps "
            "with START < STOP, e.g. 100,110"
        )
    return start, stop


def _config_guard(model_dir: str, saved: str, new: str) -> None:
    """Refuses to resume when what is trained changed (``gin_config.check_resumable``).

    ``saved`` is model_dir's record; one that does not parse is named with its line.
    """
    resumable = _resumable()
    try:
        gin_config.check_resumable(saved, new, resumable)
    except (SyntaxError, ValueError, tokenize.TokenError) as error:
        where = gin_errors.parse_error(error, os.path.join(model_dir, OPERATIVE_CONFIG))
        raise UserError(
            f"{where}; it records the config this model_dir was trained with: restore it, "
            "or pass --overwrite_config to resume with this run's config"
        ) from None


def _default_model_dir(files: list[str]) -> str:
    return os.path.join("output", os.path.splitext(os.path.basename(files[0]))[0])


def _check_writable(directory: str, flag: str) -> None:
    """Creates ``directory`` and proves it writable, before any work is done."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UserError(f"{flag}={directory} is a file, not a directory; choose a directory")
    probe = os.path.join(directory, f".write_test_{uuid.uuid4().hex}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise UserError(
            f"{flag}={directory} is not writable ({error.strerror}); "
            "choose a directory you can write to"
        ) from None


def _check_results(path: str, model_dir: str) -> None:
    """Refuses a ``--results`` path that is a directory or one of the run's own files."""
    if os.path.isdir(path):
        example = os.path.join(path, "results.json")
        raise UserError(f"--results={path} is a directory; name a file in it, e.g. {example}")
    inside = os.path.relpath(os.path.abspath(path), os.path.abspath(model_dir))
    if not inside.startswith("..") and _runs_own(inside):
        example = os.path.join(model_dir, "results.json")
        raise UserError(
            f"--results={path} would overwrite a file of the run in {model_dir}: name "
            f"another file, e.g. {example}"
        )
    _check_writable(os.path.dirname(os.path.abspath(path)), "--results")


def _runs_own(relative: str) -> bool:
    """Whether a path inside model_dir is one the trainer writes or reads there."""
    if os.sep in relative:  # summaries, exports and their like live in subdirectories
        return True
    own = {"checkpoint", checkpoints.OPERATIVE_CONFIG, logs.LOG_NAME, evaluation.PROGRESS_FILE}
    return relative in own | {summaries.METRICS} or relative.startswith(
        ("ckpt-", "events.out.tfevents", "trainer-", ".")
    )


def _report(result: dict, schedule: str, results_path: str | None) -> None:
    """The end of a run: a summary a person reads on stdout, the results file a script reads."""
    if schedule == "predict":
        count = files.write_atomically(
            results_path,
            (
                json.dumps({k: _jsonable(v) for k, v in example.items()}) + "\n"
                for example in result["predictions"]
            ),
        )
        print(f"Wrote {count} predictions to {results_path}")
        return
    if "seconds" in result:
        result["seconds"] = _time_breakdown(result["seconds"])
    print("\n".join(summary(result)))
    if results_path:
        files.write_json(results_path, result)
        print(f"{'results':<12} {results_path}")


def summary(result: dict) -> list[str]:
    """The end-of-run lines: step and time, a table of the final metrics, where things are."""
    lines = [f"step {result['global_step']}"]
    if "seconds" in result:
        seconds = result["seconds"]
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items() if k != "wall")
        lines[0] += f" reached in {seconds['wall']:.1f}s ({parts})"
    metrics = result["metrics"]
    if metrics:
        names = list(dict.fromkeys(k for values in metrics.values() for k in values))
        width = max(10, *(len(n) for n in metrics))
        cell = [max(12, len(n) + 2) for n in names]  # every name apart, however long
        lines.append(
            f"{'eval set':<{width}}"
            + "".join(f"{n:>{w}}" for n, w in zip(names, cell, strict=True))
        )
        for eval_set, values in metrics.items():
            cells = "".join(
                f"{values[n]:>{w}.4g}" if n in values else " " * w
                for n, w in zip(names, cell, strict=True)
            )
            lines.append(f"{eval_set:<{width}}{cells}")
    model_dir = result["model_dir"]
    where = []
    for kind, best in result.get("best", {}).items():
        text = f"{best['metric']} {best['value']:.4g} at step {best['step']}"
        where.append(("best", text + (f" ({best['path']})" if kind == "export" else "")))
    if "export_dir" in result:
        where.append(("exported", result["export_dir"]))
        where.append(("serve it", f"saved_model_cli show --dir {result['export_dir']} --all"))
    where.append(("model_dir", model_dir))
    for label, name in (("metrics", summaries.METRICS), ("log", logs.LOG_NAME)):
        if os.path.exists(os.path.join(model_dir, name)):
            where.append((label, os.path.join(model_dir, name)))
    where.append(("tensorboard", f"tensorboard --logdir {model_dir}"))
    return lines + [f"{label:<12} {text}" for label, text in where]


def _time_breakdown(estimator_seconds: dict[str, float]) -> dict[str, float]:
    """Wall time from process start, split into imports, config, the Estimator's parts."""
    wall = time.perf_counter() - _CLOCK.get("since", trainer.STARTED)
    parts = {**{k: v for k, v in _CLOCK.items() if k != "since"}, **estimator_seconds}
    return {"wall": wall, **parts, "other": max(wall - sum(parts.values()), 0.0)}


def _jsonable(value):
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value.tolist()


def _fail(message: str, exit_code: int = UserError.exit_code, prefix: str = "error") -> None:
    # TF logs warnings about half-restored objects as they are freed at exit; the
    # one line below says everything, so keep it the last line.
    logging.set_verbosity(logging.ERROR)
    tf.get_logger().setLevel("ERROR")
    command.fail(message, exit_code, prefix)
