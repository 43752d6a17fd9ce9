"""An Estimator-style training framework for TensorFlow 2.

Research code subclasses ``ModelFn`` and writes an ``input_fn``; ``Estimator`` trains,
evaluates, predicts and checkpoints. ``python -m trainer --gin_file X.gin`` runs an
experiment described by gin files.
"""

import time

STARTED = time.perf_counter()  # before TensorFlow is imported: the run's clock starts here

from trainer import console  # noqa: E402

if console.started_from_command_line():
    console.quiet_tensorflow_import()

from trainer.errors import UserError  # noqa: E402
from trainer.estimator import Estimator  # noqa: E402
from trainer.model_fn import InputParams, Mode, ModelFn, Spec  # noqa: E402
from trainer.precision import set_precision  # noqa: E402

__all__ = ["Estimator", "InputParams", "Mode", "ModelFn", "Spec", "UserError", "set_precision"]
