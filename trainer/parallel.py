"""Training on several devices: towers (``make_parallel``) and tf.distribute strategies.

Towers are the Effective TensorFlow recipe brought to TF2: each batch is split along
its first dimension into one shard per device, the model runs forward *and* backward
on each device (the gradient is taken inside the tower's ``tf.device`` scope, the TF2
form of ``colocate_gradients_with_ops=True``), and the gradients are averaged with
weights proportional to the shard sizes, so the update equals the single-device one.
Variables are shared by construction: every tower calls the same Keras layers.

For scale-out the Estimator uses tf.distribute instead (``mirrored``,
``multi_worker``); this module picks the devices and builds the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf
from absl import logging

from trainer import batch_statistics, cluster, errors, workers
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
            else f" (or call trainer.parallel.split_cpu({num_devices}) before TensorFlow "
            "starts, as python -m trainer --num_devices does, to try it on logical CPUs)"
        )
        raise UserError(
            f"num_devices={num_devices} but this machine has {kind}: {', '.join(pool)}; "
            f"ask for at most {len(pool)} or use 'auto'{split}"
        )
    return pool[:num_devices]


def shard_sizes(batch_size: tf.Tensor, num_shards: int) -> tf.Tensor:
    """Sizes of ``num_shards`` near-equal shards of a batch: they differ by at most one."""
    batch_size = tf.cast(batch_size, tf.int32)
    base, extra = batch_size // num_shards, batch_size % num_shards
    return base + tf.cast(tf.range(num_shards) < extra, tf.int32)


def split(structure, num_shards: int) -> tuple[list, tf.Tensor]:
    """Splits every tensor of a nested structure along its first dimension.

    Returns:
      ``num_shards`` structures like ``structure``, and the shard sizes (int32 [n]).
      A batch that does not divide evenly gives shards one example apart; a batch
      smaller than ``num_shards`` gives some empty shards. A scalar (a batch-wide
      value such as ``Weighted.mean_weight``) is given to every shard as it is.
    """
    flat = tf.nest.flatten(structure)  # None (no labels) is a leaf, and stays None
    first = next(t for t in flat if t is not None and t.shape.rank)
    sizes = shard_sizes(tf.shape(first)[0], num_shards)
    pieces = [
        [t] * num_shards  # None (no labels), or a scalar every shard takes as it is
        if t is None or t.shape.rank == 0
        else tf.split(t, sizes, num=num_shards)
        for t in flat
    ]
    shards = [
        tf.nest.pack_sequence_as(structure, [p[i] for p in pieces]) for i in range(num_shards)
    ]
    return shards, sizes


def make_parallel(fn: Callable, devices: Sequence[str], **kwargs):
    """Runs ``fn(**shard)`` on each device on its shard of ``kwargs``; concatenates outputs.

    Every keyword argument (a tensor or nested structure of tensors) is split along
    the batch; ``fn`` must return a tensor or a nested structure of tensors whose
    first dimension is the shard's batch. Variables ``fn`` uses are shared.
    """
    shards, _ = split(kwargs, len(devices))
    outputs = []
    for i, (device, shard) in enumerate(zip(devices, shards, strict=True)):
        with tf.device(device), tf.name_scope(f"tower_{i}"):
            outputs.append(fn(**shard))
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)


class Towers:
    """One batch's forward and backward passes spread over ``devices``.

    Args:
      devices: one tower per device.
      state: the non-trainable state a training pass updates
        (``batch_statistics.Parts``): each tower starts from the same values and
        the towers leave what one pass over the whole batch would, so batch-norm
        statistics cover the whole batch rather than one tower's shard.
    """

    def __init__(self, devices: Sequence[str], state: batch_statistics.Parts | None = None):
        self.devices = list(devices)
        self.state = state if state is not None else batch_statistics.Parts([])

    def run(self, fn: Callable, features, labels, *args, training: bool = True):
        """Runs ``fn(features, labels, *args) -> (loss, scalars, per_example, gradients)``.

        Each tower runs ``fn`` on its shard of the batch inside its device's scope, so
        the gradients ``fn`` takes are computed on the tower's own device (TF1's
        ``colocate_gradients_with_ops``). ``loss`` is a shard's mean loss (or a dict of
        them); ``gradients`` its gradients (nested, None entries allowed) or None.
        Returns the batch's ``(loss, scalars, per_example, gradients)``: loss, scalars
        and gradients averaged weighted by shard size (an empty shard counts zero, not
        NaN), per-example values concatenated in batch order. ``training=False``
        (evaluation) leaves ``state`` alone.
        """
        shards, sizes = split((features, labels), len(self.devices))
        weights = tf.cast(sizes, tf.float32) / tf.cast(tf.reduce_sum(sizes), tf.float32)
        state = self.state if training else batch_statistics.Parts([])
        start, sums = state.start(), state.zeros()
        towers = []
        for i, (device, (shard_features, shard_labels)) in enumerate(
            zip(self.devices, shards, strict=True)
        ):
            with tf.device(device), tf.name_scope(f"tower_{i}"):
                loss, scalars, per_example, grads = fn(shard_features, shard_labels, *args)
                grads = tf.nest.map_structure(lambda g, i=i: _weighted(g, weights[i]), grads)
                sums = state.add(sums, start, weights[i])
            state.reset(start)  # the next tower starts from the same statistics
            towers.append((loss, scalars, per_example, grads))
        state.finish(sums, start)
        losses, scalars, per_example, grads = zip(*towers, strict=True)
        average = lambda *values: _weighted_sum(values, weights)  # noqa: E731
        return (
            tf.nest.map_structure(average, *losses),
            tf.nest.map_structure(average, *scalars),
            tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *per_example),
            tf.nest.map_structure(lambda *g: None if g[0] is None else tf.add_n(list(g)), *grads),
        )


def _weighted(value: tf.Tensor | None, weight: tf.Tensor) -> tf.Tensor | None:
    """``value * weight``, where a zero weight gives zero even for a NaN value."""
    if value is None:
        return None
    return tf.math.multiply_no_nan(value, tf.cast(weight, value.dtype))


def _weighted_sum(values: Sequence[tf.Tensor], weights: tf.Tensor) -> tf.Tensor:
    return tf.add_n([_weighted(v, weights[i]) for i, v in enumerate(values)])


# ---------------------------------------------------------------- tf.distribute


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
    ``startup_timeout`` seconds for every worker to join (``cluster.join``).
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
        errors.check_seconds("Estimator.startup_timeout", startup_timeout)
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
                "call trainer.parallel.make_strategy('multi_worker', []) at the start of "
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
