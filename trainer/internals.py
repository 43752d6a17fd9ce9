"""Every private TensorFlow, Keras and gin name the framework relies on, in one place.

Each is used where no public API does the job, says why, and has a test in
``tests/test_internals.py`` that fails, naming it, when an upgrade removes or
changes it (gin-config 0.5 has no public listing of its configurables, bindings,
file readers or include paths). The one whose loss would be silent (the
optimizer's own summing of the replicas' gradients, which would then sum them
twice) raises here instead.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Mapping

import gin
import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext

# ---------------------------------------------------------------- Keras


def skip_gradient_summing(optimizer: keras.optimizers.Optimizer) -> None:
    """Under a strategy, ``apply_gradients`` takes the gradients as already summed.

    Keras 3 has no public switch (Keras 2's ``skip_gradients_aggregation``); the step
    sums them itself to clip and measure the summed gradient (``step.Steps._apply``).
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # under loss scaling
    if not callable(getattr(inner, "_all_reduce_sum_gradients", None)):
        raise RuntimeError(
            f"Keras {keras.__version__}'s {type(inner).__name__} has no "
            "_all_reduce_sum_gradients: the replicas' gradients would be summed twice; "
            "see trainer/internals.py"
        )
    inner._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)


def keras_mask(tensor) -> tf.Tensor | None:
    """The mask a Keras layer set on its output (``Embedding(mask_zero=True)``), or None.

    Keras 3 keeps it on the tensor and reads it with a private function; its losses and
    metrics weight each position by it (``fit``'s token mean).
    """
    from keras.src import backend

    return backend.get_keras_mask(tensor)


def sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """``layer`` and every layer inside it, at any depth, each once."""
    return layer._flatten_layers(include_self=True, recursive=True)


def stored_kernel(layer: keras.layers.Dense):
    """A Dense layer's kernel variable as stored, without its LoRA adapters.

    Its ``kernel`` property adds them once ``enable_lora`` has made them.
    """
    return layer._kernel


def own_variables(layer: keras.layers.Layer) -> list:
    """The variables ``layer`` itself made (``add_weight``), not its sublayers'.

    ``layer.weights`` adds every sublayer's: a model whose call updates a variable of
    its own is told apart from one whose layers are all frozen (``model_state``).
    """
    return [*layer._trainable_variables, *layer._non_trainable_variables]


def own_losses(layer: keras.layers.Layer) -> list:
    """The values ``layer`` itself added with ``add_loss`` (activity regularizers too).

    ``layer.losses`` adds its sublayers' and its weights' regularizers: a layer held
    twice (alone and inside a model) would count them twice (``layer_losses``).
    """
    return layer._get_own_losses()


def clear_losses(layer: keras.layers.Layer) -> None:
    """Forgets the ``add_loss`` values of ``layer``'s last call (and its sublayers')."""
    layer._clear_losses()


@contextlib.contextmanager
def one_keras_call():
    """Keras layers called inside keep every ``add_loss`` value, as inside one model.

    Keras clears a layer's added losses when it is called from outside any layer (the
    outermost call): a layer a ModelFn calls twice would keep its last call's only. A
    call context whose entry is no layer keeps them all, as a functional model's does.
    """
    outer = global_state.get_global_attribute("current_call_ctx")
    if outer is None:
        global_state.set_global_attribute("current_call_ctx", CallContext(entry_layer=None))
    try:
        yield
    finally:
        if outer is None:
            global_state.set_global_attribute("current_call_ctx", None)


def compile_arguments(model: keras.Model) -> dict:
    """What ``model.compile`` was given: the objects themselves, custom functions too."""
    return dict(model._compile_config.config)


def schedule_classes(optimizer: keras.optimizers.Optimizer) -> dict[str, type]:
    """``{name: class}`` of the optimizer's learning-rate schedule, if it has one.

    What ``from_config`` needs to find a schedule class Keras has not registered (a
    user's, or ``WarmupDecay``). Keras's ``learning_rate`` property gives the current
    value, not the schedule.
    """
    schedule = optimizer._learning_rate
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return {type(schedule).__name__: type(schedule)}
    return {}


def mean_metric_function(metric: keras.metrics.MeanMetricWrapper) -> Callable:
    """``fn(y_true, y_pred)``: the per-example function a Keras mean metric averages."""
    fn, kwargs = metric._fn, metric._fn_kwargs
    return lambda y, p: fn(y, p, **kwargs)


def metric_direction(metric: keras.metrics.Metric) -> str:
    """``'up'`` or ``'down'``: which way a Keras metric gets better.

    Keras reads it (``Metric._direction``) to choose a monitor's ``mode='auto'``; it
    has no public getter. AttributeError when the object does not say.
    """
    return metric._direction


def set_monitor_op(callback: keras.callbacks.Callback) -> None:
    """Makes EarlyStopping or ReduceLROnPlateau take its comparison from its mode now.

    Keras does it at the first epoch's end (``MonitorCallback._set_monitor_op``).
    """
    callback._set_monitor_op()


def takes_dict_inputs(model: keras.Model) -> bool:
    """Whether a functional model was built on a dict of inputs (called with a dict)."""
    return isinstance(getattr(model, "_inputs_struct", None), Mapping)


def variable_made_outside(variable, strategy: tf.distribute.Strategy) -> bool:
    """Whether a Keras variable's ``tf.Variable`` was made outside ``strategy``'s scope."""
    inner = getattr(variable, "_value", None)  # Keras 3's tf.Variable within
    return inner is not None and not strategy.extended.variable_created_in_scope(inner)


def make_again(variable) -> None:
    """Makes a Keras variable's ``tf.Variable`` anew, in the current scope, same value."""
    variable._initialize(variable.numpy())


def slot_index(optimizer: keras.optimizers.Optimizer, variable) -> int:
    """Where ``variable``'s slots are in the optimizer's slot lists (``adam_slots``)."""
    return optimizer._get_variable_index(variable)


def adam_slots(optimizer: keras.optimizers.Adam, index: int) -> tuple:
    """Adam's first and second moments of the variable at ``index``."""
    return optimizer._momentums[index], optimizer._velocities[index]


def copy_keras_variables_again() -> None:
    """Lets TensorFlow's async checkpointing copy a Keras variable more than once.

    Keras 3 (3.15) makes a new ``tf.Variable`` for its copy of a variable on every
    copy, which TensorFlow refuses from the second save on ("tf.function only supports
    singleton tf.Variables created on the first call"); its copy is assigned again
    here instead, as TensorFlow's own variables do. Once per process.
    """
    from keras.src.backend.tensorflow import core  # noqa: PLC0415

    own = getattr(core.Variable, "_copy_trackable_to_cpu", None)
    if own is None or getattr(own, "patched", False):
        return

    def copy_to_cpu(self, object_map):
        self.value._copy_trackable_to_cpu(object_map)
        if self in object_map:
            object_map[self].assign(object_map[self.value])
        else:
            object_map[self] = tf.Variable(object_map[self.value])

    copy_to_cpu.patched = True
    core.Variable._copy_trackable_to_cpu = copy_to_cpu


# ---------------------------------------------------------------- TensorFlow


def key_value_store():
    """The coordination service's key-value store of a multi-worker run (no public API)."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context()


def op_determinism_enabled() -> bool:
    """Whether ``tf.config.experimental.enable_op_determinism()`` is on (no public getter)."""
    from tensorflow.python.framework import config  # noqa: PLC0415

    return bool(config.is_op_determinism_enabled())


def release_async_checkpoint(checkpoint: tf.train.Checkpoint) -> None:
    """Ends the writer thread TensorFlow's async checkpointing keeps for ``checkpoint``.

    TF 2.21 starts it at the first write with ``enable_async`` and joins it only at
    exit (an ``atexit`` hook), so until then it holds the checkpoint's objects and a
    CPU copy of every variable: each training run kept its model and optimizer, twice
    over, for the life of the process. No public call ends it. Call it with no write
    in flight; a later async write starts a new one.
    """
    helper = getattr(checkpoint, "_async_checkpointer_impl", None)
    if helper is None:
        return
    helper._join_async_save_thread()
    atexit.unregister(helper._join_async_save_thread)
    checkpoint._async_checkpointer_impl = None


def checkpoint_descendants(checkpoint: tf.train.Checkpoint) -> list:
    """Every object a checkpoint would save (no public way to list them)."""
    from tensorflow.python.checkpoint import graph_view  # noqa: PLC0415

    return list(graph_view.ObjectGraphView(checkpoint).descendants())


def dataset_inputs(dataset: tf.data.Dataset) -> list:
    """The datasets a dataset stage reads from (no public view of the stages)."""
    try:
        return list(dataset._inputs())
    except (AttributeError, TypeError, NotImplementedError):  # not a stage of a pipeline
        return []


_SAME_ELEMENTS = (
    "_PrefetchDataset",
    "_OptionsDataset",
    "CacheDataset",
    "_AssertCardinalityDataset",
)
_MAPS = ("_MapDataset", "_ParallelMapDataset")


def dataset_stage(dataset: tf.data.Dataset) -> str:
    """What a dataset stage does: ``'same'`` elements on, a ``'map'``, or its class name.

    tf.data has no public kind of stage; ``dataset_marks.find`` needs to know which keep a mark.
    """
    kind = type(dataset).__name__
    if kind in _SAME_ELEMENTS:
        return "same"
    return "map" if kind in _MAPS else kind


# ---------------------------------------------------------------- gin


def gin_registry():
    """Every configurable by selector (``.items()``, ``.get_match(name)``), for hints."""
    return gin.config._REGISTRY


def gin_bindings() -> Mapping:
    """The bindings parsed so far: ``{(scope, selector): {parameter: value}}``."""
    return gin.config._CONFIG


def gin_file_readers() -> list:
    """Gin's ``(reader, exists)`` pairs, which ``include`` tries in turn (a list to edit)."""
    return gin.config._FILE_READERS


def gin_include_paths() -> list[str]:
    """The directories ``include`` looks in (``gin.add_config_file_search_path`` adds one)."""
    return gin.config._LOCATION_PREFIXES
