"""A GAN on small images: a generator from noise, a discriminator, two optimizers.

The generator maps ``features['noise']`` (``datasets.noise.input_fn`` adds it) to an
image in [0, 1]; the discriminator scores images as real or generated. Each has its
own optimizer group and loss (the non-saturating losses of Goodfellow et al., from
logits): the discriminator minimises ``softplus(-D(real)) + softplus(D(fake))``, the
generator ``softplus(-D(fake))``. Both update at every step, or they take turns
(``discriminator_steps``: k discriminator steps, then one generator step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import gin
import keras
import tensorflow as tf

from models.layers import DenseStack
from trainer import Group, Mode, ModelFn, Spec


@gin.configurable
class GAN(ModelFn):
    """Dense generator and discriminator over flattened images.

    Args:
      image_shape: shape of one image, e.g. ``[8, 8, 1]``.
      generator_units: widths of the generator's hidden layers.
      discriminator_units: widths of the discriminator's hidden layers.
      discriminator_steps: None: both update at every step; k: the groups take
        turns, k discriminator steps and then one generator step.
      image_key: the real images' feature.
      noise_key: the noise feature the generator starts from.
    """

    def __init__(
        self,
        image_shape: Sequence[int] = (8, 8, 1),
        generator_units: Sequence[int] = (128, 128),
        discriminator_units: Sequence[int] = (128,),
        discriminator_steps: int | None = None,
        image_key: str = "image",
        noise_key: str = "noise",
    ):
        super().__init__(name="gan")
        self.image_shape = list(image_shape)
        self.image_key, self.noise_key = image_key, noise_key
        self.discriminator_steps = discriminator_steps
        pixels = math.prod(self.image_shape)
        self.generator = keras.Sequential(
            [
                DenseStack(list(generator_units), activation="relu", name="hidden"),
                keras.layers.Dense(pixels, activation="sigmoid", name="pixels"),
            ],
            name="generator",
        )
        self.discriminator = keras.Sequential(
            [
                keras.layers.Flatten(name="flatten"),
                DenseStack(list(discriminator_units), activation="leaky_relu", name="hidden"),
                keras.layers.Dense(1, name="logit"),
            ],
            name="discriminator",
        )

    def optimizer_groups(self) -> dict[str, Group]:
        """The discriminator's variables and the generator's, each with its optimizer."""
        turns = self.discriminator_steps
        return {
            "discriminator": Group(self.discriminator, steps=turns),
            "generator": Group(self.generator, steps=1 if turns else None),
        }

    def __call__(self, features, labels, mode):
        """Generated images; with real ones (TRAIN, EVAL), both losses and D's accuracy."""
        generated = self.generator(features[self.noise_key])
        generated = tf.reshape(generated, [-1, *self.image_shape])
        predictions = {"generated": generated}
        if mode == Mode.PREDICT:
            return Spec(predictions)
        real = tf.cast(self.discriminator(features[self.image_key])[:, 0], tf.float32)
        fake = tf.cast(self.discriminator(generated)[:, 0], tf.float32)
        discriminator_loss = tf.reduce_mean(tf.nn.softplus(-real) + tf.nn.softplus(fake))
        generator_loss = tf.reduce_mean(tf.nn.softplus(-fake))
        return Spec(
            predictions,
            loss={"discriminator": discriminator_loss, "generator": generator_loss},
            metrics={
                "real_accuracy": tf.cast(real > 0, tf.float32),
                "fake_accuracy": tf.cast(fake < 0, tf.float32),
            },
        )


@gin.configurable
class WGANGP(GAN):
    """A Wasserstein GAN with gradient penalty (Gulrajani et al.), by its own train_step.

    The critic scores images (higher for real); it minimises ``D(fake) - D(real) +
    penalty x (|grad D(mix)| - 1)^2`` at points ``mix`` between a real and a generated
    image, which takes gradients of gradients: the step is the model's own
    (``train_step``). The generator minimises ``-D(fake)``. The groups are
    ``discriminator`` (the critic) and ``generator``; with ``discriminator_steps``
    the critic takes k steps per generator step, as the paper's 5.

    Args:
      penalty: the gradient penalty's weight (the paper's 10).
      mix_key: the feature of per-example numbers in [0, 1) placing ``mix`` between
        the real and the generated image (``noise.input_fn.uniform_key``).
      **kwargs: GAN's.
    """

    def __init__(self, penalty: float = 10.0, mix_key: str = "mix", **kwargs: Any):
        super().__init__(**kwargs)
        self.penalty, self.mix_key = penalty, mix_key

    def __call__(self, features, labels, mode):
        """Generated images; with real ones, the critic's and the generator's losses."""
        losses = self._losses(features)
        predictions = {"generated": losses.pop("generated")}
        if mode == Mode.PREDICT:
            return Spec(predictions)
        return Spec(predictions, loss=losses)

    def train_step(self, features, labels, optimizers):
        """Both losses and their gradients; each group's applied by its optimizer."""
        with tf.GradientTape(persistent=True) as tape:
            losses = self._losses(features, penalised=True)
        for group, part in (("discriminator", self.discriminator), ("generator", self.generator)):
            if group in optimizers:  # its turn
                variables = part.trainable_variables
                optimizers[group].apply(tape.gradient(losses[group], variables), variables)
        generated = losses.pop("generated")
        scalars = {"gradient_penalty": losses.pop("gradient_penalty")}
        return Spec({"generated": generated}, loss=losses, scalars=scalars)

    def _losses(self, features, penalised: bool = False) -> dict:
        generated = tf.reshape(self.generator(features[self.noise_key]), [-1, *self.image_shape])
        result = {"generated": generated}
        if self.image_key not in features:
            return result
        real = features[self.image_key]
        real_score = self.discriminator(real)[:, 0]
        fake_score = self.discriminator(generated)[:, 0]
        critic = tf.reduce_mean(fake_score) - tf.reduce_mean(real_score)
        if penalised:
            mix = tf.reshape(features[self.mix_key], [-1, *[1] * len(self.image_shape)])
            between = mix * real + (1.0 - mix) * generated
            with tf.GradientTape() as inner:
                inner.watch(between)
                score = self.discriminator(between)[:, 0]
            slopes = tf.norm(
                tf.reshape(inner.gradient(score, between), [tf.shape(real)[0], -1]), axis=1
            )
            result["gradient_penalty"] = tf.reduce_mean((slopes - 1.0) ** 2)
            critic += self.penalty * result["gradient_penalty"]
        result.update(discriminator=critic, generator=-tf.reduce_mean(fake_score))
        return result
