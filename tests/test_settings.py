"""The Estimator's settings in groups: checked when made, bound by gin, old names told."""

import dataclasses
import inspect

import pytest

import trainer
from tests.support.commands import REPO
from trainer import config_diff, settings
from trainer.cli import gin_config
from trainer.errors import UserError


def test_the_estimator_takes_a_few_settings_and_each_group_whole():
    parameters = inspect.signature(trainer.Estimator).parameters
    assert len(parameters) <= 18  # what every run has, the groups, the config, a tracker
    groups = {p.name: p.default for p in parameters.values() if dataclasses.is_dataclass(p.default)}
    assert {type(g) for g in groups.values()} == {*settings.GROUPS, settings.RunConfig}
    assert set(gin_config.GROUPS) == set(groups) - {"config"}  # the command line makes each


# Fields made after the flat arguments were gone.
ADDED = {"Summaries.confusion_matrix", "Optimization.microbatch_tokens"}


def test_every_old_argument_names_a_field_of_its_group_and_every_field_had_one():
    fields = {
        f"{group.__name__}.{field.name}"
        for group in settings.GROUPS
        for field in dataclasses.fields(group)
    }
    assert ADDED <= fields
    assert sorted(settings.MOVED.values()) == sorted(fields - ADDED)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: trainer.Checkpoints(keep=0), "Checkpoints.keep must be a whole number >= 1"),
        (
            lambda: trainer.Checkpoints(every_steps=2.5),
            r"Checkpoints.every_steps must be a whole number >= 1 or None, got 2.5",
        ),
        (lambda: trainer.Devices(startup_timeout=0), "Devices.startup_timeout must be a number"),
        (
            lambda: trainer.Optimization(nonfinite_loss="skip"),
            "Optimization.nonfinite_loss must be 'stop' or 'rollback', got 'skip'",
        ),
        (
            lambda: trainer.Optimization(microbatches=0),
            "Optimization.microbatches must be a whole number >= 1, got 0",
        ),
        (lambda: trainer.BestExport(keep=0), "BestExport.keep must be a whole number >= 1"),
        (lambda: trainer.EarlyStop(patience=0), "EarlyStop.patience must be a whole number"),
        (
            lambda: trainer.Summaries(profile_steps=(5, 3)),
            r"Summaries.profile_steps must be \(start, stop\) with 0 <= start < stop, got \(5, 3\)",
        ),
    ],
)
def test_a_group_refuses_a_bad_setting_when_made(make, message):
    with pytest.raises(UserError, match=message):
        make()


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: trainer.Summaries(confusion_matrix="False"),
            "Summaries.confusion_matrix must be True or False, got 'False' (in gin, write "
            "False without quotes)",
        ),
        (
            lambda: trainer.Checkpoints(keep_best="no"),
            "Checkpoints.keep_best must be True or False, got 'no'",
        ),
        (
            lambda: trainer.Devices(jit_compile="false"),
            "Devices.jit_compile must be True or False, got 'false' (in gin, write False "
            "without quotes)",
        ),
        (
            lambda: trainer.Optimization(ema_decay="0.99"),
            "Optimization.ema_decay must be a number or None, got '0.99' (in gin, write 0.99 "
            "without quotes)",
        ),
        (
            lambda: trainer.Optimization(clip_gradient_norm="1.0"),
            "Optimization.clip_gradient_norm must be a number or None, got '1.0' (in gin, "
            "write 1.0 without quotes)",
        ),
        (
            lambda: trainer.Optimization(learning_rate_multipliers="body"),
            "Optimization.learning_rate_multipliers must be a dict of strings to numbers or "
            "None, got 'body'",
        ),
        (
            lambda: trainer.Optimization(no_weight_decay="bias"),
            "Optimization.no_weight_decay must be a list of strings, got 'bias': write ['bias']",
        ),
        (
            lambda: trainer.Summaries(profile_steps=[1, "9"]),
            "Summaries.profile_steps must be (a whole number, a whole number) or None, got "
            "(1, '9')",
        ),
        (lambda: trainer.WarmStart(map=3), "WarmStart.map must be a dict of strings to strings"),
        (lambda: trainer.BestExport(higher=1), "BestExport.higher must be True or False, got 1"),
    ],
)
def test_every_field_of_a_group_is_checked_for_its_type_when_made(make, message):
    """A quoted 'False' is a non-empty string, which Python reads as True: refused."""
    with pytest.raises(UserError) as refused:
        make()
    assert str(refused.value) == message or str(refused.value).startswith(message)


def test_a_field_of_the_right_type_is_taken_as_given():
    import pathlib

    assert trainer.Optimization(ema_decay=1, clip_gradient_norm=2).ema_decay == 1
    assert trainer.WarmStart(source=pathlib.Path("/runs/a")).source == "/runs/a"
    assert trainer.Summaries(profile_steps=[2, 4]).profile_steps == (2, 4)
    assert trainer.Devices(count=2, prefetch=None).count == 2


def test_an_old_flat_argument_from_python_is_told_its_group(tmp_path):
    from models.mlp import MLP

    with pytest.raises(UserError) as refused:
        trainer.Estimator(MLP(), str(tmp_path), save_checkpoints_steps=10)
    assert str(refused.value) == (
        "Estimator(save_checkpoints_steps=...) is Checkpoints.every_steps now: pass "
        "Estimator(..., checkpoints=trainer.Checkpoints(every_steps=...))"
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        trainer.Estimator(MLP(), str(tmp_path), bogus=10)


def test_a_group_bound_whole_in_gin_is_told_to_bind_its_fields():
    from trainer.cli import experiment  # noqa: F401 (registers experiment)

    with pytest.raises(UserError) as refused:
        gin_config.parse(
            [f"{REPO}/experiments/digits_mlp.gin"], ["Estimator.checkpoints = @Checkpoints()"]
        )
    assert str(refused.value) == (
        "--gin_param: Configurable 'Estimator' has denylisted kwarg 'checkpoints': the command "
        "line makes Estimator.checkpoints from the Checkpoints bindings: bind its fields "
        "instead, e.g. 'Checkpoints.every_steps = ...'"
    )


def test_a_group_is_frozen_and_its_mappings_are_its_own():
    rates = {"^body/": 0.1}
    optimization = trainer.Optimization(learning_rate_multipliers=rates)
    rates["^head/"] = 2.0
    assert optimization.learning_rate_multipliers == {"^body/": 0.1}
    assert trainer.Optimization().frozen_until_step == {} and trainer.WarmStart().map == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        optimization.ema_decay = 0.9


def test_the_estimator_refuses_a_group_given_as_a_dict_in_one_line(tmp_path):
    from models.mlp import MLP

    with pytest.raises(
        UserError, match="Estimator.checkpoints must be a trainer.Checkpoints instance, got dict"
    ):
        trainer.Estimator(MLP(), str(tmp_path), checkpoints={"every_steps": 5})
    with pytest.raises(
        UserError, match="Estimator.early_stop must be a trainer.EarlyStop instance, got str"
    ):
        trainer.Estimator(MLP(), str(tmp_path), early_stop="accuracy")


OLD = """
Estimator.global_batch_size = 64
Estimator.save_checkpoints_steps = 1000
Estimator.keep_checkpoint_max = 5
Estimator.clip_gradient_norm = None
Estimator.num_devices = 'auto'
train/Estimator.warm_start_from = None
"""
NEW = """
Estimator.global_batch_size = 64
Checkpoints.every_steps = 1000
Checkpoints.keep = 5
Optimization.clip_gradient_norm = None
Devices.count = 'auto'
train/WarmStart.source = None
"""


def test_a_config_saved_before_the_groups_is_read_under_the_names_now():
    assert config_diff.renamed(config_diff.bindings(OLD)) == config_diff.bindings(NEW)
    assert config_diff.changes(OLD, NEW) == []
    changed = NEW.replace("clip_gradient_norm = None", "clip_gradient_norm = 1.0")
    assert [str(c) for c in config_diff.changes(OLD, changed)] == [
        "Optimization.clip_gradient_norm: None -> 1.0"
    ]
    resumable = NEW.replace("Checkpoints.keep = 5", "Checkpoints.keep = 3")
    assert config_diff.changes(OLD, resumable, gin_config.RESUMABLE) == []


def test_a_configurable_named_shorter_by_another_process_is_the_same_binding():
    """A process that imported one input_fn writes ``input_fn.count``; one that imported
    two writes ``reversal.input_fn.count``: a resume compares them as one binding."""
    import datasets.reversal  # noqa: F401 - registers reversal.input_fn
    import datasets.text  # noqa: F401 - and text.input_fn: 'input_fn' is ambiguous here
    from trainer import config_diff

    written_alone = "reversal.input_fn.count = 3\nexperiment.input_fn = @reversal.input_fn"
    assert config_diff.changes(written_alone, written_alone) == []
    assert config_diff.own_selector("Seq2Seq") == "Seq2Seq"  # not imported: as it is
    assert config_diff.own_selector("input_fn") == "input_fn"  # ambiguous: as it is
    import models.mlp  # noqa: F401

    assert config_diff.own_selector("models.mlp.MLP") == "MLP"  # the shortest unique here
    old, new = "models.mlp.MLP.dropout_rate = 0.1", "MLP.dropout_rate = 0.2"
    assert [str(c) for c in config_diff.changes(old, new)] == ["MLP.dropout_rate: 0.1 -> 0.2"]
