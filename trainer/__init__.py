"""An Estimator-style training framework for TensorFlow 2.

Research code subclasses ``ModelFn`` and writes an ``input_fn``; ``Estimator`` trains,
evaluates, predicts and checkpoints. ``python -m trainer --gin_file X.gin`` runs an
experiment described by gin files.

``import trainer`` loads TensorFlow with its C++ start-up lines held back (CUDA
probing, CPU-feature notes: ``console.quiet_tensorflow_import``), so a script, a
notebook or ``python -m datasets.prepare`` starts as quietly as the command line.
The command line itself imports TensorFlow only after its flags, so that ``--help``
or a mistyped flag answers at once; the names below are imported when first used.
"""

import importlib
import os
import sys
import time

STARTED = time.perf_counter()  # before TensorFlow is imported: the run's clock starts here


def _is_the_command_line() -> bool:
    """``python -m trainer`` or the ``tf-trainer`` script, which import TensorFlow later."""
    argv = getattr(sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return module in ("trainer", "trainer.__main__") or script == "tf-trainer"


if not _is_the_command_line():  # TensorFlow may be in already: its devices are probed here
    from trainer import console

    console.quiet_tensorflow_import()

_HOMES = {
    "Estimator": "trainer.estimator",
    "Group": "trainer.groups",
    "InputParams": "trainer.model_fn",
    "KerasModel": "trainer.keras_model",
    "Mode": "trainer.model_fn",
    "ModelFn": "trainer.model_fn",
    "Spec": "trainer.model_fn",
    "serves": "trainer.serving",
    "UserError": "trainer.errors",
    "set_precision": "trainer.precision",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # looked up once
        return value
    try:  # a module of the package: trainer.parallel.split_cpu(4) after import trainer
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'trainer' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
