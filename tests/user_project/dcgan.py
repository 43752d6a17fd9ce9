"""keras.io's "DCGAN overriding train_step", as a Keras user writes it, sized for 8x8 digits.

The class is the example's (fchollet, keras.io/examples/generative/dcgan_overriding_train_step),
with one change: the noise added to the labels is drawn from the model's seed
generator (``keras.random.uniform``) rather than by ``tf.random.uniform``, whose
unseeded draws differ from one compiled function to another, so that ``fit`` and
the framework can be compared draw for draw. ``make()`` builds and compiles it.
"""

import keras
import tensorflow as tf
from keras import layers, ops

LATENT_DIM = 8


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        # Sample random points in the latent space
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        # Decode them to fake images
        generated_images = self.generator(random_latent_vectors)
        # Combine them with real images
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        # Assemble labels discriminating real from fake images
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        # Add random noise to the labels - important trick!
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)
        # Train the discriminator
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))  # noqa: B905
        # Sample random points in the latent space
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        # Assemble labels that say "all real images"
        misleading_labels = ops.zeros((batch_size, 1))
        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))  # noqa: B905
        # Update metrics
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def make(seed: int = 0) -> GAN:
    """The GAN on 8x8x1 images, compiled as the example compiles it."""
    keras.utils.set_random_seed(seed)
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            layers.Conv2D(16, kernel_size=3, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(32, kernel_size=3, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dropout(0.2),
            layers.Dense(1, activation="sigmoid"),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(LATENT_DIM,)),
            layers.Dense(2 * 2 * 32),
            layers.Reshape((2, 2, 32)),
            layers.Conv2DTranspose(32, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(16, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, kernel_size=3, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT_DIM)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
        loss_fn=keras.losses.BinaryCrossentropy(),
    )
    return gan
