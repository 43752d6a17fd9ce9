"""An Estimator-style training framework for TensorFlow 2.

Research code subclasses ``ModelFn`` and writes an ``input_fn``; ``Estimator`` trains,
evaluates, predicts and checkpoints. ``python -m trainer --gin_file X.gin`` runs an
experiment described by gin files.

The names below are imported when first used, so that the command line can answer
``--help`` or a mistyped flag before TensorFlow loads.
"""

import importlib
import time

STARTED = time.perf_counter()  # before TensorFlow is imported: the run's clock starts here

_HOMES = {
    "Estimator": "trainer.estimator",
    "InputParams": "trainer.model_fn",
    "Mode": "trainer.model_fn",
    "ModelFn": "trainer.model_fn",
    "Spec": "trainer.model_fn",
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
