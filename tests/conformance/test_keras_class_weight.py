"""Keras 3.15's tests of ``class_weight``, ported to ``trainer.class_weighted``.

``fit(class_weight=...)`` maps each batch to sample weights read from its labels
(``data_adapter_utils.class_weight_to_sample_weights``, the tf.data adapter's
``make_class_weight_map_fn``). Here the training input_fn maps its batches with
``trainer.class_weighted``: the cases of ``data_adapter_utils_test.py``,
``tf_dataset_adapter_test.py`` and ``array_data_adapter_test.py`` give the weights
Keras asserts, refuse what Keras refuses (as a ``ValueError``), and a model trained
with them takes the steps ``fit(class_weight=...)`` takes.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer import Checkpoints, Estimator, class_weighted

pytestmark = pytest.mark.slow  # the last trains beside fit; the others are quick


def weights_of(y, class_weight):
    """The sample weights of one batch of labels ``y``, as the map gives them."""
    dataset = tf.data.Dataset.from_tensors((np.zeros((len(y), 2), "float32"), np.asarray(y)))
    ((_, _, weights),) = list(dataset.map(class_weighted(class_weight)).as_numpy_iterator())
    return weights


CASES = {  # data_adapter_utils_test's cases: (y, class_weight, expected)
    "simple_class_labels": ([0, 1, 0, 2], {0: 1.0, 1: 2.0, 2: 3.0}, [1.0, 2.0, 1.0, 3.0]),
    "one_hot_encoded_labels": (
        [[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]], {0: 1.0, 1: 2.0, 2: 3.0},
        [1.0, 2.0, 1.0, 3.0],
    ),
    "unmapped_class": ([0, 3, 0, 2], {0: 1.0, 1: 2.0, 2: 3.0}, [1.0, 1.0, 1.0, 3.0]),
    "multi_dimensional_input": (
        [[0], [1], [0], [2]], {0: 1.0, 1: 2.0, 2: 3.0}, [1.0, 2.0, 1.0, 3.0],
    ),
    "all_unmapped": ([0, 1, 0, 2], {}, [1.0, 1.0, 1.0, 1.0]),
    "string_number_keys": ([0, 1, 0, 2], {"0": 1.0, "1": 2.0, "2": 3.0}, [1.0, 2.0, 1.0, 3.0]),
    "float_number_keys": ([0, 1, 0, 2], {0.0: 1.0, 1.0: 2.0, 2.0: 3.0}, [1.0, 2.0, 1.0, 3.0]),
    # tf_dataset_adapter_test and array_data_adapter_test
    "test_class_weights_int_targets": (
        np.array([[0], [1], [2], [3]], "int64"), {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4},
        [0.1, 0.2, 0.3, 0.4],
    ),
    "test_class_weights_categorical_targets": (
        np.eye(4, dtype="float32"), {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4}, [0.1, 0.2, 0.3, 0.4],
    ),
    "test_class_weights_missing_classes_default_to_one": (
        np.array([[0], [1], [2], [3]], "int64"), {0: 0.1, 2: 0.3}, [0.1, 1.0, 0.3, 1.0],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_class_weights_become_the_sample_weights_keras_asserts(case):
    y, class_weight, expected = CASES[case]
    np.testing.assert_allclose(weights_of(y, class_weight), expected)


@pytest.mark.parametrize(
    "class_weight, message",
    [
        ({"invalid": 0.5}, "is not a class id"),  # test_..._invalid_key
        ("not_a_dict", "must map class ids to weights"),  # test_..._non_dict
        ({None: 0.5}, "is not a class id"),  # test_..._none_key
    ],
)
def test_a_class_weight_keras_refuses_is_refused_as_a_value_error(class_weight, message):
    with pytest.raises(ValueError, match=message):
        class_weighted(class_weight)


def test_class_weights_beside_sample_weights_or_several_outputs_are_refused():
    """array_data_adapter_test.test_errors: as fit, in one line, a ValueError."""
    x, y, sw = np.ones((4, 1), "float32"), np.ones((4, 3), "float32"), np.ones(4, "float32")
    cw = {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4}
    weighted = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(4)
    with pytest.raises(ValueError, match="cannot join sample weights the data already has"):
        weighted.map(class_weighted(cw))
    nested = tf.data.Dataset.from_tensor_slices((x, {"x": x, "y": y})).batch(4)
    with pytest.raises(ValueError, match="class weights are for a model of a single output"):
        nested.map(class_weighted(cw))


def classifier():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(
        keras.optimizers.SGD(0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return model


def test_training_with_class_weights_takes_fits_steps(tmp_path):
    """``fit(x, y, class_weight=...)`` and the Estimator on the same weights and batches."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 3, size=(64,)).astype("int64")
    class_weight = {0: 1.0, 1: 4.0, 2: 0.5}
    reference = classifier()
    history = reference.fit(
        x, y, batch_size=16, epochs=2, shuffle=False, class_weight=class_weight, verbose=0
    )
    model = classifier()
    ours = keras.callbacks.History()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    estimator = Estimator(
        model,
        str(tmp_path),
        global_batch_size=16,
        steps_per_loop=4,
        log_every_steps=4,  # an epoch
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    estimator.train(lambda mode, params: dataset.map(class_weighted(class_weight)), 8, [ours])
    np.testing.assert_allclose(ours.history["loss"], history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(ours.history["accuracy"], history.history["accuracy"], rtol=1e-5)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
