"""A keras.applications backbone saved as a user saves one (nothing downloads here)."""

import keras
import numpy as np

SIZE = 32  # the fine-tuning tests' image size


def make_backbone(path, application=None, size=SIZE, alpha=0.25, seed=0):
    """A keras.applications model without its top (MobileNet alpha 0.25, 27 batch norms,
    by default) saved as .keras, as a user saves one.

    ``weights=None`` (nothing downloads here); its moving statistics are set to those
    of some images, as a pretrained model's fit its data (neither 0 and 1, so that
    inference mode shows, nor far off, which would saturate its ReLU6s).
    """
    keras.utils.set_random_seed(seed)
    body = (application or keras.applications.MobileNet)(
        weights=None, include_top=False, input_shape=(size, size, 3), alpha=alpha, pooling="avg"
    )
    norms = [layer for layer in body.layers if isinstance(layer, keras.layers.BatchNormalization)]
    momenta = [layer.momentum for layer in norms]
    for layer in norms:
        layer.momentum = 0.0  # one batch in training mode sets the statistics to its own
    images = np.random.default_rng(seed).uniform(-1, 1, (64, size, size, 3)).astype("float32")
    body(images, training=True)
    for layer, momentum in zip(norms, momenta, strict=True):
        layer.momentum = momentum
    body.save(path)
    return path
