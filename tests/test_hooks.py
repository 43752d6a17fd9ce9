"""Cadence: how far a block may run, and the actions due at a step."""

import pytest

from trainer import hooks


def test_a_block_ends_where_the_next_action_is_due():
    every_10 = hooks.Periodic(10, lambda step: None)
    at_15 = hooks.At((15,), lambda step: None)
    off = hooks.Periodic(None, lambda step: None)
    assert hooks.steps_until_due(3, [every_10, off], limit=100) == 7
    assert hooks.steps_until_due(10, [every_10, at_15], limit=100) == 5
    assert hooks.steps_until_due(3, [every_10], limit=4) == 4
    assert hooks.steps_until_due(20, [at_15], limit=100) == 100  # At passed: never again
    assert hooks.steps_until_due(0, [], limit=0) == 1  # at least one step


def test_due_actions_run_in_order_until_one_stops_training(caplog):
    ran = []

    def stop(step):
        ran.append(("stop", step))
        raise hooks.StopTraining(f"stopped at {step}")

    actions = [
        hooks.Periodic(5, lambda step: ran.append(("log", step))),
        hooks.At((10,), stop),
        hooks.Periodic(10, lambda step: ran.append(("save", step))),
    ]
    assert not hooks.run_due(actions, 5)
    assert hooks.run_due(actions, 10)
    assert ran == [("log", 5), ("log", 10), ("stop", 10)]  # save at 10 never ran


@pytest.mark.parametrize(
    "values, stops_at",
    [([0.5, 0.6, 0.6, 0.55, 0.7], 4), ([0.5, 0.6, 0.7], None), ([0.5, 0.4, 0.3], 3)],
)
def test_patience_counts_evaluations_without_a_new_best(values, stops_at):
    patience = hooks.Patience("accuracy", 2)
    stopped = [i for i, v in enumerate(values, 1) if patience.should_stop({"accuracy": v})]
    assert (stopped[0] if stopped else None) == stops_at
