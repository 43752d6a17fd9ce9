"""Where training runs: the devices of this worker and how they share a step.

``Placement`` is the one object that knows the kind of distribution. The rest of the
framework asks it: which scope variables are made in, how big a batch one input
pipeline yields, how the training input is iterated, which directory this worker
writes. Three kinds (``Devices.distribution``; ``'auto'``, the default, is
all-reduce over several GPUs and towers otherwise: ``devices.choose``):

* ``'towers'``: one process splits each batch over its devices (``towers.Towers``),
  or runs on its one device;
* ``'mirrored'``: ``tf.distribute.MirroredStrategy`` over this machine's devices;
* ``'multi_worker'``: ``MultiWorkerMirroredStrategy`` over the machines in TF_CONFIG
  (each machine's GPUs, or its CPU); the chief writes checkpoints and summaries,
  which every worker restores (``trainer/distributed/workers.py``).

Towers may split a batch unevenly (shards differ by one example; gradients are
averaged weighted by shard size). Under both strategies ``global_batch_size`` must
divide evenly over the replicas; evaluation is split over every replica and worker
(``eval_input``), prediction runs on each worker's first device.
A positioned input resumes at its position on any number of devices; any other is
resumed by skipping the batches already trained on (TF cannot checkpoint a
distributed iterator). ``Devices.prefetch`` applies to one device only:
strategies prefetch to their replicas themselves, towers copy each shard in the
step, and jit_compile reads a block's batches before the block.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf
from absl import logging

from trainer import batch_statistics, errors, internals, optimization
from trainer.distributed import devices, strategies, towers, workers
from trainer.errors import UserError
from trainer.model_fn import InputParams, Mode, ModelFn, blank_element, is_positioned
from trainer.settings import Devices


class Placement:
    """The devices of this worker, the strategy over them (None for towers), and checks.

    Args:
      settings: the Estimator's ``Devices``: distribution, device count, precision, XLA,
        prefetching, timeouts. What only some placements can run is refused here,
        before anything is built; the steps and the loop read the rest from here.
      global_batch_size: examples per step over all devices and workers.
    """

    def __init__(self, settings: Devices, global_batch_size: int):
        self.settings = settings
        self.strategy, self.devices, distribution = devices.strategy_and_devices(
            settings.distribution, settings.count, global_batch_size, settings.startup_timeout
        )
        self.distribution = distribution
        self.num_replicas = (
            self.strategy.num_replicas_in_sync if self.strategy else len(self.devices)
        )
        devices.check(distribution, self.num_replicas, global_batch_size, settings.jit_compile)
        self.prefetch_device = devices.prefetch_device(
            settings.prefetch, self.devices, distribution, settings.jit_compile
        )
        # The chief (or a single process) is None; other workers are 'worker_1', ...
        self.worker = strategies.worker_name(self.strategy)
        # What a run of several workers needs (one process answers it alone).
        self.workers = (
            workers.Workers(self.strategy, self.worker, strategies.joined_cluster())
            if distribution == "multi_worker"
            else workers.OneProcess()
        )

    @property
    def description(self) -> str:
        """Where training runs, for the start line: ``'2 devices (CPU:0, CPU:1), towers'``."""
        names = ", ".join(str(d).split("device:")[-1] for d in self.devices)
        where = f"{len(self.devices)} device{'s' * (len(self.devices) > 1)} ({names})"
        if self.strategy is None:
            return where if len(self.devices) == 1 else f"{where}, towers"
        return f"{where}, {self.distribution} over {self.num_replicas} replicas"

    @property
    def per_replica(self) -> bool:
        """Whether the step runs in several replicas, each keeping its own metric sums."""
        return self.strategy is not None

    def towers(self, model_fn: ModelFn) -> towers.Towers | None:
        """Towers over this process's devices when it has several (no strategy), else None."""
        if self.strategy is None and len(self.devices) > 1:
            return towers.Towers(self.devices, batch_statistics.parts_of(model_fn))
        return None

    def update_fn(self, optimizer: keras.optimizers.Optimizer) -> Callable:
        """``update(gradients, variables)``: the optimizer's step.

        Fused kernels in one process; under a strategy Keras's ``apply_gradients``, told
        not to sum the replicas' gradients (Keras 2's ``skip_gradients_aggregation``):
        the step has summed them already (``sum_gradients``), to clip and measure the
        summed gradient's norm.
        """
        if self.strategy is None:
            return optimization.fused_update(optimizer)
        internals.skip_gradient_summing(optimizer)

        def update(gradients, variables):
            optimization.keras_update(optimizer, gradients, variables)

        return update

    @tf.autograph.experimental.do_not_convert
    def sum_gradients(self, gradients: list) -> list:
        """Under a strategy, every replica's gradients summed (one all-reduce); else as given.

        A sparse gradient (an embedding's ``IndexedSlices``, a row per lookup) is
        gathered, every replica's rows, when their number is known when traced (batches
        of one shape); else it is summed as the dense gradient it stands for, as
        Horovod's ``sparse_as_dense`` does. Rows that vary in number from one step to
        the next (batches of text padded to their length) would make a collective whose
        shape changes inside the loop of steps, which TensorFlow 2.21 fails ("Shape
        mismatch in the collective instance"). Dense, its cost is the embedding's size,
        as every other weight's is; gathered, the lookups' rows.
        """
        if self.strategy is None:
            return gradients
        dense = [_summable(g) for g in gradients]
        return tf.distribute.get_replica_context().all_reduce("sum", dense)

    @tf.autograph.experimental.do_not_convert
    def run(self, step: Callable, args: tuple) -> tf.Tensor:
        """``step(*args)``, in every replica under a strategy; returns the first's result."""
        if self.strategy is None:
            return step(*args)
        first = lambda value: self.strategy.experimental_local_results(value)[0]  # noqa: E731
        return tf.nest.map_structure(first, self.strategy.run(step, args=args))

    def total(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each scalar summed over a strategy's replicas (one all-reduce); else as given."""
        if self.strategy is None:
            return values
        return tf.distribute.get_replica_context().all_reduce("sum", values)

    @tf.autograph.experimental.do_not_convert
    def replica_share(self, examples: tf.Tensor) -> tuple[tf.Tensor | float, int]:
        """This replica's share of the global batch's examples, and the replica count.

        Outside a strategy a step sees the whole batch: ``(1.0, 1)``.
        """
        if self.strategy is None:
            return 1.0, 1
        context = tf.distribute.get_replica_context()
        share = tf.cast(examples / context.all_reduce("sum", examples), tf.float32)
        return share, context.num_replicas_in_sync

    @tf.autograph.experimental.do_not_convert
    def all_finite(self, finite: tf.Tensor) -> tf.Tensor:
        """Whether the step was finite in every replica (``finite`` is this one's)."""
        if self.strategy is None:
            return finite
        context = tf.distribute.get_replica_context()
        return context.all_reduce("sum", 1 - tf.cast(finite, tf.int32)) == 0

    def scope(self):
        """The strategy's scope, where variables must be created; or no scope."""
        return self.strategy.scope() if self.strategy else contextlib.nullcontext()

    def adopt(self, optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
        """The optimizer, made again inside the strategy's scope if there is one."""
        if self.strategy is None:
            return optimizer
        custom = internals.schedule_classes(optimizer)  # a schedule Keras may not know
        try:
            with self.strategy.scope():
                return type(optimizer).from_config(optimizer.get_config(), custom)
        except (TypeError, ValueError, NotImplementedError) as error:
            raise UserError(
                f"cannot rebuild the optimizer {type(optimizer).__name__} for a tf.distribute "
                f"strategy from its get_config(): {errors.first_line(error)}"
            ) from None

    def create_variables(self, model_fn: ModelFn, features_spec, labels_spec=None) -> None:
        """Under a strategy, makes the model's variables eagerly; elsewhere tracing does.

        Mirrored variables cannot be created inside a traced function. With labels the
        model is called in EVAL (a GAN's discriminator is used only then), without
        them in PREDICT; neither moves batch-norm statistics.
        """
        if self.strategy is None:
            return

        # A Keras model built before it reached the Estimator (a compiled Keras model)
        # holds plain variables: made again in the scope, values kept, so that the
        # user's model object holds the trained weights afterwards.
        self._adopt(model_fn.trainable_variables + model_fn.non_trainable_variables)
        features, labels = blank_element(features_spec, labels_spec)
        with self.scope():
            if labels is None:
                model_fn(features, None, Mode.PREDICT)
            else:
                model_fn(features, labels, Mode.EVAL)

    def adopt_metrics(self, metrics) -> None:
        """Under a strategy, makes Keras metrics' state per replica (see ``_adopt``).

        A metric made outside the strategy's scope (in a ModelFn's ``__init__``) then
        keeps a state on each replica, which reading adds up over all of them.
        """
        if self.strategy is not None:
            self._adopt([v for metric in metrics for v in metric.variables])

    def _adopt(self, variables) -> None:
        """Each Keras variable made outside the strategy's scope, made again in it."""
        with self.scope():
            for variable in variables:
                if internals.variable_made_outside(variable, self.strategy):
                    internals.make_again(variable)

    def pipeline_batch(self, batch_size: int, mode: Mode) -> int:
        """The batch one input pipeline yields in ``mode``.

        Under a strategy a training pipeline yields a replica's share; towers split
        whole batches themselves.
        """
        if mode == Mode.TRAIN and self.strategy is not None:
            return batch_size // self.num_replicas
        return batch_size

    def eval_input(self, dataset: tf.data.Dataset):
        """The eval batches, under a strategy split over every replica and worker.

        Each worker keeps every W-th batch (sharding by data: any input_fn works), and
        each batch is split over the worker's replicas; a last partial batch leaves
        some replicas an empty share, and workers without a batch wait for the others
        (``tf.distribute``'s own handling), so every example counts once.
        """
        if self.strategy is None:
            return dataset
        # Iterating it in a tf.function makes TF read its options in graph mode, which
        # warns that they might not be the ones set: they are (set here, not traced).
        warnings.filterwarnings("ignore", "To make it possible to preserve tf.data options")
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        return self.strategy.experimental_distribute_dataset(dataset.with_options(options))

    def saved_iterator(self, dataset: tf.data.Dataset):
        """An iterator a checkpoint can hold, made before restoring.

        None under a strategy: TF cannot checkpoint a distributed iterator, which
        ``train_iterator`` makes after restoring.
        """
        return iter(dataset) if self.strategy is None else None

    def train_iterator(
        self, build: Callable[[InputParams], tf.data.Dataset], params: InputParams, step: int
    ):
        """An iterator over the training input that starts at ``params.start_example``.

        On one device or towers: ``build(params)``. Under a strategy: one pipeline
        per worker, each told its id and a replica's batch; a positioned dataset
        starts at its position, any other skips the batches of the ``step`` steps
        already trained on (the input must be seeded to continue exactly).
        """
        if self.strategy is None:
            return iter(build(params))
        skipping = []

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            share = _Watched(
                **{
                    **vars(params),
                    "batch_size": context.get_per_replica_batch_size(params.global_batch_size),
                    "num_input_pipelines": context.num_input_pipelines,
                    "input_pipeline_id": context.input_pipeline_id,
                }
            )
            dataset = build(share)
            positioned = is_positioned(dataset)
            if context.num_input_pipelines > 1 and not share.shared_out:
                dataset, positioned = _shared_out(dataset, context), False  # a share of it
            if positioned or not step:
                return dataset
            skipping.append(step)
            per_step = context.num_replicas_in_sync // context.num_input_pipelines
            return dataset.skip(step * per_step)

        distributed = self.strategy.distribute_datasets_from_function(dataset_fn)
        if skipping:
            logging.info("Skipping the input of the %d steps already trained", step)
        return iter(distributed)


class _Watched(InputParams):
    """InputParams that note whether the input_fn asked which pipeline it is."""

    def __getattribute__(self, name: str):
        if name in ("num_input_pipelines", "input_pipeline_id"):
            object.__setattr__(self, "_asked", True)  # the dataclass is frozen
        return super().__getattribute__(name)

    @property
    def shared_out(self) -> bool:
        """Whether the input_fn read ``input_pipeline_id`` or ``num_input_pipelines``."""
        return self.__dict__.get("_asked", False)


def _shared_out(dataset: tf.data.Dataset, context: tf.distribute.InputContext):
    """Worker i of n takes every n-th batch of an input_fn that does not shard itself.

    Every worker builds the same stream (seeded by ``params.seed``), so the shares are
    disjoint and a step reads what one process reads at the same global batch, as
    tf.distribute's auto-sharding by data would.
    """
    count, index = context.num_input_pipelines, context.input_pipeline_id
    if index == 0 and "shared_out" not in _WARNED:
        _WARNED.add("shared_out")
        logging.info(
            "The input_fn does not read params.input_pipeline_id: each of the %d workers "
            "takes every %d-th of its batches (seed its shuffle with params.seed so that "
            "every worker builds the same order), or read by index: datasets.pipeline.build "
            "over an ArraySource",
            count,
            count,
        )
    return dataset.shard(count, index)


_WARNED: set[str] = set()


def _summable(gradient):
    """``gradient``, dense if it is sparse with a number of rows unknown when traced."""
    if isinstance(gradient, tf.IndexedSlices) and gradient.indices.shape[0] is None:
        return tf.convert_to_tensor(gradient)
    return gradient
