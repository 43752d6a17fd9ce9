"""Cadence: how far a block may run, and the actions due at a step."""

import pytest

from trainer import cadence


def test_a_block_ends_where_the_next_action_is_due():
    every_10 = cadence.Periodic(10, lambda step: None)
    at_15 = cadence.At((15,), lambda step: None)
    off = cadence.Periodic(None, lambda step: None)
    assert cadence.steps_until_due(3, [every_10, off], limit=100) == 7
    assert cadence.steps_until_due(10, [every_10, at_15], limit=100) == 5
    assert cadence.steps_until_due(3, [every_10], limit=4) == 4
    assert cadence.steps_until_due(20, [at_15], limit=100) == 100  # At passed: never again
    assert cadence.steps_until_due(0, [], limit=0) == 1  # at least one step


def test_due_actions_run_in_order_until_one_stops_training(caplog):
    ran = []

    def stop(step):
        ran.append(("stop", step))
        raise cadence.StopTraining(f"stopped at {step}")

    actions = [
        cadence.Periodic(5, lambda step: ran.append(("log", step))),
        cadence.At((10,), stop),
        cadence.Periodic(10, lambda step: ran.append(("save", step))),
    ]
    assert not cadence.run_due(actions, 5)
    assert cadence.run_due(actions, 10)
    assert ran == [("log", 5), ("log", 10), ("stop", 10)]  # save at 10 never ran


@pytest.mark.parametrize(
    "values, stops_at",
    [([0.5, 0.6, 0.6, 0.55, 0.7], 4), ([0.5, 0.6, 0.7], None), ([0.5, 0.4, 0.3], 3)],
)
def test_patience_counts_evaluations_without_a_new_best(values, stops_at):
    patience = cadence.Patience("accuracy", 2)
    stopped = [i for i, v in enumerate(values, 1) if patience.should_stop({"accuracy": v})]
    assert (stopped[0] if stopped else None) == stops_at
