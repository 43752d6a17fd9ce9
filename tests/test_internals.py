"""One test per private TensorFlow or Keras name in ``trainer/internals.py``.

Each test is named after the private name it relies on, so that an upgrade that
removes or changes one fails here, naming it, before the framework misbehaves.
"""

import os
import threading

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer import internals


def test_keras_optimizer__all_reduce_sum_gradients():
    grads_and_vars = [(tf.constant([1.0]), tf.Variable([0.0]))]
    for optimizer in (
        keras.optimizers.Adam(),
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
    ):
        internals.skip_gradient_summing(optimizer)
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        assert inner._all_reduce_sum_gradients(grads_and_vars) == grads_and_vars
    lost = keras.optimizers.SGD()
    lost._all_reduce_sum_gradients = None
    with pytest.raises(RuntimeError, match="has no _all_reduce_sum_gradients: the replicas'"):
        internals.skip_gradient_summing(lost)


class _Penalised(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.sum(x))
        return x


def test_keras_layer__flatten_layers__get_own_losses__clear_losses():
    inner = _Penalised()
    outer = keras.Sequential([keras.Input((2,)), inner])
    found = [id(layer) for layer in internals.sublayers(outer)]
    assert found[0] == id(outer) and found.count(id(inner)) == 1
    outer(tf.ones([1, 2]))
    assert internals.own_losses(outer) == [] and len(internals.own_losses(inner)) == 1
    internals.clear_losses(outer)  # its sublayers' too
    assert internals.own_losses(inner) == []


def test_keras_dense__kernel_is_the_stored_kernel_lora_adds_to():
    dense = keras.layers.Dense(3)
    dense.build((None, 4))
    stored = internals.stored_kernel(dense)
    assert stored is dense.kernel and stored.trainable
    dense.enable_lora(2)
    dense.lora_kernel_b.assign(np.ones((2, 3), np.float32))
    delta = dense.lora_kernel_a.numpy() @ dense.lora_kernel_b.numpy()
    assert internals.stored_kernel(dense) is stored and not stored.trainable
    np.testing.assert_allclose(np.asarray(dense.kernel), stored.numpy() + delta, rtol=1e-6)
    dense.lora_enabled = False  # models/lora.py's merge: the kernel property is the stored one
    assert dense.kernel is stored


def test_keras_layer__trainable_variables__non_trainable_variables():
    class Counting(keras.Model):
        def __init__(self):
            super().__init__()
            self.count = self.add_variable(shape=(), initializer="zeros", trainable=False)
            self.dense = keras.layers.Dense(2)

    model = Counting()
    model.dense.build((None, 3))
    assert internals.own_variables(model) == [model.count]  # not its Dense's
    assert [v.path for v in internals.own_variables(model.dense)] == [
        v.path for v in model.dense.weights
    ]


def test_keras_layer_call_context_global_state():
    layer = _Penalised()
    layer(tf.ones([1, 2]))
    layer(tf.ones([1, 2]) * 3)  # outermost: Keras forgets the first call's loss
    assert [float(v) for v in internals.own_losses(layer)] == [6.0]
    internals.clear_losses(layer)
    with internals.one_keras_call():
        layer(tf.ones([1, 2]))
        layer(tf.ones([1, 2]) * 3)
    assert [float(v) for v in internals.own_losses(layer)] == [2.0, 6.0]
    layer(tf.ones([1, 2]))  # the context is gone: an outermost call clears again
    assert [float(v) for v in internals.own_losses(layer)] == [2.0]


def test_keras_model__compile_config():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    loss = keras.losses.MeanSquaredError()
    model.compile(keras.optimizers.SGD(), loss=loss, metrics=["mae"], loss_weights=[0.5])
    given = internals.compile_arguments(model)
    assert given["loss"] is loss and given["metrics"] == ["mae"] and given["loss_weights"] == [0.5]


def test_keras_optimizer__learning_rate_is_its_schedule():
    class Halved(keras.optimizers.schedules.LearningRateSchedule):  # registered nowhere
        def __call__(self, step):
            return 0.5 ** tf.cast(step, "float32")

        def get_config(self):
            return {}

    optimizer = keras.optimizers.Adam(Halved())
    classes = internals.schedule_classes(optimizer)
    assert classes == {"Halved": Halved}
    again = keras.optimizers.Adam.from_config(optimizer.get_config(), classes)
    assert isinstance(again._learning_rate, Halved)
    assert internals.schedule_classes(keras.optimizers.Adam(0.1)) == {}


def test_keras_mean_metric__fn_and__fn_kwargs():
    metric = keras.metrics.MeanMetricWrapper(keras.metrics.mean_absolute_error, name="mae")
    per_example = internals.mean_metric_function(metric)
    values = per_example(tf.constant([[1.0], [2.0]]), tf.constant([[0.5], [4.0]]))
    np.testing.assert_allclose(values, [0.5, 2.0])
    top3 = keras.metrics.SparseTopKCategoricalAccuracy(k=3)  # its k is a kwarg of fn
    hits = internals.mean_metric_function(top3)(tf.constant([3]), tf.constant([[4.0, 3, 2, 1]]))
    np.testing.assert_array_equal(hits, [0.0])


def test_keras_metric__direction_and_monitor_callback__set_monitor_op():
    assert internals.metric_direction(keras.metrics.get("auc")) == "up"
    assert internals.metric_direction(keras.metrics.get("mae")) == "down"
    stopping = keras.callbacks.EarlyStopping(monitor="val_auc", mode="max")
    assert stopping.monitor_op is None  # until the first epoch's end
    internals.set_monitor_op(stopping)
    assert stopping.monitor_op(2.0, 1.0) and not stopping.monitor_op(1.0, 2.0)


def test_keras_functional__inputs_struct():
    image, ink = keras.Input((2,), name="image"), keras.Input((1,), name="ink")
    joined = keras.layers.Concatenate()([image, ink])
    assert internals.takes_dict_inputs(keras.Model({"image": image, "ink": ink}, joined))
    assert not internals.takes_dict_inputs(keras.Model([image, ink], joined))


def test_keras_variable__value_and__initialize():
    variable = keras.Variable(np.array([1.0, 2.0], np.float32))
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert internals.variable_made_outside(variable, strategy)
    with strategy.scope():
        internals.make_again(variable)
    assert not internals.variable_made_outside(variable, strategy)
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])


def test_keras_adam__get_variable_index__momentums__velocities():
    weights = [keras.Variable(np.zeros(n, np.float32)) for n in (2, 3)]
    adam = keras.optimizers.Adam()
    adam.build(weights)
    index = internals.slot_index(adam, weights[1])
    assert index == 1
    assert [tuple(slot.shape) for slot in internals.adam_slots(adam, index)] == [(3,), (3,)]


def test_keras_variable__copy_trackable_to_cpu():
    """Copied twice (two background saves), the copy is the same tf.Variable, updated."""
    from keras.src.backend.tensorflow import core
    from tensorflow.python.util import object_identity  # what TensorFlow passes

    internals.copy_keras_variables_again()
    assert getattr(core.Variable._copy_trackable_to_cpu, "patched", False)
    variable = keras.Variable(np.array([1.0], np.float32))
    copies = object_identity.ObjectIdentityDictionary()
    variable._copy_trackable_to_cpu(copies)
    first = copies[variable]
    variable.assign([2.0])
    variable._copy_trackable_to_cpu(copies)
    assert copies[variable] is first and first.numpy().tolist() == [2.0]


def test_tensorflow_context_key_value_store():
    store = internals.key_value_store()
    for name in ("set_config_key_value", "get_config_key_value"):
        assert callable(getattr(store, name, None)), name


def test_tensorflow_config_is_op_determinism_enabled():
    assert internals.op_determinism_enabled() is False


def writer_threads() -> list:
    """TensorFlow's async checkpoint writer threads alive (named for their target)."""
    return [t for t in threading.enumerate() if "_async_save" in t.name]


def test_tensorflow_checkpoint__async_checkpointer_impl__join_async_save_thread(tmp_path):
    """Released, the writer thread ends and the checkpoint keeps no helper; a later
    async write starts a new one, and its file is whole."""
    before = len(writer_threads())
    variable = tf.Variable(1.0)
    checkpoint = tf.train.Checkpoint(v=variable)
    options = tf.train.CheckpointOptions(enable_async=True)
    checkpoint.write(str(tmp_path / "a"), options=options)
    checkpoint.sync()
    assert len(writer_threads()) == before + 1
    internals.release_async_checkpoint(checkpoint)
    assert len(writer_threads()) == before and checkpoint._async_checkpointer_impl is None
    variable.assign(2.0)
    checkpoint.write(str(tmp_path / "b"), options=options)
    checkpoint.sync()
    internals.release_async_checkpoint(checkpoint)
    assert len(writer_threads()) == before
    assert (
        tf.train.load_checkpoint(str(tmp_path / "b")).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE")
        == 2.0
    )


def test_tensorflow_graph_view_descendants():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    found = {id(o) for o in internals.checkpoint_descendants(tf.train.Checkpoint(model=model))}
    assert all(id(v) in found for v in model.weights)


def test_tensorflow_dataset__inputs():
    source = tf.data.Dataset.range(4)
    mapped = source.map(lambda x: x + 1)
    assert [type(d).__name__ for d in internals.dataset_inputs(mapped)] == [type(source).__name__]
    assert internals.dataset_inputs(mapped.batch(2))[0] is mapped


def test_tensorflow_dataset_stage_class_names():
    source = tf.data.Dataset.range(8)
    kept = [
        source.prefetch(1),
        source.with_options(tf.data.Options()),
        source.cache(),
        source.apply(tf.data.experimental.assert_cardinality(8)),
    ]
    assert [internals.dataset_stage(d) for d in kept] == ["same"] * 4
    maps = [source.map(lambda x: x), source.map(lambda x: x, num_parallel_calls=2)]
    assert [internals.dataset_stage(d) for d in maps] == ["map", "map"]
    assert internals.dataset_stage(source.filter(lambda x: x > 1)) == "_FilterDataset"
    assert internals.dataset_inputs(source) == []


def test_gin_config__REGISTRY():
    from trainer.cli import gin_config

    registry = internals.gin_registry()
    assert "trainer.Estimator" in dict(registry.items())
    assert registry.get_match("Estimator").wrapped is gin_config.estimator.Estimator


def test_gin_config__CONFIG():
    from trainer.cli import gin_config  # noqa: F401 (gin knows Keras's optimizers then)

    gin.parse_config("Adam.learning_rate = 0.5")
    assert {key: dict(value) for key, value in internals.gin_bindings().items()} == {
        ("", "optimizers.Adam"): {"learning_rate": 0.5}
    }


def test_gin_config__FILE_READERS(tmp_path):
    readers = internals.gin_file_readers()
    assert readers and all(callable(read) and callable(exists) for read, exists in readers)
    (tmp_path / "here.gin").write_text("")
    assert any(exists(str(tmp_path / "here.gin")) for _, exists in readers)


def test_gin_config__LOCATION_PREFIXES(tmp_path):
    paths = internals.gin_include_paths()
    gin.add_config_file_search_path(str(tmp_path))
    try:
        assert str(tmp_path) in internals.gin_include_paths()
    finally:
        paths.remove(str(tmp_path))  # the test leaves gin's include paths as they were


@pytest.mark.slow
def test_keras_imports_ipython_pandas_sklearn_and_matplotlib_only_if_they_are_there():
    """``console.OPTIONAL_AT_IMPORT``, held back while the command line imports TensorFlow."""
    import subprocess
    import sys

    script = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("console", sys.argv[1])  # not trainer's
console = importlib.util.module_from_spec(spec)  # __init__, which imports TensorFlow
spec.loader.exec_module(console)
with console.optional_packages_held_back():
    import tensorflow as tf
    import keras
held = sorted({m.partition(".")[0] for m in sys.modules} & set(console.OPTIONAL_AT_IMPORT))
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.compile("adam", "mse")
model.fit(tf.zeros([4, 3]), tf.zeros([4, 2]), verbose=0)
import sklearn.datasets  # imported as usual afterwards
print(held, len(sklearn.datasets.load_digits().target))
"""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            os.path.join(os.path.dirname(internals.__file__), "console.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["[]", "1797"]


def test_keras_backend_get_keras_mask():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Embedding(4, 2, mask_zero=True)])
    outputs = model(np.array([[1, 2, 0]]))
    np.testing.assert_array_equal(internals.keras_mask(outputs), [[True, True, False]])
    assert internals.keras_mask(tf.constant([1.0])) is None
