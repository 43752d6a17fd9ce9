"""The command line: ``python -m trainer --gin_file experiments/digits_mlp.gin``.

Its flags are defined and parsed in ``trainer.cli.flags`` before it is imported (it
reads them from absl's ``FLAGS``). It parses the gin files (with ``gin_config``, which makes
``Estimator``, Keras optimizers and learning-rate schedules configurable), sets up
the process and calls ``experiment``, which builds the objects and runs one
schedule; ``report`` prints the summary and writes the results file. Bad input
ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import time
import uuid

import gin
import keras
import tensorflow as tf
from absl import flags, logging

import trainer
from trainer import (
    checkpoints,
    deployment,
    errors,
    evaluation,
    exit_codes,
    hparams,
    logs,
    summaries,
    tracking,
    writer_lock,
)
from trainer.cli import gin_config, gin_errors, report, sweep
from trainer.distributed import cluster, preemption, strategies, workers
from trainer.errors import Preempted, TrainingDiverged, UserError
from trainer.precision import set_precision
from trainer.settings import RunConfig

_CLOCK: dict[str, float] = {}  # seconds spent importing and parsing the config
_CREATED_DIRS: list[str] = []  # directories this run made, deepest first

PEER_SIGNAL_GRACE = 2.0  # seconds a worker that lost a peer before training waits for a signal
FLAGS = flags.FLAGS  # defined and parsed by trainer.cli.flags before this module is imported


@gin.configurable(
    "experiment",
    denylist=[
        "model_dir",
        "schedule",
        "overwrite_config",
        "profile_steps",
        "checkpoint",
        "tracking_uri",
        "export_formats",
    ],
)
def experiment(
    model_dir: str,
    schedule: str,
    overwrite_config: bool = False,
    profile_steps: tuple[int, int] | None = None,
    checkpoint: int | None = None,
    tracking_uri: str | None = None,
    export_formats: tuple[str, ...] = (),
    model_fn=gin.REQUIRED,
    input_fn=gin.REQUIRED,
    eval_input_fns=None,
    max_steps: int = gin.REQUIRED,
    eval_every_steps: int | None = None,
    eval_steps: int | None = None,
    seed: int | None = 0,
    deterministic: bool = False,
    callbacks=(),
    tracker=None,
) -> dict:
    """Builds the Estimator and runs ``schedule``; bound by the experiment's gin file.

    Args:
      model_dir: from ``--model_dir``.
      schedule: from ``--schedule``.
      overwrite_config: from ``--overwrite_config``: resume under a changed config.
      profile_steps: from ``--profile_steps``.
      checkpoint: from ``--checkpoint``: the step whose checkpoint evaluate, predict and
        export use instead of the newest.
      tracking_uri: from ``--tracking_uri``: records the run in MLflow there.
      export_formats: from ``--export_format``: deployment files the export adds.
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
      callbacks: Keras callbacks for train and train_and_evaluate, e.g.
        ``[@callbacks.EarlyStopping()]`` (``trainer.callbacks``).
      tracker: an experiment tracker, ``@MLflow()`` (``trainer.tracking``).

    Returns:
      ``{'global_step', 'model_dir', 'metrics': {eval_set: {metric: value}}}`` or, for
      predict, ``{'predictions': iterator of per-example dicts}``.
    """
    del deterministic  # read by main() before any op runs; bound here to be recorded
    errors.check_count("experiment.max_steps", max_steps, minimum=0)
    errors.check_count("experiment.eval_every_steps", eval_every_steps, optional=True)
    errors.check_count("experiment.eval_steps", eval_steps, optional=True)
    groups = {name: group() for name, group in gin_config.GROUPS.items()}
    if profile_steps:
        groups["summaries"] = gin_config.GROUPS["summaries"](profile_steps=profile_steps)
    guard = None if overwrite_config else functools.partial(gin_config.check_resumable, model_dir)
    tracker = _tracker(tracker, tracking_uri, model_dir)
    estimator = gin_config.ConfiguredEstimator(
        model_fn=model_fn,
        model_dir=model_dir,
        seed=seed,
        config=RunConfig(gin.operative_config_str, guard),
        tracker=tracker,
        **groups,
    )
    eval_input_fns = evaluation.eval_sets(eval_input_fns or input_fn)
    metrics = {}
    chief = estimator.placement.worker is None
    recorded = hparams.session(model_dir, gin.operative_config_str, gin_config.RESUMABLE, chief)
    if schedule == "train":
        with recorded:
            estimator.train(input_fn, max_steps, callbacks)
    elif schedule == "evaluate":
        metrics = {
            name: estimator.evaluate(fn, eval_steps, name, checkpoint)
            for name, fn in eval_input_fns.items()
        }
    elif schedule == "train_and_evaluate":
        with recorded:
            metrics = estimator.train_and_evaluate(
                input_fn, eval_input_fns, max_steps, eval_every_steps, eval_steps, callbacks
            )
    elif schedule == "continuous_eval":
        metrics = estimator.continuous_evaluate(eval_input_fns, max_steps, eval_steps)
    elif schedule == "predict":
        return {"predictions": estimator.predict(input_fn, checkpoint), "model_dir": model_dir}
    elif schedule == "export":
        evaluated = next(iter(eval_input_fns.values()))
        path = estimator.export(input_fn, None, checkpoint, export_formats, evaluated)
        return {
            "global_step": estimator.step,
            "model_dir": model_dir,
            "export_dir": path,
            "exports": deployment.recorded(path),
            "metrics": {},
        }
    if estimator.tracker is not None and schedule not in ("train", "train_and_evaluate"):
        estimator.tracker.finish("FINISHED")  # the evaluations it recorded
    return {
        "global_step": estimator.step,
        "model_dir": model_dir,
        "metrics": metrics,
        "classes": {n: estimator.model.classes[n] for n in metrics if n in estimator.model.classes},
        "best": report.best(estimator.best_exporter, estimator.early_stopping),
        "seconds": dict(estimator.seconds),
        "tracker": estimator.tracker,
    }


def _tracker(tracker, tracking_uri: str | None, model_dir: str):
    """``experiment.tracker``, at ``--tracking_uri`` if given; params: the gin bindings."""
    if tracker is None and tracking_uri:
        tracker = gin_config.Tracker(tracking_uri)  # with the MLflow bindings
    elif tracker is not None and tracking_uri:
        tracker.tracking_uri = tracking_uri
    if tracker is not None:
        tracker.bind(
            model_dir,
            lambda: hparams.of_config(gin.operative_config_str(), gin_config.RESUMABLE),
        )
    return tracker


# ---------------------------------------------------------------- main


def main() -> None:
    """Parses gin, runs the experiment, writes results; one line and exit code on failure.

    The flags are parsed (``flags.parse_flags``) before this module is imported.
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
        writer_lock.remove_unused(_CREATED_DIRS, 10 if strategies.multi_worker_started() else 0)
    if strategies.multi_worker_started():  # Python's own exit can take tens of seconds
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
        if not FLAGS.tracking_uri:
            return trials.run(FLAGS.results)
        parent = tracking.MLflow(FLAGS.tracking_uri)  # one run; each trial's is its child
        parent.check()
        os.makedirs(trials.model_dir, exist_ok=True)
        tracking.sweep_run(parent, trials.model_dir, {"sweep": " ".join(FLAGS.sweep)})
        failure = trials.run(FLAGS.results)
        parent.finish("FINISHED" if failure is None else "FAILED")
        return failure
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
        _check_paths(model_dir, results)
        _set_up_the_process()  # before any op runs
        logging.info("model_dir: %s", model_dir)
        profile = tuple(map(int, FLAGS.profile_steps)) if FLAGS.profile_steps else None  # checked
        result = experiment(
            model_dir=model_dir,
            schedule=FLAGS.schedule,
            overwrite_config=FLAGS.overwrite_config,
            profile_steps=profile,
            checkpoint=FLAGS.checkpoint,
            tracking_uri=FLAGS.tracking_uri,
            export_formats=tuple(FLAGS.export_format),
        )
        logs.keep_log(model_dir)
        tracker = result.pop("tracker", None)
        report.write(result, FLAGS.schedule, results, _CLOCK)
        if tracker is not None and results:
            tracker.artifact(results)
    except workers.PEER_ERRORS as error:  # the training loop names its own lost peers
        if not strategies.multi_worker_started():
            raise
        # A signal to every worker (a time limit's warning, Ctrl-C) stops the first to
        # get it before training: the others lose it first, and get their own just
        # after. Wait for it (the handler raises Interrupted) before blaming the peer.
        time.sleep(PEER_SIGNAL_GRACE)
        error = workers.lost_before_training(error, strategies.joined_cluster())
        return errors.first_line(error), error.exit_code, error.prefix
    except Preempted as error:  # or a lost peer: restarting resumes either
        return errors.first_line(error), error.exit_code, error.prefix
    except TrainingDiverged as error:  # training ran: its log says how it got there
        logs.keep_log(model_dir)
        return errors.first_line(error), error.exit_code, "error"
    except UserError as error:
        return errors.first_line(error), error.exit_code, "error"
    except (TypeError, ValueError, RuntimeError) as error:  # raised through gin's calls
        if str(error).startswith("NaN or Inf loss encountered"):  # TerminateOnNaN's own
            return errors.first_line(error), TrainingDiverged.exit_code, "error"
        message = gin_errors.call_error(error)
        if message is None:
            raise
        return message, UserError.exit_code, "error"
    return None


def _check_paths(model_dir: str, results: str | None) -> None:
    """Makes model_dir (remembering what it made) and refuses a results file that cannot work.

    The flags that need no path were checked before TensorFlow loaded
    (``flags.check_combinations``).
    """
    _CREATED_DIRS[:] = writer_lock.missing_dirs(model_dir)
    _check_writable(model_dir, "--model_dir")
    if results:
        _check_results(results, model_dir)


def _set_up_the_process() -> None:
    """What the config asks of TensorFlow before any op runs: devices, precision, seeds."""
    if FLAGS.num_devices:
        value = FLAGS.num_devices
        gin.bind_parameter("Devices.count", int(value) if value.isdigit() else value)
    devices = gin_config.query("Devices.count", "auto")
    if strategies.split_cpu_for(devices):  # before any op runs
        logging.info(
            "No GPU here: the CPU is split into %d logical devices to try multi-device "
            "training on (for trying and testing: it is not faster than one)",
            devices,
        )
    precision = gin_config.query("Devices.mixed_precision", None)
    set_precision(precision)  # before the model is made
    if gin_config.query("Devices.distribution", "auto") == "multi_worker":
        logs.hold_native_stderr()  # a lost peer's gRPC errors go to trainer.log
        timeout = gin_config.query("Devices.startup_timeout", cluster.STARTUP_TIMEOUT)
        strategies.make_strategy("multi_worker", [], timeout)  # before any op runs
    seed = gin_config.query("experiment.seed", 0)
    if seed is not None:
        keras.utils.set_random_seed(seed)
    if FLAGS.run_eagerly:
        tf.config.run_functions_eagerly(True)
    if gin_config.query("experiment.deterministic", False):
        tf.config.experimental.enable_op_determinism()
    tf.get_logger().setLevel("WARNING")  # TF's per-save INFO lines are noise here


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


def _fail(message: str, exit_code: int = UserError.exit_code, prefix: str = "error") -> None:
    # TF logs warnings about half-restored objects as they are freed at exit; the
    # one line below says everything, so keep it the last line.
    logging.set_verbosity(logging.ERROR)
    tf.get_logger().setLevel("ERROR")
    exit_codes.fail(message, exit_code, prefix)
