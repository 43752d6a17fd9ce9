"""Which devices a run uses and how they share a step, decided before anything is built.

``Placement`` (``placement.py``) asks here: the strategy and devices for
``Devices.distribution`` and ``num_devices`` (``'auto'`` chosen by ``choose``), the
settings those devices cannot run refused in one line (``check``), and the device
each batch is prefetched to.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
from absl import logging

from trainer.distributed import strategies
from trainer.errors import UserError


def strategy_and_devices(
    distribution: str, num_devices: int | str, global_batch_size: int, startup_timeout: float
) -> tuple[tf.distribute.Strategy | None, list[str], str]:
    """The strategy (None for towers), the devices of this worker, and the distribution."""
    if distribution == "multi_worker":
        if num_devices != "auto":
            raise UserError(
                "distribution 'multi_worker' uses every GPU of each machine (or its CPU); "
                "leave Devices.count 'auto' and limit GPUs with CUDA_VISIBLE_DEVICES"
            )
        # Created before anything else touches TensorFlow's runtime, as it must be.
        strategy = strategies.make_strategy(distribution, [], startup_timeout)
        return strategy, list(strategy.extended.worker_devices), distribution
    if distribution not in strategies.DISTRIBUTIONS:
        raise UserError(
            f"Devices.distribution must be one of {', '.join(strategies.DISTRIBUTIONS)}, "
            f"got {distribution!r}"
        )
    devices = strategies.choose_devices(num_devices)
    distribution = choose(distribution, devices, global_batch_size)
    if distribution == "towers":
        return None, devices, distribution
    return strategies.make_strategy(distribution, devices), devices, distribution


def choose(distribution: str, devices: Sequence[str], global_batch_size: int) -> str:
    """What ``'auto'`` means on these devices: all-reduce over GPUs, else towers.

    Over n GPUs towers bring every gradient to the first one and the variables back:
    its link carries (n - 1) x the gradient each way per step, against 2 (n - 1) / n
    for MirroredStrategy's all-reduce (4x less at 8 GPUs; see docs/guide/parallel.md,
    "What a step costs on many GPUs"). Towers stay for one device, for logical CPU devices (which
    share one memory, and where towers cost less: benchmarks/devices.py), and for a
    global batch that does not divide over the GPUs (towers split it unevenly).
    """
    if distribution != "auto":
        return distribution
    gpus = all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices)
    if len(devices) < 2 or not gpus:
        return "towers"
    if global_batch_size % len(devices) == 0:
        return "mirrored"
    logging.info(
        "Global batch %d does not divide over %d GPUs: towers, which split it unevenly, "
        "instead of all-reduce (mirrored), which would move less per step",
        global_batch_size,
        len(devices),
    )
    return "towers"


def check(
    distribution: str,
    replicas: int,
    global_batch_size: int,
    jit_compile: bool,
) -> None:
    """Refuses settings the chosen devices cannot run, before anything is built."""
    if global_batch_size < replicas:
        raise UserError(
            f"Estimator.global_batch_size {global_batch_size} is smaller than the "
            f"{replicas} devices it is split over: raise it or use fewer devices"
        )
    if jit_compile and (replicas > 1 or distribution != "towers"):
        raise UserError(
            "Devices.jit_compile compiles the step for a single device: turn it off "
            f"for {distribution!r} on {replicas} device(s)"
        )
    if distribution == "towers":
        return
    if global_batch_size % replicas:
        raise UserError(
            f"Estimator.global_batch_size {global_batch_size} does not divide over the "
            f"{replicas} replicas of {distribution!r}: use a multiple of {replicas}, or "
            "distribution 'towers', which splits batches unevenly"
        )


def prefetch_device(
    prefetch_to_device: bool | None, devices: Sequence[str], distribution: str, jit_compile: bool
) -> str | None:
    """The device each batch is copied to while the step before it runs, or None."""
    single = distribution == "towers" and len(devices) == 1 and not jit_compile
    if prefetch_to_device is None:  # on wherever it applies: a GPU hides the copy, a CPU the read
        return devices[0] if single else None
    if prefetch_to_device and not single:
        count = f"{len(devices)} device" + ("s" if len(devices) > 1 else "")
        setting = "jit_compile" if jit_compile else f"distribution {distribution!r} on {count}"
        raise UserError(
            f"Devices.prefetch applies to one device without jit_compile, not "
            f"{setting}: strategies prefetch to their replicas themselves, towers copy each "
            "shard in the step, and jit_compile reads a block's batches before the block; "
            "leave it None"
        )
    return devices[0] if prefetch_to_device else None
