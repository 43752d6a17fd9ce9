"""Cookbook ops against numpy references, with numerical gradient checks."""

import numpy as np
import pytest
import tensorflow as tf

from models import ops


def numpy_log_softmax(x):
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def check_gradient(fn, *args):
    """Analytic and numerical gradients of ``fn`` agree (float64)."""
    theoretical, numerical = tf.test.compute_gradient(
        fn, [tf.constant(a, tf.float64) for a in args]
    )
    for t, n in zip(theoretical, numerical, strict=True):
        np.testing.assert_allclose(t, n, rtol=1e-4, atol=1e-6)


LOGITS = np.array([[2.0, -1.0, 0.5], [0.1, 0.2, 0.3]])
SOFT = np.array([[0.7, 0.2, 0.1], [0.0, 0.5, 0.5]])


def test_get_shape_mixes_static_and_dynamic():
    @tf.function(input_signature=[tf.TensorSpec([None, 3, None])])
    def shapes(x):
        shape = ops.get_shape(x)
        assert shape[1] == 3 and isinstance(shape[0], tf.Tensor)
        return tf.stack([shape[0], shape[1], shape[2]])

    np.testing.assert_array_equal(shapes(tf.zeros([4, 3, 7])), [4, 3, 7])


def test_batch_gather():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(ops.batch_gather(x, tf.constant([2, 0])), [x[0, 2], x[1, 0]])


def test_softmax_cross_entropy_matches_numpy_and_its_gradient():
    expected = -(SOFT * numpy_log_softmax(LOGITS)).sum(-1)
    np.testing.assert_allclose(ops.softmax_cross_entropy(LOGITS, SOFT), expected, rtol=1e-6)
    check_gradient(lambda x: ops.softmax_cross_entropy(x, tf.constant(SOFT)), LOGITS)


def test_softmax_entropy_matches_numpy_and_its_gradient():
    p = np.exp(numpy_log_softmax(LOGITS))
    np.testing.assert_allclose(ops.softmax_entropy(LOGITS), -(p * np.log(p)).sum(-1), rtol=1e-6)
    check_gradient(ops.softmax_entropy, LOGITS)


def test_large_logits_stay_exact():
    """The guide's warning: softmax of [1000., 0.] overflows in the textbook formula."""
    logits = tf.constant([[1000.0, 0.0]])
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.exp([1000.0, 0.0]) / np.exp([1000.0, 0.0]).sum()
    assert np.isnan(naive).any()
    labels = tf.constant([[0.0, 1.0]])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(logits)
        cross_entropy = ops.softmax_cross_entropy(logits, labels)
        entropy = ops.softmax_entropy(logits)
    np.testing.assert_allclose(cross_entropy, [1000.0])
    np.testing.assert_allclose(entropy, [0.0], atol=1e-6)
    np.testing.assert_allclose(tape.gradient(cross_entropy, logits), [[1.0, -1.0]])
    assert np.all(np.isfinite(tape.gradient(entropy, logits)))


def test_gaussian_kl_matches_the_closed_form_and_its_gradient():
    mean, log_var = np.array([[0.5, -1.0]]), np.array([[0.2, -0.3]])
    var = np.exp(log_var)
    expected = 0.5 * (var + mean**2 - 1 - log_var).sum(-1)  # KL(q || N(0, 1))
    np.testing.assert_allclose(ops.gaussian_kl((mean, log_var)), expected, rtol=1e-6)
    np.testing.assert_allclose(ops.gaussian_kl((mean, log_var), (mean, log_var)), [0.0], atol=1e-7)
    check_gradient(
        lambda m, v: ops.gaussian_kl(
            (m, v), (tf.constant(0.3, tf.float64), tf.constant(0.1, tf.float64))
        ),
        mean,
        log_var,
    )


def test_leaky_relu_and_its_gradient():
    x = np.array([-2.0, -0.5, 0.5, 3.0])
    np.testing.assert_allclose(ops.leaky_relu(x, 0.1), np.where(x > 0, x, 0.1 * x))
    check_gradient(lambda t: ops.leaky_relu(t, 0.1), x)


def test_top_k_error_per_example():
    logits = tf.constant([[0.1, 0.5, 0.4], [0.9, 0.04, 0.06], [0.2, 0.3, 0.5]])
    labels = tf.constant([2, 1, 2])
    np.testing.assert_array_equal(ops.top_k_error(labels, logits, k=1), [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(ops.top_k_error(labels, logits, k=2), [0.0, 1.0, 0.0])


def test_merge_equals_a_dense_layer_on_the_broadcast_concatenation():
    merge = ops.Merge(4)
    a, b = tf.random.normal([2, 5, 3]), tf.random.normal([2, 1, 6])
    out = merge(a, b)
    assert out.shape == (2, 5, 4)
    kernel = tf.concat([merge.project_a.kernel, merge.project_b.kernel], axis=0)
    concat = tf.concat([a, tf.broadcast_to(b, [2, 5, 6])], axis=-1)
    np.testing.assert_allclose(out, concat @ kernel + merge.project_b.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [ops.softmax_cross_entropy])
def test_soft_labels_equal_sparse_for_one_hot(fn):
    labels = tf.constant([0, 2])
    np.testing.assert_allclose(
        fn(LOGITS, tf.one_hot(labels, 3, dtype=tf.float64)),
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels, LOGITS),
        rtol=1e-6,
    )
