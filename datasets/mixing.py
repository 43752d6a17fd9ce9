"""MixUp and CutMix of training batches, drawn from (seed, stream position).

Each training example is mixed with its neighbour in the stream: positions ``2j``
and ``2j + 1`` form pair ``j`` (timm's ``mode='pair'``). A mixed pair takes one
weight ``lam``:

* MixUp (Zhang et al. 2018): ``lam ~ Beta(mixup_alpha, mixup_alpha)``; each image
  becomes ``lam * itself + (1 - lam) * its neighbour``;
* CutMix (Yun et al. 2019): ``lam ~ Beta(cutmix_alpha, cutmix_alpha)``; a box of
  ``1 - lam`` of the image's area, centred at a uniform point and clipped to the
  image, is pasted from the neighbour (the same box both ways), and ``lam`` becomes
  the share of the image left.

The label becomes the class distribution ``lam * one_hot(own) + (1 - lam) *
one_hot(neighbour)``: ``heads.classification`` takes it, as does a Keras model
compiled with ``categorical_crossentropy``.

Every draw of pair ``j`` is a function of ``(run seed, j)`` alone, and a pair never
spans two replicas' batches (each replica's share of a step is a run of neighbouring
positions, refused when odd): a resumed run mixes exactly as the uninterrupted one,
and 1, 2 or 8 devices, or several workers, mix every pair alike.

Bound in gin under ``mixing`` (``mixing.mixup_alpha = 0.2``); pipelines made with
``datasets.pipeline`` apply it to training batches, never to evaluation.
"""

from __future__ import annotations

import dataclasses

import gin
import tensorflow as tf

from trainer import UserError

_SALT = 0x4D1C_5EED  # keeps the mixing's seeds apart from the augmentations' (seed, position)


@dataclasses.dataclass(frozen=True)
class Mixing:
    """What ``mixing`` is bound to; see the module docstring.

    Args:
      mixup_alpha: Beta's parameter of MixUp's weight (0: no MixUp; 0.2 on ImageNet).
      cutmix_alpha: Beta's parameter of CutMix's area (0: no CutMix; 1.0 is usual).
      probability: the share of pairs that are mixed at all.
      cutmix_share: with both on, the share of mixed pairs that take CutMix.
      num_classes: the label's classes (the model's ``num_classes``).
      image_key: the feature mixed.
      label_key: the label of class ids made into mixed distributions.
    """

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    probability: float = 1.0
    cutmix_share: float = 0.5
    num_classes: int | None = None
    image_key: str = "image"
    label_key: str = "label"

    def __post_init__(self):
        for name in ("mixup_alpha", "cutmix_alpha"):
            if getattr(self, name) < 0:
                raise UserError(f"mixing.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("probability", "cutmix_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"mixing.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.active and not (self.num_classes and self.num_classes > 1):
            raise UserError(
                "mixing needs the number of classes to mix labels: bind mixing.num_classes "
                f"to the model's (e.g. mixing.num_classes = 10), got {self.num_classes}"
            )

    @property
    def active(self) -> bool:
        """Whether any pair is ever mixed."""
        return (self.mixup_alpha > 0 or self.cutmix_alpha > 0) and self.probability > 0


_CONFIGURED = gin.external_configurable(Mixing, name="mixing")  # mixing.mixup_alpha = 0.2


def options() -> Mixing:
    """The mixing bound in gin (``mixing.cutmix_alpha = 1.0``); off unless an alpha is set."""
    return _CONFIGURED()


def check_batch(mixing: Mixing, batch_size: int) -> None:
    """Refuses a per-replica batch that would split a pair between two replicas."""
    if mixing.active and batch_size % 2:
        raise UserError(
            f"MixUp and CutMix mix neighbouring examples in pairs, and each replica's batch "
            f"of {batch_size} is odd: make Estimator.global_batch_size / replicas even"
        )


@tf.autograph.experimental.do_not_convert
def mix(features: dict, labels: dict, positions: tf.Tensor, seed: int, mixing: Mixing):
    """``(features, labels)`` of one replica's batch at stream ``positions``, mixed in pairs.

    ``positions`` are the batch's stream positions, consecutive from an even one.
    """
    images, ids = _checked(features, labels, mixing)
    pairs = tf.cast(positions[::2], tf.int64) // 2
    lam, cut, box = tf.map_fn(
        lambda pair: _draw(pair, seed, mixing),
        pairs,
        fn_output_signature=(tf.float32, tf.bool, tf.float32),
    )
    partner = tf.bitwise.bitwise_xor(tf.range(tf.shape(positions)[0]), 1)
    # Each example takes its pair's draws.
    lam, cut, box = (tf.repeat(t, 2, axis=0) for t in (lam, cut, box))
    other = tf.gather(images, partner)
    inside = _box_mask(box, tf.shape(images)[1], tf.shape(images)[2])
    area = tf.reduce_mean(tf.cast(inside, tf.float32), axis=[1, 2])
    lam = tf.where(cut, 1.0 - area, lam)
    pixels = tf.cast(images, tf.float32)
    blended = _per_example(lam, pixels) * pixels + _per_example(1.0 - lam, pixels) * tf.cast(
        other, tf.float32
    )
    pasted = tf.where(inside[..., None], tf.cast(other, tf.float32), pixels)
    mixed = tf.where(_per_example(cut, pixels), pasted, blended)
    if images.dtype.is_integer:
        mixed = tf.round(mixed)
    one_hot = tf.one_hot(ids, mixing.num_classes)
    target = lam[:, None] * one_hot + (1.0 - lam[:, None]) * tf.gather(one_hot, partner)
    features = {**features, mixing.image_key: tf.cast(mixed, images.dtype)}
    return features, {**labels, mixing.label_key: target}


def _checked(features: dict, labels: dict, mixing: Mixing) -> tuple[tf.Tensor, tf.Tensor]:
    """The batch's images and class ids; refuses what cannot be mixed, in one line.

    The shapes when traced; the ids when run (an id out of range would mix a row of
    zeros into the label, which a Keras loss takes silently).
    """
    images = features.get(mixing.image_key) if isinstance(features, dict) else None
    ids = labels.get(mixing.label_key) if isinstance(labels, dict) else None
    if images is None or images.shape.rank != 4:
        got = "no such feature" if images is None else f"of shape {images.shape}"
        raise UserError(
            f"MixUp and CutMix mix images [batch, height, width, channels], but "
            f"{mixing.image_key!r} is {got}: bind mixing.image_key to the images, or drop "
            "mixing.mixup_alpha and mixing.cutmix_alpha for other data"
        )
    if ids is None or ids.shape.rank != 1 or not ids.dtype.is_integer:
        got = "not given" if ids is None else f"{ids.dtype.name} of shape {ids.shape}"
        raise UserError(
            f"MixUp and CutMix make class distributions of class ids, one per example, but "
            f"label {mixing.label_key!r} is {got}: give class ids (not one-hot rows), or bind "
            "mixing.label_key"
        )
    inside = (ids >= 0) & (ids < mixing.num_classes)
    check = tf.debugging.Assert(
        tf.reduce_all(inside),
        [
            f"label out of range [0, {mixing.num_classes}) in MixUp/CutMix; is "
            "mixing.num_classes right? (got",
            tf.boolean_mask(ids, ~inside)[:8],
            ")",
        ],
    )
    with tf.control_dependencies([check]):
        return images, tf.identity(ids)


@tf.autograph.experimental.do_not_convert
def _draw(pair: tf.Tensor, seed: int, mixing: Mixing):
    """``(lam, cut, box)`` of one pair: its MixUp weight or CutMix box, from (seed, pair)."""
    key = tf.stack([tf.constant(seed ^ _SALT, tf.int64), pair])
    uniform_key, gamma_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
    mixed, choice, y, x = tf.unstack(tf.random.stateless_uniform([4], uniform_key))
    if mixing.mixup_alpha > 0 and mixing.cutmix_alpha > 0:
        cut = choice < mixing.cutmix_share
    else:
        cut = tf.constant(mixing.cutmix_alpha > 0)
    alpha = tf.where(cut, mixing.cutmix_alpha, mixing.mixup_alpha)
    gammas = tf.random.stateless_gamma([2], gamma_key, alpha=alpha)
    lam = gammas[0] / tf.maximum(gammas[0] + gammas[1], 1e-12)
    lam = tf.where(mixed < mixing.probability, lam, 1.0)
    side = tf.sqrt(1.0 - lam)  # the box's height and width, as shares of the image's
    box = tf.stack([y - side / 2, x - side / 2, y + side / 2, x + side / 2])
    return lam, cut & (mixed < mixing.probability), box


def _box_mask(box: tf.Tensor, height: tf.Tensor, width: tf.Tensor) -> tf.Tensor:
    """Which pixels (``[batch, height, width]``) have their centres in each box (in fractions)."""
    rows = (tf.range(height, dtype=tf.float32) + 0.5) / tf.cast(height, tf.float32)
    cols = (tf.range(width, dtype=tf.float32) + 0.5) / tf.cast(width, tf.float32)
    in_rows = (rows[None, :] >= box[:, 0:1]) & (rows[None, :] < box[:, 2:3])
    in_cols = (cols[None, :] >= box[:, 1:2]) & (cols[None, :] < box[:, 3:4])
    return in_rows[:, :, None] & in_cols[:, None, :]


def _per_example(values: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """``values`` of shape ``[batch]`` reshaped to broadcast against ``like``."""
    shape = tf.concat([tf.shape(values), tf.ones([tf.rank(like) - 1], tf.int32)], 0)
    return tf.reshape(values, shape)
