"""Research models trained under several device set-ups in one process (tests/test_groups.py).

Run through ``tests.support.helpers.on_two_cpus``: the CPU is split into two logical devices
before TensorFlow starts.
"""

import json
import sys

if __name__ == "__main__":  # a worker: the strategy before any op runs
    import lean_start  # noqa: F401 - TensorFlow loads as the command line loads it

    from trainer.distributed import strategies

    strategies.make_strategy("multi_worker", [])

import keras  # noqa: E402

import datasets.digits  # noqa: E402
import datasets.noise  # noqa: E402
from models.gan import GAN, WGANGP  # noqa: E402
from trainer import Estimator  # noqa: E402
from trainer.settings import Devices, Optimization

SETUPS = {"one": ("towers", 1), "towers": ("towers", 2), "mirrored": ("mirrored", 2)}


def gan_on_devices(out_dir: str, data_dir: str, kind: str = "gan") -> dict:
    """``train_gan`` on one device, on two towers and on two mirrored replicas."""
    return {
        name: train_gan(f"{out_dir}/{name}", data_dir, kind, distribution, devices)
        for name, (distribution, devices) in SETUPS.items()
    }


def train_gan(model_dir, data_dir, kind="gan", distribution="towers", devices=1) -> dict:
    """A GAN taking turns (2 discriminator steps, 1 generator step) for 30 steps.

    ``kind`` 'gan': the GAN, clipped to a global norm of 1; 'wgan': WGAN-GP, through
    its own train_step (a gradient penalty). Returns its weights, each optimizer's
    iteration count and its evaluation.
    """
    keras.utils.set_random_seed(0)
    model_class = GAN if kind == "gan" else WGANGP
    estimator = Estimator(
        model_class(generator_units=[32], discriminator_units=[32], discriminator_steps=2),
        model_dir,
        optimizer={
            "generator": keras.optimizers.Adam(1e-3, beta_1=0.5),
            "discriminator": keras.optimizers.Adam(4e-4, beta_1=0.5),
        },
        global_batch_size=32,
        steps_per_loop=10,
        optimization=Optimization(clip_gradient_norm=1.0 if kind == "gan" else None),
        devices=Devices(distribution=distribution, count=devices),
        seed=0,
        progress=False,
    )

    def digits(mode, params):
        return datasets.digits.input_fn(mode, params, data_dir=data_dir)

    def input_fn(mode, params):
        return datasets.noise.input_fn(mode, params, input_fn=digits, dim=8, uniform_key="mix")

    estimator.train(input_fn, 30)
    metrics = estimator.evaluate(input_fn)
    model = estimator.model_fn
    return {
        "generator": [w.numpy().tolist() for w in model.generator.weights],
        "discriminator": [w.numpy().tolist() for w in model.discriminator.weights],
        "iterations": {g: int(o.iterations.numpy()) for g, o in estimator.optimizer.items()},
        "metrics": metrics,
    }


# One of several workers: python tests/support/research_runs.py DIR DATA KIND
if __name__ == "__main__":
    print(json.dumps(train_gan(*sys.argv[1:4], distribution="multi_worker", devices="auto")))
