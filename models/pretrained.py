"""A pretrained Keras backbone under a new classification head: Keras's transfer learning.

The backbone is a ``.keras`` file: a ``keras.applications`` model saved with
``include_top=False`` (``weights='imagenet'`` where there is internet), a KerasHub
backbone's Keras model, or a user's own. The model is

    image in [0, 1] -> the backbone's pixel scaling -> backbone(training=False)
    -> global average pooling (if the backbone does not pool) -> dropout -> Dense

and it trains in the two phases of Keras's transfer-learning guide:

1. ``train_body = False``: the backbone is frozen (its weights are not trainable) and
   only the head learns, at an ordinary rate;
2. ``train_body = True`` in a second run warm-started from the first
   (``WarmStart.source``), everything at a low rate (1e-5), with a fresh optimizer, as
   the guide's second ``compile``.

The backbone runs in inference mode in both phases, as the guide's
``base_model(x, training=False)``: its batch norm normalises by the moving statistics
it was pretrained with and never moves them, so the few examples of a fine-tuning
batch do not overwrite what ImageNet taught it (nor does its dropout act).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence

import gin
import keras
import tensorflow as tf
from absl import logging

from models import heads
from trainer import Mode, ModelFn, UserError, errors

# How keras.applications models expect their pixels (``preprocess_input``'s modes),
# written for images in [0, 1]. 'tf': MobileNet, MobileNetV2, Xception, Inception;
# 'torch': DenseNet; 'caffe': ResNet50/101/152 (v1), VGG; None: models that scale
# inside (EfficientNet, EfficientNetV2, ConvNeXt, MobileNetV3, RegNet, ResNetRS), [0, 255].
PREPROCESSING = ("tf", "torch", "caffe", None)
_TORCH_MEAN, _TORCH_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_CAFFE_MEAN_BGR = (103.939, 116.779, 123.68)


def scale_pixels(image: tf.Tensor, preprocessing: str | None) -> tf.Tensor:
    """Images in [0, 1] as a keras.applications backbone of ``preprocessing`` takes them."""
    if preprocessing == "tf":
        return image * 2.0 - 1.0
    if preprocessing == "torch":
        return (image - tf.constant(_TORCH_MEAN)) / tf.constant(_TORCH_STD)
    if preprocessing == "caffe":
        return image[..., ::-1] * 255.0 - tf.constant(_CAFFE_MEAN_BGR)
    return image * 255.0


def load_backbone(path: str) -> keras.Model:
    """The Keras model in a ``.keras`` file, its variables under ``body/``, or one line why not."""
    if not str(path).endswith(".keras"):
        raise UserError(
            f"Pretrained.backbone = {path!r} is not a .keras file: save the backbone with "
            "model.save('backbone.keras') (Keras 3's format)"
        )
    if not os.path.exists(path):
        raise UserError(
            f"Pretrained.backbone = {path!r} does not exist: save one first, e.g. "
            "keras.applications.MobileNetV2(include_top=False, pooling='avg')"
            f".save({path!r})"
        )
    if not zipfile.is_zipfile(path):
        raise UserError(
            f"Pretrained.backbone = {path!r} is not a whole .keras file (a zip archive): "
            "copied or downloaded in part? Save it again with model.save(...)"
        )
    try:
        with keras.name_scope("body"):  # its variables' paths: body/Conv1/kernel, ...
            return keras.saving.load_model(path, compile=False)
    except (OSError, RuntimeError, ValueError, KeyError, zipfile.BadZipFile) as error:  # h5py's
        said = errors.first_line(error) or type(error).__name__
        raise UserError(
            f"Pretrained.backbone = {path!r} cannot be loaded ({said}): save it again with "
            "model.save(...)"
        ) from None


@gin.configurable
class Pretrained(ModelFn):
    """A pretrained backbone (a ``.keras`` file) under a new head; see the module docstring.

    Args:
      backbone: the ``.keras`` file of the backbone, made without its top.
      num_classes: size of the new head.
      train_body: whether the backbone's weights train (the guide's second phase).
      preprocessing: the backbone's pixel scaling: ``'tf'`` ([-1, 1]), ``'torch'``
        (ImageNet's mean and deviation), ``'caffe'`` (BGR minus the mean) or None
        ([0, 255], for models that scale inside); see ``PREPROCESSING``.
      image_size: resize images to this square size first (None: as they come).
      dropout_rate: dropout before the head in training (0.2 in Keras's guide).
      label_smoothing: mixes the loss's target with the uniform distribution.
      top_k_errors: report ``top_K_error`` for each K.
      image_key: the feature to classify (pixels in [0, 1]).
      label_key: the label holding class ids.
    """

    def __init__(
        self,
        backbone: str = gin.REQUIRED,
        num_classes: int = 2,
        train_body: bool = False,
        preprocessing: str | None = "tf",
        image_size: int | None = None,
        dropout_rate: float = 0.2,
        label_smoothing: float = 0.0,
        top_k_errors: Sequence[int] = (),
        image_key: str = "image",
        label_key: str = "label",
    ):
        super().__init__(name="pretrained")
        if preprocessing not in PREPROCESSING:
            raise UserError(
                f"Pretrained.preprocessing must be one of {PREPROCESSING}, got {preprocessing!r}"
            )
        self.body = load_backbone(backbone)
        self.body.trainable = train_body
        self.head = keras.layers.Dense(num_classes, name="head")
        self.dropout = keras.layers.Dropout(dropout_rate, name="dropout")
        self.preprocessing, self.image_size = preprocessing, image_size
        self.label_smoothing, self.top_k_errors = label_smoothing, list(top_k_errors)
        self.image_key, self.label_key = image_key, label_key
        logging.info("%s", describe(self.body, backbone, train_body, num_classes))

    def __str__(self) -> str:
        """How the console names the model: ``Pretrained(mobilenetv2_1.00_224)``."""
        return f"Pretrained({self.body.name})"

    def __call__(self, features, labels, mode):
        """Logits of the new head; see ``heads.classification`` for the Spec."""
        image = tf.cast(features[self.image_key], tf.float32)
        if self.image_size:
            image = tf.image.resize(image, [self.image_size, self.image_size])
        self._check_channels(image)
        # Inference mode in both phases, as the guide's base_model(x, training=False).
        x = self.body(scale_pixels(image, self.preprocessing), training=False)
        if x.shape.rank == 4:  # a backbone saved without pooling='avg'
            x = tf.reduce_mean(x, axis=[1, 2])
        x = self.dropout(x, training=mode == Mode.TRAIN)
        logits = self.head(x)
        spec = heads.classification(
            logits, labels, self.label_key, self.top_k_errors, self.label_smoothing
        )
        spec.activations = {"features": x, "logits": logits}
        return spec

    def _check_channels(self, image: tf.Tensor) -> None:
        """Refuses images of other channels than the backbone takes (grey into RGB)."""
        wanted, given = self.body.input_shape[-1], image.shape[-1]
        if wanted is not None and given is not None and wanted != given:
            raise UserError(
                f"the backbone {self.body.name} takes images of {wanted} channels, but "
                f"{self.image_key!r} has {given}: convert them in the input_fn "
                "(tf.image.grayscale_to_rgb for grey images), or use a backbone made for "
                f"{given}"
            )


def describe(body: keras.Model, path: str, train_body: bool, num_classes: int) -> str:
    """The line saying what was loaded: the backbone, its size, what trains."""
    weights = sum(int(tf.size(v)) for v in body.weights)
    norms = sum(isinstance(layer, keras.layers.BatchNormalization) for layer in _layers(body))
    trains = "trains with the head" if train_body else "frozen; the head alone trains"
    return (
        f"Loaded backbone {body.name} from {path}: {weights:,} weights in {len(body.layers)} "
        f"layers ({norms} batch norms, kept in inference mode), {trains}; "
        f"new head of {num_classes} classes"
    )


def _layers(model: keras.Model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _layers(layer)
