"""Evaluation around training: eval sets, best exports, early stopping, checkpoint polling."""

import json
import os

import pytest
import tensorflow as tf

from trainer import UserError, cadence, evaluation
from trainer.checkpoint_writer import Checkpointer


def test_one_input_fn_is_the_eval_set_named_eval():
    def fn(mode, params):
        return None

    assert evaluation.eval_sets(fn) == {"eval": fn}
    assert evaluation.eval_sets({"a": fn, "b": fn}) == {"a": fn, "b": fn}


def scripted(values):
    """An ``evaluate(name)`` returning the next accuracy for set 'a', 0 for others."""
    remaining = list(values)
    return lambda name: {"accuracy": remaining.pop(0) if name == "a" else 0.0}


def test_the_first_set_ranks_exports_and_stops_training(tmp_path):
    exported = []

    def export_model(path):
        os.makedirs(path)
        exported.append(os.path.basename(path))
        return path

    evaluations = evaluation.Evaluations(
        scripted([0.5, 0.7, 0.6, 0.65]),
        ["a", "b"],
        evaluation.best_exporter(str(tmp_path), "accuracy", keep=1, higher=True),
        export_model,
        evaluation.early_stopping("accuracy", patience=2, higher=True),
    )
    evaluations(100)
    evaluations(200)
    evaluations(300)
    with pytest.raises(cadence.StopTraining, match="early stopping at step 400: accuracy"):
        evaluations(400)
    assert exported == ["100", "200"]
    assert sorted(os.listdir(tmp_path / "export" / "best")) == ["200", "best.json"]
    assert evaluations.results == {"a": {"accuracy": 0.65}, "b": {"accuracy": 0.0}}
    assert evaluations.evaluated_at == [100, 200, 300, 400]
    assert evaluations.final(400)["a"] == {"accuracy": 0.65}  # not evaluated again
    assert evaluation.best_exporter(str(tmp_path), None, 1, True) is None
    assert evaluation.early_stopping(None, 2, True) is None


def test_each_new_checkpoint_is_handed_out_once_across_restarts(tmp_path):
    step = tf.Variable(0, dtype=tf.int64)
    checkpointer = Checkpointer(str(tmp_path), 10, step=step)
    for s in (10, 20):
        checkpointer.save(s)
    polled = evaluation.new_checkpoints(str(tmp_path), 30, poll_seconds=0.01, timeout_seconds=1)
    assert os.path.basename(next(polled)) == "ckpt-10"
    assert os.path.basename(next(polled)) == "ckpt-20"
    checkpointer.save(30)
    assert os.path.basename(next(polled)) == "ckpt-30"
    with pytest.raises(StopIteration):  # 30 reached max_steps
        next(polled)
    progress = json.loads((tmp_path / evaluation.PROGRESS_FILE).read_text())
    assert progress == {"step": 30}
    # A restarted evaluator goes on after step 30 and gives up when nothing comes.
    restarted = evaluation.new_checkpoints(
        str(tmp_path), 40, poll_seconds=0.05, timeout_seconds=0.1
    )
    with pytest.raises(UserError, match="no new checkpoint in .* for 0s after step 30"):
        next(restarted)
