"""tf.distribute strategies and the devices under them: made once per process, reused.

``make_strategy`` makes ``MirroredStrategy`` over this machine's devices or
``MultiWorkerMirroredStrategy`` over the machines of TF_CONFIG (made before TensorFlow
runs its first op, as it must be); ``choose_devices`` picks the devices, and
``split_cpu`` splits a CPU into logical devices to try multi-device code without GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
from absl import logging

from trainer import errors
from trainer.distributed import cluster, workers
from trainer.errors import UserError

DISTRIBUTIONS = ("auto", "towers", "mirrored", "multi_worker")


def split_cpu(num_devices: int) -> None:
    """Splits the CPU into ``num_devices`` logical devices ``/CPU:0..N-1``.

    For trying multi-device code on a machine without GPUs (tests, CI). Must run
    before TensorFlow initialises its devices, i.e. before the first op.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
    )


def split_cpu_for(num_devices: int | str) -> bool:
    """On a machine without GPUs, splits the CPU for ``num_devices`` > 1 (see ``split_cpu``).

    Returns whether it did: not with GPUs, not for 'auto' or 1, and not once
    TensorFlow has started (``choose_devices`` then says what to do).
    """
    if not isinstance(num_devices, int) or num_devices < 2:
        return False
    if tf.config.list_physical_devices("GPU"):
        return False
    try:
        split_cpu(num_devices)
    except RuntimeError:  # the runtime has started: its devices are fixed
        return False
    return True


def choose_devices(num_devices: int | str = "auto") -> list[str]:
    """The device names to train on.

    ``'auto'`` takes every GPU when there is one, otherwise one CPU. A number takes
    that many GPUs, or logical CPUs when there is no GPU (see ``split_cpu``).
    """
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if num_devices == "auto":
        return gpus or cpus[:1]
    if isinstance(num_devices, str):
        if not num_devices.isdigit():
            raise UserError(f"num_devices must be 'auto' or a number, got {num_devices!r}")
        num_devices = int(num_devices)
    pool = gpus or cpus
    if num_devices < 1:
        raise UserError(f"num_devices must be >= 1, got {num_devices}")
    if num_devices > len(pool):
        kind = f"{len(pool)} GPU(s)" if gpus else f"{len(pool)} CPU device and no GPU"
        split = (
            ""
            if gpus
            else f" (or call trainer.split_cpu({num_devices}) before TensorFlow "
            "starts, as python -m trainer --num_devices does, to try it on logical CPUs)"
        )
        raise UserError(
            f"num_devices={num_devices} but this machine has {kind}: {', '.join(pool)}; "
            f"ask for at most {len(pool)} or use 'auto'{split}"
        )
    return pool[:num_devices]


_mirrored: dict[tuple, tf.distribute.MirroredStrategy] = {}
_multi_worker: tf.distribute.Strategy | None = None
_cluster: cluster.Cluster | None = None  # the one _multi_worker was made over


def make_strategy(
    distribution: str, devices: Sequence[str], startup_timeout: float = cluster.STARTUP_TIMEOUT
) -> tf.distribute.Strategy:
    """MirroredStrategy over ``devices``, or MultiWorkerMirroredStrategy from TF_CONFIG.

    The multi-worker strategy must exist before TensorFlow runs its first op (it
    configures the runtime's collectives); it is made once per process and reused.
    The CLI makes it first thing; a program of your own should call
    ``make_strategy('multi_worker', [])`` at its start. It waits up to
    ``Devices.startup_timeout`` seconds for every worker to join (``cluster.join``).
    """
    global _multi_worker, _cluster
    if distribution == "mirrored":
        # One per set of devices and process: a second MirroredStrategy numbers its
        # collectives from the same keys as the first, and TensorFlow's process-wide
        # collective executor then fails any whose shapes or types differ ("Shape
        # mismatch in the collective instance 101"): a sweep's second trial, say.
        if tuple(devices) not in _mirrored:
            _mirrored[tuple(devices)] = tf.distribute.MirroredStrategy(list(devices))
        return _mirrored[tuple(devices)]
    if distribution != "multi_worker":
        raise UserError(
            f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}"
        )
    if _multi_worker is None:
        errors.check_seconds("Devices.startup_timeout", startup_timeout)
        found = cluster.find()
        logging.info("Joining the cluster as %s (%s); waiting for every worker", *found.where)
        try:
            _multi_worker = cluster.join(
                tf.distribute.MultiWorkerMirroredStrategy, startup_timeout, found
            )
        except tf.errors.UnknownError as error:
            if "Could not start gRPC server" not in str(error):
                raise
            raise UserError(
                f"could not listen on {found.address}, {found.name}'s address in TF_CONFIG: "
                "is another worker using the same task index, or another program the same port?"
            ) from None
        except RuntimeError as error:
            if "program startup" not in str(error):
                raise
            raise UserError(
                "the 'multi_worker' strategy must be made before TensorFlow runs any op: "
                "call trainer.make_strategy('multi_worker', []) at the start of "
                "the program (python -m trainer does)"
            ) from None
        _cluster = found
        workers.check_same_cluster(found)
    return _multi_worker


def multi_worker_started() -> bool:
    """Whether this process joined a multi-worker cluster (``make_strategy``)."""
    return _multi_worker is not None


def joined_cluster() -> cluster.Cluster:
    """The cluster this process joined (``make_strategy('multi_worker', ...)``)."""
    if _cluster is None:
        raise RuntimeError("no multi-worker cluster was joined: make_strategy first")
    return _cluster


def worker_name(strategy: tf.distribute.Strategy | None) -> str | None:
    """None for the chief (or a single process), else this worker's name (``worker_1``).

    The chief is the task of type ``chief``, or worker 0 when the cluster has none.
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return None
    task_type, task_id = resolver.task_type, resolver.task_id or 0
    if task_type == "chief":
        return None
    if task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().jobs:
        return None
    return f"{task_type}_{task_id}"
