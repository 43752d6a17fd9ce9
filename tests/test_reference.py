"""DPO's reference log-probabilities, scored once and kept beside the pairs
(datasets/chat/reference.py, scores.py): each pair's by its row, read with it by
training and evaluation alike, and refused when another checkpoint scored them or
the pairs were prepared again."""

import json
import logging
import math
import os
import shutil
import types

import gin
import numpy as np
import pytest
import tensorflow as tf

from datasets.chat import scores
from datasets.records import shards
from tests.support import chats
from trainer import UserError


@pytest.fixture
def scored():
    """A reference model (SimPO, 2 steps) and a copy of the pairs it scored, once a process."""
    return types.SimpleNamespace(**chats.scored_pairs())


def _alone(model, ids: np.ndarray, mask: np.ndarray) -> float:
    """One answer's summed log-probability, its chat scored alone, unpadded."""
    tokens = tf.constant(ids[None, :-1])
    ones = tf.ones_like(tokens, tf.int32)
    logits = model.logits(tokens, ones, tf.range(tokens.shape[1])[None])
    logps = tf.gather(tf.nn.log_softmax(logits[0]), ids[1:], batch_dims=1)
    return float(tf.reduce_sum(logps * tf.cast(mask[1:], tf.float32)))


def test_each_pair_is_scored_by_its_row_beside_the_shards(scored):
    """One float32 pair of numbers a pair, 8 bytes (and numpy's header); each equal
    to its answer's log-probability under the reference weights, scored alone."""
    from trainer import Mode

    metadata = shards.read_metadata(scored.data_dir)
    for split, entry in metadata["splits"].items():
        path = os.path.join(scored.data_dir, f"{split}-reference.npy")
        assert os.path.getsize(path) == 128 + 8 * entry["count"]
        assert np.load(path).shape == (entry["count"], 2)
    record = json.loads(open(os.path.join(scored.data_dir, "reference.json")).read())
    assert record["checkpoint"].endswith("ckpt-2") and set(record["splits"]) == {"train", "test"}
    model = chats.preference_model("dpo")
    records = chats.pair_records(scored.data_dir, "test")
    features, labels = chats.pair_batch(records[:1])
    model(features | labels, None, Mode.PREDICT)  # made, then given the reference's weights
    for variable, value in zip(model.trainable_variables, scored.weights.values(), strict=True):
        variable.assign(value)
    for row, pair in enumerate(records):
        expected = [_alone(model, pair[a], pair[f"{a}_mask"]) for a in ("chosen", "rejected")]
        assert scored.values["test"][row] == pytest.approx(expected, abs=2e-4)


@pytest.mark.parametrize("held", ["in memory", "read by index"])
def test_dpo_from_its_reference_starts_at_log_2_in_shuffled_training(
    scored, held, tmp_path, caplog
):
    """The policy starts as the reference: every reward is 0 and the first step's loss
    is log 2, whatever order the pairs are drawn in, only if each pair reads its own
    row's scores: held in memory with the pairs, or read with each record by index."""
    settings = {"warm_start_from": scored.reference}
    model_dir = str(tmp_path / "dpo")
    caplog.set_level(logging.INFO)
    if held == "read by index":
        gin.bind_parameter("pipeline.memory_limit_mb", 0)
    try:
        chats.tuned(model_dir, 1, "dpo", scored.data_dir, scored.reference, **settings)
    finally:
        gin.clear_config()
    said = [record.getMessage() for record in caplog.records]
    assert any(line.startswith("Reading pairs-train") for line in said) == (held != "in memory")
    first = json.loads(open(os.path.join(model_dir, "metrics.jsonl")).readline())
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["reward_margin"] == pytest.approx(0, abs=1e-6)


def test_dpo_resumed_from_a_checkpoint_ends_bitwise_where_a_straight_run_ends(scored, tmp_path):
    """Stopped at step 2 and resumed by a new Estimator to step 5, reading each pair's
    scores by index again: the weights are those of 5 steps in one go, bit for bit."""
    run = lambda name, steps: chats.tuned(  # noqa: E731
        str(tmp_path / name),
        steps,
        "dpo",
        scored.data_dir,
        scored.reference,
        warm_start_from=scored.reference,
    )
    straight = run("straight", 5)
    run("resumed", 2)
    resumed = run("resumed", 5)
    assert all(np.array_equal(straight[k], resumed[k]) for k in straight)
    assert max(float(np.abs(straight[k] - scored.weights[k]).max()) for k in straight) > 1e-3


def test_dpo_cut_in_micro_batches_trains_what_one_device_trains(scored, tmp_path):
    """DPO's loss is a mean over the step's pairs, each against its own stored scores:
    4 micro-batches leave every weight within 2e-5 of the whole batch's after 5 steps."""
    run = lambda name, **cut: chats.tuned(  # noqa: E731
        str(tmp_path / name),
        5,
        "dpo",
        scored.data_dir,
        scored.reference,
        warm_start_from=scored.reference,
        **cut,
    )
    whole, cut = run("whole"), run("cut", microbatches=4)
    assert max(float(np.abs(whole[k] - cut[k]).max()) for k in whole) <= 2e-5


def test_a_reference_held_in_memory_trains_what_its_stored_scores_train(scored, tmp_path):
    """PreferenceModel.reference: the reference's copy scores each batch as it trains.
    After 5 steps its weights are within 2e-5 of those trained on the stored scores,
    and its loss and reward margin within 1e-5; its checkpoints hold what theirs hold."""
    run = lambda name, **how: chats.tuned(  # noqa: E731
        str(tmp_path / name), 5, "dpo", scored.data_dir, warm_start_from=scored.reference, **how
    )
    stored, held = run("stored", reference=scored.reference), run("held", held=scored.reference)
    assert max(float(np.abs(stored[k] - held[k]).max()) for k in stored) <= 2e-5
    assert max(float(np.abs(stored[k] - scored.weights[k]).max()) for k in stored) > 1e-3
    saved = {
        name: sorted(tf.train.list_variables(str(tmp_path / name / "ckpt-5")))
        for name in ("stored", "held")
    }
    assert saved["held"] == saved["stored"]
    logged = {n: json.loads(open(tmp_path / n / "metrics.jsonl").readline()) for n in saved}
    assert logged["held"]["step"] == 5
    for name in ("loss", "reward_margin"):  # accuracy flips on a near tie
        assert logged["held"][name] == pytest.approx(logged["stored"][name], abs=1e-5)
    with pytest.raises(UserError, match="given twice"):
        run("both", reference=scored.reference, held=scored.reference)
    nowhere = str(tmp_path / "absent")  # not the run's own model_dir
    with pytest.raises(UserError, match=f"PreferenceModel.reference {nowhere}: there is nothing"):
        run("nowhere", held=nowhere)
    (tmp_path / "empty").mkdir()  # a folder, no checkpoint in it
    with pytest.raises(UserError, match="reference .*/empty: the directory holds no checkpoint"):
        run("empty_run", held=str(tmp_path / "empty"))


def test_scores_of_another_checkpoint_or_preparation_are_one_line(scored, tmp_path):
    """A reference trained on (its newest checkpoint is another model), pairs prepared
    again from other rows, and no scores at all: each refused before training, in one
    line that says how to score them."""
    from datasets.chat import input_fns, pairs
    from trainer import InputParams, Mode

    params = InputParams(batch_size=4, global_batch_size=4)
    read = lambda data_dir, reference: input_fns.pairs_input_fn(  # noqa: E731
        Mode.TRAIN, params, data_dir, reference=reference
    )
    moved = str(tmp_path / "moved")
    shutil.copytree(scored.reference, moved)
    chats.tuned(moved, 3)  # one step more: ckpt-3
    with pytest.raises(
        UserError, match=r"holds the log-probabilities of .*ckpt-2, not of .*ckpt-3"
    ):
        read(scored.data_dir, moved)
    again = str(tmp_path / "again")
    shutil.copytree(scored.data_dir, again)
    source = tmp_path / "other.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in chats.pair_rows(64, seed=1)))
    pairs.prepare(str(source), again, eval_fraction=0.25, num_shards=2)
    with pytest.raises(UserError, match=r"has no reference log-probabilities for DPO"):
        read(again, scored.reference)  # prepare removed the old scores with its own files
    scores.write(
        again,
        scores.identity(scored.reference),
        scored.values,
        shards.read_metadata(scored.data_dir),
    )
    with pytest.raises(UserError, match=r"scored the train split as it was prepared before"):
        read(again, scored.reference)
    assert read(scored.data_dir, scored.reference) is not None  # the scored pairs still read
