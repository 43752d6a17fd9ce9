"""The seed's recurrent recipe (experiments/reverse_lstm.gin: variable-length targets, a
loss per real target token, dropout bound in the gin file) keeps the promises the
images keep: 20 steps then 40 bitwise equal to 40 straight; a resume on two devices
within 1e-6; micro-batches of 4 within 2e-5 of one batch (dropout 0); and its decoding
against what it was trained on."""

import numpy as np
import pytest
import tensorflow as tf

from models.targets import exact_match
from tests.support.commands import run_cli
from tests.support.reversal import NO_DROPOUT, SMALL, trained, weights


@pytest.mark.slow
def test_reverse_lstm_resumes_bitwise_on_one_device_and_within_1e6_on_two(tmp_path):
    """Dropout as bound (0.1): its masks resume with the step. On two devices each
    replica draws its own masks, so that comparison is made with dropout 0."""
    straight = trained(tmp_path / "straight", 40)
    trained(tmp_path / "split", 20)
    split = trained(tmp_path / "split", 40)
    assert split.keys() == straight.keys() and any(k.startswith("rng/") for k in split)
    for key, value in straight.items():
        np.testing.assert_array_equal(split[key], value, err_msg=key)  # dropout's state too
    trained(tmp_path / "one", 40, NO_DROPOUT)
    trained(tmp_path / "two", 20, NO_DROPOUT)
    flags = [
        a for b in [*SMALL, NO_DROPOUT, "experiment.max_steps = 40"] for a in ("--gin_param", b)
    ]
    ran = run_cli(
        "--gin_file", "experiments/reverse_lstm.gin", *flags, "--schedule", "train",
        "--model_dir", str(tmp_path / "two"), "--num_devices", "2",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert len(one) == 10  # two embeddings, two LSTMs of 3, the output's 2
    for key, value in one.items():
        np.testing.assert_allclose(two[key], value, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_reverse_lstm_in_four_micro_batches_trains_as_in_one(tmp_path):
    """Dropout 0: the same 5 updates, each batch's target tokens (3 to 13 an example)
    cut 4 ways, within 2e-5."""
    trained(tmp_path / "one", 5, NO_DROPOUT)
    trained(tmp_path / "four", 5, NO_DROPOUT, "Optimization.microbatches = 4")
    one, four = weights(tmp_path / "one"), weights(tmp_path / "four")
    assert len(one) == 10
    for key, value in one.items():
        np.testing.assert_allclose(four[key], value, atol=2e-5, err_msg=key)


def test_exact_match_counts_a_decoded_target_up_to_its_end():
    decoded = tf.constant([[5, 4, 2, 0, 0], [5, 4, 3, 2, 0], [5, 2, 0, 0, 0]])
    targets = tf.constant([[5, 4, 2, 0], [5, 4, 2, 0], [5, 2, 0, 0]])
    np.testing.assert_array_equal(exact_match(decoded, targets), [1.0, 0.0, 1.0])
