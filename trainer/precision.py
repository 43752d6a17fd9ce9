"""Mixed precision: computing in 16 bits while weights, logits and loss stay float32.

``set_precision`` sets Keras's global dtype policy and must run before the model's
layers are made (``python -m trainer`` does); the Estimator then checks that the
model was made under it, and wraps the optimizer for loss scaling under float16.
"""

from __future__ import annotations

import keras

from trainer.errors import UserError
from trainer.model_fn import ModelFn

PRECISIONS = ("mixed_bfloat16", "mixed_float16")


def set_precision(mixed_precision: str | None) -> None:
    """Sets Keras's global dtype policy; call it before the model's layers are made."""
    check(None, mixed_precision)
    keras.mixed_precision.set_dtype_policy(mixed_precision or "float32")


def check(model_fn: ModelFn | None, mixed_precision: str | None) -> None:
    """Refuses an unknown policy, or a model made before the policy was set."""
    if mixed_precision is not None and mixed_precision not in PRECISIONS:
        raise UserError(
            f"Devices.mixed_precision must be None, {' or '.join(map(repr, PRECISIONS))}; "
            f"got {mixed_precision!r}"
        )
    if mixed_precision is None or model_fn is None:
        return
    layers = model_fn.layers
    # A layer kept in float32 on purpose (a final softmax) is fine; none in the policy
    # means the model was made before the policy was set.
    if layers and not any(layer.dtype_policy.name == mixed_precision for layer in layers):
        raise UserError(
            f"Devices.mixed_precision is {mixed_precision!r} but the layers of {model_fn} "
            f"compute in {layers[0].dtype_policy.name!r}: call "
            f"trainer.set_precision({mixed_precision!r}) before making the model "
            "(python -m trainer does)"
        )


def scaled(
    optimizer: keras.optimizers.Optimizer, mixed_precision: str | None
) -> keras.optimizers.Optimizer:
    """The optimizer, with loss scaling under ``'mixed_float16'`` (small gradients survive)."""
    if mixed_precision == "mixed_float16" and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
