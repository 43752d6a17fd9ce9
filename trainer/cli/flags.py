"""``python -m trainer``'s flags, parsed before TensorFlow loads.

This is the only module that defines flags. It imports no TensorFlow, so ``--help``
and a mistyped flag are answered at once; a command that runs imports TensorFlow
quietly (``console.quiet_start``) and hands over to ``experiment.main``.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import sys
import textwrap

from absl import app, flags

from trainer import console
from trainer.cli import gin_syntax
from trainer.distributed import preemption
from trainer.exit_codes import fail
from trainer.export_formats import FORMATS, SAVED_MODEL

SCHEDULES = ["train", "evaluate", "train_and_evaluate", "continuous_eval", "predict", "export"]

flags.DEFINE_multi_string("gin_file", [], "Gin config file; repeat to layer files in order.")
flags.DEFINE_multi_string(
    "gin_param",
    [],
    "One gin binding such as 'MLP.dropout_rate = 0.2', applied after the files; repeat for more.",
)
flags.DEFINE_string(
    "model_dir",
    None,
    "Where checkpoints, event files and the operative config go. Rerunning with the same "
    "model_dir resumes; '{timestamp}' in it becomes the start time, for a new run "
    "directory each time. Default: output/<name of the first --gin_file>.",
)
flags.DEFINE_enum("schedule", "train_and_evaluate", SCHEDULES, "What to run.")
flags.DEFINE_string(
    "results",
    None,
    "Write results here: JSON with global_step and the final metrics of each eval set; "
    "for --schedule=predict, one JSON line of predictions per example.",
)
flags.DEFINE_integer(
    "checkpoint",
    None,
    "The step of the checkpoint that --schedule evaluate, predict or export uses, instead "
    "of the newest (one the model_dir keeps: see Checkpoints.keep_every_steps).",
)
flags.DEFINE_list(
    "profile_steps",
    None,
    "START,STOP: record a profiler trace of these global steps (TensorBoard Profile tab).",
)
flags.DEFINE_bool(
    "run_eagerly", False, "Run the steps eagerly, op by op, so pdb and print work inside them."
)
flags.DEFINE_bool(
    "overwrite_config",
    False,
    "Resume even though the model, data or optimizer config differs from the one the "
    "checkpoints in --model_dir were trained with.",
)
flags.DEFINE_string(
    "num_devices",
    None,
    "'auto' (every GPU, else one CPU) or how many devices to train on; sets "
    "Devices.count. How they share a step is Devices.distribution.",
)
flags.DEFINE_string(
    "tracking_uri",
    None,
    "Record the run in MLflow at this URI (http://127.0.0.1:5000, sqlite:///mlflow.db).",
)
flags.DEFINE_multi_enum(
    "export_format",
    ["saved_model"],
    [SAVED_MODEL, *FORMATS],
    "With --schedule export: tflite, tflite_int8 or onnx files beside the SavedModel, each "
    "run by its runtime on the eval set; repeat for several. onnx needs the onnx extra.",
)
flags.DEFINE_multi_string(
    "sweep",
    [],
    "One trial per value of a binding's list, as 'Adam.learning_rate = [1e-3, 1e-2]' (repeat "
    "for a grid), each in a model_dir under --model_dir named by its values, then a table "
    "of them all. Rerunning the command resumes the sweep.",
)
flags.DEFINE_integer(
    "workers",
    None,
    "Start this many worker processes of one multi_worker run on this machine (each "
    "with a free port and its TF_CONFIG); to try and test multi-worker training.",
)
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    """Runs the command the flags describe (``experiment.main``), TensorFlow imported quietly."""
    if len(argv) > 1:
        fail(_unexpected(argv[1:]))
    missing = missing_gin_file(FLAGS.gin_file)
    if missing:
        fail(missing)
    check_combinations()
    mistyped = gin_syntax.check(FLAGS.gin_file, FLAGS.gin_param)
    if mistyped:
        fail(mistyped)
    try:
        with preemption.outside_training():
            if FLAGS.workers is not None:
                _check_workers(FLAGS.workers)
            if FLAGS.workers is not None and not FLAGS.sweep:  # a sweep launches per trial
                sys.exit(_launch(FLAGS.workers))  # which passes signals on once it runs them
            console.quiet_start(command_line=True)
            from trainer.cli import experiment

            experiment.main()
    except preemption.Interrupted as interrupted:
        fail(
            f"{interrupted} received before training started or after it ended: nothing "
            "was being trained; rerun the same command to start or resume",
            interrupted.exit_code,
            "interrupted",
        )


INFERENCE = ("evaluate", "predict", "export")  # the schedules --checkpoint applies to


def check_combinations() -> None:
    """Refuses flags that cannot work as given (together, or in their form), at once."""
    if FLAGS.checkpoint is not None and FLAGS.schedule not in INFERENCE:
        fail(
            f"--checkpoint={FLAGS.checkpoint} names the checkpoint --schedule evaluate, "
            f"predict or export uses; --schedule={FLAGS.schedule} trains on from the newest"
        )
    if FLAGS.export_format != ["saved_model"] and FLAGS.schedule != "export":
        formats = " ".join(f"--export_format {f}" for f in FLAGS.export_format)
        fail(
            f"--export_format applies to --schedule export; --schedule={FLAGS.schedule} "
            f"writes no export: run it, then --schedule export {formats}"
        )
    if FLAGS.schedule == "predict" and not FLAGS.results:
        fail("--schedule=predict needs --results=PATH.jsonl to write to")
    devices = FLAGS.num_devices
    if devices is not None and devices != "auto" and not devices.isdigit():
        fail(f"num_devices must be 'auto' or a number, got {devices!r}")
    profile_steps(FLAGS.profile_steps)


def profile_steps(values: list[str] | None) -> tuple[int, int] | None:
    """``--profile_steps=100,110`` as ``(100, 110)``; anything else is refused."""
    if not values:
        return None
    try:
        start, stop = (int(v) for v in values)
    except ValueError:
        start = stop = -1
    if not 0 <= start < stop:
        fail(
            f"--profile_steps={','.join(values)}: give START,STOP global steps "
            "with START < STOP, e.g. 100,110"
        )
    return start, stop


def _check_workers(count: int) -> None:
    """Refuses a ``--workers`` count below 1, or one given where TF_CONFIG is set."""
    if count < 1:
        fail(f"--workers={count}: give the number of worker processes, 1 or more")
    if os.environ.get("TF_CONFIG"):
        fail(
            "--workers starts its own workers on this machine, but TF_CONFIG is set: unset "
            "it, or drop --workers to run as the worker TF_CONFIG names"
        )


def _launch(count: int) -> int:
    """``--workers N``: this command as N local workers (``launcher.run``)."""
    from trainer.distributed import launcher

    return launcher.run(count, sys.argv[1:])


def _unexpected(arguments: list[str]) -> str:
    """What to say of words the flags did not take: often a binding the shell split."""
    split = [p for p in FLAGS.gin_param or [] if "=" not in p and not p.startswith("import")]
    if split and arguments[0].startswith("="):
        binding = " ".join([split[-1], *arguments])
        return (
            f"--gin_param {binding} was split by the shell at its spaces: quote the "
            f"binding, --gin_param '{binding}'"
        )
    return f"unexpected arguments {arguments}: every option is a --flag (see --help)"


def run_main() -> None:
    """Console-script entry point (``tf-trainer``)."""
    app.run(main, flags_parser=parse_flags)


def parse_flags(argv: list[str]) -> list[str]:
    """Parses the flags as absl does; a bad flag is one line (exit 2), ``--help`` is short."""
    if any(arg in ("--help", "-h", "-?", "--helpshort") for arg in argv[1:]):
        print(usage())
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.UnrecognizedFlagError as error:
        fail(f"unknown flag --{error.flagname}{_flag_hint(error.flagname, error.flagvalue)}")
    except flags.Error as error:
        fail(f"{error} (see --help)")


def missing_gin_file(files: list[str]) -> str | None:
    """What is wrong if no --gin_file is given or one is not there, else None."""
    if not files:
        return "--gin_file is required, e.g. --gin_file=experiments/digits_mlp.gin"
    for path in files:
        if not os.path.isfile(path):
            known = (
                sorted(f for f in os.listdir("experiments") if f.endswith(".gin"))
                if os.path.isdir("experiments")
                else []
            )
            hint = f"; experiments here: {', '.join(known)}" if known else ""
            return f"--gin_file={path}: no such file{hint}"
    return None


# Flags Keras and Lightning users type, and the gin setting that does what they mean.
FOREIGN_FLAGS = {
    "batch_size": (
        ": the training batch, over all devices, is --gin_param "
        "'Estimator.global_batch_size = {v}' (Estimator.eval_batch_size is evaluation's)"
    ),
    "epochs": (
        ": training runs to a step, not an epoch: --gin_param 'experiment.max_steps = N' "
        "with N = {v} x training examples / Estimator.global_batch_size"
    ),
    "lr": (
        ": the learning rate is the optimizer's, e.g. --gin_param 'Adam.learning_rate = {v}' "
        "for the optimizer Estimator.optimizer names"
    ),
}
FOREIGN_FLAGS["max_epochs"] = FOREIGN_FLAGS["epochs"]
FOREIGN_FLAGS["learning_rate"] = FOREIGN_FLAGS["lr"]


def _flag_hint(name: str, value: str) -> str:
    """For an unknown --flag: the gin setting of that name, or the closest flags."""
    shown = value.split("=", 1)[1] if "=" in value else "..."
    if name in FOREIGN_FLAGS:
        return FOREIGN_FLAGS[name].format(v=shown)
    settings = _settings()
    for configurable, parameters in settings.items():
        if name in parameters:
            return f": it is a gin setting, e.g. --gin_param '{configurable}.{name} = {shown}'"
    own = [flag.name for flag in FLAGS.get_flags_for_module(sys.modules[__name__])]
    close = difflib.get_close_matches(name, own, n=2)
    if close:
        return f"; did you mean --{' or --'.join(close)}?"
    for configurable, parameters in settings.items():
        for setting in difflib.get_close_matches(name, parameters, n=1):
            return (
                f"; did you mean the gin setting --gin_param '{configurable}.{setting} = {shown}'?"
            )
    return " (see --help)"


def _settings() -> dict[str, list[str]]:
    """The parameters of ``experiment`` and ``Estimator``, read from their source.

    (Importing them would load TensorFlow for a typo.)
    """
    return {
        "experiment": _parameters("cli/experiment.py", "experiment"),
        "Estimator": _parameters("estimator.py", "Estimator", "__init__"),
    }


def _parameters(file: str, *path: str) -> list[str]:
    """The parameter names of the function at ``path`` (class, method) in trainer/``file``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # trainer/
    with open(os.path.join(package, file)) as f:
        node = ast.parse(f.read())
    for name in path:
        node = next(
            n for n in node.body if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == name
        )
    return [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg != "self"]


def usage() -> str:
    """The trainer's own flags, a line each, and where to read more."""
    lines = [
        "usage: python3 -m trainer --gin_file experiments/NAME.gin [--gin_param 'A.b = 1'] [flags]",
        "",
        "Runs the experiment its gin files describe; rerunning with the same --model_dir resumes.",
        "",
        "flags:",
    ]
    for flag in FLAGS.get_flags_for_module(sys.modules[__name__]):
        summary = re.sub(r"^<[^>]*>: ", "", flag.help)  # absl puts an enum's values first
        summary = summary.splitlines()[0].split(". ")[0].rstrip(".;")
        lines += textwrap.wrap(
            f"--{flag.name}: {summary}", 100, initial_indent="  ", subsequent_indent="      "
        )
    lines += [
        "",
        f"schedules: {', '.join(SCHEDULES)} (default train_and_evaluate)",
        "experiments: experiments/*.gin; every gin setting: docs/guide/configuration.md; "
        "absl's flags too: --helpfull",
    ]
    return "\n".join(lines)
