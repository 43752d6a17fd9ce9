"""A Keras model's own ``train_step``, run as ``fit`` runs it, in the framework's blocks.

keras.io writes a GAN, a VAE or contrastive training as a ``keras.Model`` whose
``train_step`` computes its losses, applies its optimizers itself (``self.optimizer``,
or its own, as a GAN's ``d_optimizer`` and ``g_optimizer``) and returns its metrics'
results. The framework runs that method as it is, once per batch, inside its compiled
blocks: the same batches from the same weights give ``fit``'s updates, and the rest
is the framework's: checkpoints (holding the model's optimizers and its random seed
generators), resume at the exact batch, the NaN guard, logs and TensorBoard.

* A batch is handed over as ``fit`` hands it: the input_fn's element, ``x``,
  ``(x, y)`` or ``(x, y, sample_weight)``.
* The model's metrics are reset before each step, so that each value the step
  returns is that batch's; the framework averages them over a log period as ``fit``
  averages them over an epoch. ``loss`` is the step's ``loss``, or for a step that
  returns none (a GAN's ``d_loss`` and ``g_loss``) the sum of those named ``*loss``:
  the NaN guard and the progress line read it.
* What the step's own updates rule out is refused in one line (``check``): several
  devices (towers would need its gradients; a tf.distribute strategy, optimizers
  made in its scope, which ``fit`` itself cannot give keras.io's GAN), micro-batches,
  the framework's gradient clipping, optimizer groups and per-variable rates or
  freezing, and an optimizer given to the Estimator, which the step would not use.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from trainer.errors import UserError
from trainer.model_fn import Spec, Weighted
from trainer.settings import Optimization


def overrides(model: keras.Model) -> bool:
    """Whether a Keras model brings its own ``train_step``."""
    return type(model).train_step is not keras.Model.train_step


def batch(features, labels):
    """The element as ``fit`` hands it to ``train_step``: ``x``, ``(x, y)`` or ``(x, y, w)``.

    Labels in a dict of one (the framework's datasets: ``{'label': ids}``) are handed
    as that one tensor, ``y``, as a Keras user's ``(x, y)`` has it.
    """
    if labels is None:
        return features
    if isinstance(labels, Weighted):
        return features, _one(labels.labels), labels.sample_weight
    return features, _one(labels)


def _one(labels):
    return next(iter(labels.values())) if isinstance(labels, dict) and len(labels) == 1 else labels


@tf.autograph.experimental.do_not_convert  # the user's step: converted by Keras's own rules
def run(model: keras.Model, features, labels) -> Spec:
    """One call of the model's ``train_step`` on a batch; its logs as a Spec.

    The Spec's predictions and scalars are the logs; its loss is ``loss`` (see the
    module). The step has applied its updates when this returns.
    """
    for metric in model.metrics:
        metric.reset_state()
    logs = model.train_step(batch(features, labels))
    where = f"Keras model {model.name!r}'s train_step"
    if not isinstance(logs, dict) or not logs:
        raise UserError(
            f"{where} returned {type(logs).__name__}: return a dict of its metrics' "
            "results, as keras.io's train_step does"
        )
    logs = {name: tf.cast(value, tf.float32) for name, value in _flat(logs).items()}
    wide = [name for name, value in logs.items() if value.shape.rank != 0]
    if wide:
        raise UserError(
            f"{where} returned {wide[0]!r} of shape {logs[wide[0]].shape}: return one "
            "number per metric"
        )
    losses = [value for name, value in logs.items() if name.endswith("loss")]
    loss = logs["loss"] if "loss" in logs else tf.add_n(losses) if losses else None
    if loss is None:
        raise UserError(
            f"{where} returns {', '.join(logs)} and no loss: return a 'loss' (or values "
            "named '..._loss'), which the NaN guard and the progress line read"
        )
    scalars = {name: value for name, value in logs.items() if name != "loss"}
    return Spec(predictions=logs, loss=loss, scalars=scalars)


def _flat(logs: dict) -> dict:
    """Nested logs (``compile_metrics``: a dict of each metric) flattened, as fit does."""
    found = {}
    for name, value in logs.items():
        found.update(_flat(value) if isinstance(value, dict) else {name: value})
    return found


def check(
    model: keras.Model,
    *,
    distributed: bool = False,
    optimization: Optimization = Optimization(),  # noqa: B008 (frozen)
    groups=None,
    optimizer=None,
) -> None:
    """Refuses the settings a step that applies its own updates cannot honour."""
    fixes = {
        "several devices or a tf.distribute strategy": (
            distributed,
            "train it on one device (--num_devices 1)",
        ),
        **{name: (True, fix) for name, fix in optimization.only_the_step().items()},
        "optimizer groups": (groups is not None, "apply each optimizer in the step"),
        "an optimizer given to the Estimator": (
            optimizer is not None,
            "give it to the model's compile()",
        ),
    }
    for setting, (given, fix) in fixes.items():
        if given:
            raise UserError(
                f"Keras model {model.name!r} applies its own updates in its train_step, "
                f"which {setting} cannot reach: {fix}"
            )
