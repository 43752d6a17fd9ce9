"""TensorBoard as the tutorials use it: graph, scalars, histograms, labelled images, and
an evaluation's confusion matrix and PR curves."""

import functools
import os

import keras
import numpy as np
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorflow.core.protobuf import config_pb2

from datasets import digits
from models.mlp import MLP
from trainer import Estimator
from trainer.settings import RunConfig, Summaries


def test_event_files_hold_graph_scalars_histograms_and_images(tmp_path, data_dir):
    keras.utils.set_random_seed(0)
    estimator = Estimator(
        MLP(hidden_units=[16]),
        str(tmp_path),
        global_batch_size=32,
        steps_per_loop=5,
        log_every_steps=10,
        summaries=Summaries(histogram_every_steps=10, image_every_steps=20),
        config=RunConfig(text_fn=lambda: "MLP.hidden_units = [16]"),
    )
    input_fn = functools.partial(digits.input_fn, data_dir=data_dir)
    estimator.train_and_evaluate(input_fn, input_fn, max_steps=20)

    acc = event_accumulator.EventAccumulator(
        os.path.join(tmp_path, "train"), size_guidance={"tensors": 0, "images": 0}
    )
    acc.Reload()
    # TF2's trace_export stores the step's graph as RunMetadata under this plugin, which
    # TensorBoard's Graphs tab reads.
    assert "train_step" in acc.PluginTagToContent("graph_run_metadata_graph")
    run_metadata = config_pb2.RunMetadata.FromString(
        tf.make_ndarray(acc.Tensors("train_step")[0].tensor_proto).item()
    )
    # The step runs inside the loop's body function: its ops are scoped per layer.
    nodes = [
        node.name
        for graph in run_metadata.function_graphs
        for function in graph.pre_optimization_graph.library.function
        for node in function.node_def
    ]
    assert any("/dense_0" in name and name.endswith("/MatMul") for name in nodes)
    assert any("/logits" in name and name.endswith("/MatMul") for name in nodes)
    histograms = set(acc.PluginTagToContent("histograms"))
    assert {"dense/dense_0/kernel", "dense/dense_0/bias", "logits/kernel"} <= histograms
    assert {"activations/dense_0", "activations/logits"} <= histograms
    images = acc.PluginTagToContent("images")
    assert "labelled_inputs" in images
    image_events = acc.Tensors("labelled_inputs")
    assert [e.step for e in image_events] == [20]
    encoded = tf.make_ndarray(image_events[0].tensor_proto)  # [width, height, png...]
    picture = tf.io.decode_png(encoded[2]).numpy()
    assert picture.shape == (96, 96, 3) and np.any(picture[:12, :, 1] > 150)  # green text
    scalars = set(acc.PluginTagToContent("scalars"))
    assert {"loss", "accuracy", "learning_rate", "gradient_norm", "examples_per_sec"} <= scalars
    assert "operative_config" in acc.PluginTagToContent("text")

    # Each evaluation: the confusion matrix as an image and a table, a PR curve a class,
    # all from the same counts as the per-class figures the Estimator keeps.
    acc = event_accumulator.EventAccumulator(
        os.path.join(tmp_path, "eval_eval"), size_guidance={"tensors": 0}
    )
    acc.Reload()
    figures = estimator.model.classes["eval"]
    matrix = np.array(figures["confusion_matrix"])
    assert matrix.shape == (10, 10) and matrix.sum() == 360
    assert "confusion_matrix" in acc.PluginTagToContent("images")
    (drawn,) = acc.Tensors("confusion_matrix")
    picture = tf.io.decode_png(tf.make_ndarray(drawn.tensor_proto)[2]).numpy()
    assert drawn.step == 20 and picture.shape == (304, 304, 3)
    (table,) = acc.Tensors("confusion_matrix/counts")
    rows = tf.make_ndarray(table.tensor_proto).item().decode().splitlines()
    assert rows[2].startswith("| **0** | " + " | ".join(map(str, matrix[0])) + " | ")
    assert rows[-1].startswith("| precision | ")
    curves = sorted(acc.PluginTagToContent("pr_curves"))
    assert curves == sorted(f"pr_curve/class_{k}" for k in range(10))
    curve = tf.make_ndarray(acc.Tensors("pr_curve/class_4")[0].tensor_proto)  # [6, 101]
    assert curve.shape == (6, 101)
    assert curve[0, 0] == matrix[4].sum() and curve[0, 0] + curve[1, 0] == 360  # all at 0
    assert curve[5, 0] == 1.0 and np.all(np.diff(curve[5]) <= 0)  # recall falls
    assert figures["recall"][4] == matrix[4, 4] / matrix[4].sum()


def test_profiler_trace_covers_the_requested_steps(tmp_path, data_dir):
    estimator = Estimator(
        MLP(hidden_units=[16]),
        str(tmp_path),
        global_batch_size=32,
        steps_per_loop=7,
        log_every_steps=50,
        summaries=Summaries(profile_steps=(10, 15)),
    )
    estimator.train(functools.partial(digits.input_fn, data_dir=data_dir), 20)
    traces = tf.io.gfile.glob(
        os.path.join(tmp_path, "train", "plugins", "profile", "*", "*.xplane.pb")
    )
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_a_classifier_of_too_many_classes_counts_no_confusion_matrix(caplog):
    """Its matrix grows with classes squared: 4,000 classes were 16M cells per replica."""
    from trainer import confusion

    labels = {"label": tf.TensorSpec([None], tf.int64)}
    for classes, counted in ((confusion.COUNTED_CLASSES, True), (4000, False)):
        predictions = {"probabilities": tf.TensorSpec([None, classes], tf.float32)}
        found = confusion.classifier(predictions, labels)
        assert (found is not None) == counted and (not found or found.num_classes == classes)
    assert "4000 classes: evaluations count no confusion matrix or PR curves" in caplog.text


def test_probabilities_in_bfloat16_are_taken_as_they_are_not_softmaxed_again():
    """A softmax output under mixed_bfloat16 sums to 1 only within bfloat16's rounding;
    it was taken for logits and softmaxed again (no class above 0.5 in the PR curves)."""
    from trainer import confusion

    logits = tf.random.stateless_normal([64, 10], [1, 2]) * 4
    for dtype in (tf.float32, tf.bfloat16, tf.float16):
        probabilities = tf.cast(tf.nn.softmax(logits), dtype)
        found = confusion.Classifier("label", False, "probabilities", 10)
        labels = {"label": tf.zeros([64], tf.int64)}
        targets, scores = confusion.targets_and_scores(
            found, {"probabilities": probabilities}, labels
        )
        assert targets.shape == (64, 10)
        np.testing.assert_allclose(scores, tf.cast(probabilities, tf.float32), atol=1e-6)
    _, scores = confusion.targets_and_scores(
        found, {"probabilities": tf.cast(logits, tf.bfloat16)}, labels
    )
    np.testing.assert_allclose(tf.reduce_sum(scores, -1), 1.0, atol=1e-5)  # logits: softmaxed


def test_a_multi_label_model_counts_each_class_and_no_row_of_several_in_the_matrix():
    """Sigmoid outputs and multi-hot labels: each class's PR counts take the rows it is in
    (its scores not softmaxed); the matrix only the rows of one class."""
    from trainer import confusion

    labels = tf.constant([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], tf.float32)
    scores = tf.constant([[0.9, 0.2, 0.8], [0.1, 0.7, 0.3], [0.6, 0.6, 0.1], [0.2, 0.1, 0.9]])
    found = confusion.classifier(
        {"probabilities": tf.TensorSpec([None, 3], tf.float32)},
        {"label": tf.TensorSpec([None, 3], tf.float32)},
    )
    targets, taken = confusion.targets_and_scores(
        found, {"probabilities": scores}, {"label": labels}
    )
    np.testing.assert_allclose(taken, scores)  # independent probabilities, as they are
    counts = confusion.ClassCounts(3)
    counts.update(targets, taken)
    np.testing.assert_array_equal(counts.positives.numpy().sum(axis=1), [2, 2, 2])
    np.testing.assert_array_equal(counts.negatives.numpy().sum(axis=1), [2, 2, 2])
    assert counts.matrix.numpy().sum() == 2  # rows 1 and 3: one class each
    assert counts.matrix.numpy()[1, 1] == counts.matrix.numpy()[2, 2] == 1
