"""An Estimator-style training framework for TensorFlow 2.

Research code subclasses ``ModelFn`` and writes an ``input_fn``; ``Estimator`` trains,
evaluates, predicts and checkpoints. ``python -m trainer --gin_file X.gin`` runs an
experiment described by gin files.

``import trainer`` changes nothing of the process it is imported in: the names below
are imported when first used, and TensorFlow loads as it always does. The command line
(``python -m trainer``, ``python -m datasets.prepare``) starts quietly, holding
TensorFlow's C++ start-up lines back: a script or notebook that wants the same calls
``trainer.quiet_start()`` before it imports TensorFlow or Keras
(``trainer/console.py``).
"""

import importlib
import time

STARTED = time.perf_counter()  # before TensorFlow is imported: the run's clock starts here

_HOMES = {
    "Estimator": "trainer.estimator",
    "Group": "trainer.optimizer_groups",
    "InputParams": "trainer.model_fn",
    "KerasModel": "trainer.keras_model",
    "MLflow": "trainer.tracking",
    "Mode": "trainer.model_fn",
    "ModelFn": "trainer.model_fn",
    "Spec": "trainer.model_fn",
    "serves": "trainer.serving",
    "load_export": "trainer.export",
    "UserError": "trainer.errors",
    "class_weighted": "trainer.class_weight",
    "set_precision": "trainer.precision",
    "quiet_start": "trainer.console",
    "TokenMean": "trainer.tokens",
    "token_mean": "trainer.tokens",
    "token_metric": "trainer.tokens",
    "split_cpu": "trainer.distributed.strategies",
    "make_strategy": "trainer.distributed.strategies",
    **{  # the Estimator's groups of settings
        name: "trainer.settings"
        for name in "Checkpoints Devices Optimization WarmStart BestExport EarlyStop Summaries "
        "RunConfig".split()
    },
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # looked up once
        return value
    try:  # a module of the package: trainer.checkpoints.latest_checkpoint after import trainer
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'trainer' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
