"""An Estimator-style training framework for TensorFlow 2.

Research code subclasses ``ModelFn`` and writes an ``input_fn``; ``Estimator`` trains,
evaluates, predicts and checkpoints. ``python -m trainer --gin_file X.gin`` runs an
experiment described by gin files.
"""

from trainer.errors import UserError
from trainer.estimator import Estimator, set_precision
from trainer.model_fn import InputParams, Mode, ModelFn, Spec

__all__ = ["Estimator", "InputParams", "Mode", "ModelFn", "Spec", "UserError", "set_precision"]
