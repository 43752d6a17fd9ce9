"""Calling input_fns: their checks, and the training stream's position and seed."""

import logging

import pytest
import tensorflow as tf

from trainer import Devices, InputParams, Mode, UserError
from trainer.checkpoint_writer import Checkpointer
from trainer.distributed.placement import Placement
from trainer.inputs import Inputs


def inputs(seed=7):
    return Inputs(Placement(Devices("towers", 1), global_batch_size=32), 32, 100, seed)


def recording(calls):
    def input_fn(mode, params: InputParams):
        calls.append((mode, params))
        return tf.data.Dataset.from_tensors(({"x": tf.zeros([1, 2])}, {"y": tf.zeros([1])}))

    return input_fn


def test_each_mode_gets_its_batch_seed_and_position():
    calls = []
    reading = inputs()
    reading.resume_from(None)
    reading.advance(3)
    reading.dataset(recording(calls), Mode.TRAIN)
    reading.dataset(recording(calls), Mode.EVAL)
    (_, train), (_, evaluate) = calls
    assert (train.batch_size, train.seed, train.start_example) == (32, 7, 96)
    assert (evaluate.batch_size, evaluate.seed, evaluate.start_example) == (100, 7, 0)


def test_a_resumed_run_keeps_its_checkpoints_seed_and_position(tmp_path, caplog):
    first = inputs(seed=3)
    first.resume_from(None)
    first.advance(20)
    Checkpointer(str(tmp_path), **first.state()).save(20)
    resumed = inputs(seed=9)
    with caplog.at_level(logging.WARNING, logger="absl"):
        resumed.resume_from(tf.train.latest_checkpoint(str(tmp_path)))
    assert int(resumed.position.numpy()) == 20 * 32
    assert int(resumed.seed.numpy()) == 3
    assert "keeps the seed its checkpoints were trained with (3), not seed 9" in caplog.text
    unseeded = inputs(seed=None)
    unseeded.resume_from(None)
    assert 0 <= int(unseeded.seed.numpy()) < 2**31  # drawn once, then kept


def test_what_an_input_fn_returns_is_checked_in_one_line():
    reading = inputs()
    with pytest.raises(UserError, match="returned list for mode 'train'; it must return a tf.data"):
        reading.dataset(lambda mode, params: [1, 2], Mode.TRAIN)
    features_only = tf.data.Dataset.from_tensors({"x": tf.zeros([2])})
    expected = "TRAIN and EVAL need \\(features, labels\\) or \\(features, labels, sample_weight\\)"
    with pytest.raises(UserError, match=expected):
        reading.dataset(lambda mode, params: features_only, Mode.EVAL)
    assert reading.dataset(lambda mode, params: features_only, Mode.PREDICT) is features_only
