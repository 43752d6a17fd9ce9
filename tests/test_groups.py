"""Several optimizers (optimizer groups) and rules on variables (trainer/optimizer_groups.py)."""

import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from tests.support.body_head import BodyHead, built, estimator, weights
from tests.support.body_head import body_data as line_data
from tests.support.commands import REPO, run_cli
from tests.support.helpers import (
    checkpoint_steps,
    event_tags,
    on_two_cpus,
    saved_state,
    start,
    wait_for_checkpoint_after,
)
from trainer.settings import Devices, Optimization


def test_a_learning_rate_multiplier_scales_its_variables_update_and_no_other(tmp_path):
    """One step of Adam from the same weights: the body moves 0.1 x as far as without
    the rule, the head exactly as far (Adam's first step is linear in its rate)."""
    moved, first = {}, None
    for rule in ({}, {"^body/": 0.1}):
        run = estimator(
            BodyHead(),
            tmp_path / str(len(rule)),
            optimizer=keras.optimizers.Adam(0.01),
            optimization=Optimization(learning_rate_multipliers=rule),
        )
        before = first = built(run, first)
        run.train(line_data, 1)
        after = weights(run.model_fn)
        moved[len(rule)] = {k: np.abs(after[k] - before[k]) for k in before}
    for path in moved[0]:
        factor = 0.1 if path.startswith("body/") else 1.0
        np.testing.assert_allclose(moved[1][path], factor * moved[0][path], rtol=1e-4, atol=1e-9)
    assert all(moved[0][k].max() > 1e-4 for k in moved[0])


def test_frozen_variables_stay_bit_equal_until_their_step_then_move(tmp_path):
    run = estimator(
        BodyHead(), tmp_path, optimization=Optimization(frozen_until_step={"^body/": 3})
    )
    run.train(line_data, 1)
    first = weights(run.model_fn)
    for step in (2, 3):
        run.train(line_data, step)
        now = weights(run.model_fn)
        for path in ("body/kernel", "body/bias"):
            np.testing.assert_array_equal(now[path], first[path])
        assert not np.array_equal(now["head/kernel"], first["head/kernel"])
    run.train(line_data, 5)
    assert not np.array_equal(weights(run.model_fn)["body/kernel"], first["body/kernel"])
    units = {u.name: int(u.optimizer.iterations.numpy()) for u in run.model.plan.units}
    assert units == {"model": 5, "body": 2}  # applied at steps 3 and 4 only

    # Resumed in a new process-like Estimator: the frozen unit's state comes back.
    again = estimator(
        BodyHead(), tmp_path, optimization=Optimization(frozen_until_step={"^body/": 3})
    )
    again.train(line_data, 6)
    units = {u.name: int(u.optimizer.iterations.numpy()) for u in again.model.plan.units}
    assert units == {"model": 6, "body": 3}


@pytest.mark.slow
def test_no_weight_decay_leaves_the_matched_variables_undecayed(tmp_path):
    """One AdamW step from the same weights, with and without the biases excluded: the
    kernels move alike, the biases do not (decay pulls them to zero only without)."""
    trained, first = {}, None
    for excluded in ((), ("bias",)):
        run = estimator(
            BodyHead(),
            tmp_path / str(len(excluded)),
            optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.5),
            optimization=Optimization(no_weight_decay=excluded),
        )
        first = built(run, first)
        for v in run.model_fn.trainable_variables:  # biases start away from zero
            if "bias" in v.path:
                v.assign(0.5 * tf.ones_like(v))
        run.train(line_data, 1)
        trained[len(excluded)] = weights(run.model_fn)
    np.testing.assert_array_equal(trained[0]["body/kernel"], trained[1]["body/kernel"])
    # Decay takes learning rate x weight_decay x value off the bias: 0.01 x 0.5 x 0.5.
    np.testing.assert_allclose(
        trained[1]["body/bias"] - trained[0]["body/bias"], 0.01 * 0.5 * 0.5, rtol=1e-3
    )


@pytest.mark.parametrize(
    "optimization, message",
    [
        (
            dict(learning_rate_multipliers={"^encoder/": 0.1}),
            r"Optimization.learning_rate_multipliers pattern '\^encoder/' matches none of the "
            r"model's 4 trainable variables; their paths are like .*body/kernel",
        ),
        (  # refused as the group is made
            dict(frozen_until_step={"body": -1}),
            r"Optimization.frozen_until_step\['body'\] must be a step >= 0, got -1",
        ),
        (
            dict(learning_rate_multipliers={"(body": 0.1}),
            r"pattern '\(body' is not a regular expression",
        ),
        (
            dict(no_weight_decay=["bias"]),
            r"the optimizer of 'model' \(SGD\) has no weight_decay: use AdamW",
        ),
    ],
)
def test_a_rule_that_cannot_apply_is_refused_in_one_line(tmp_path, optimization, message):
    with pytest.raises(trainer.UserError, match=message):
        run = estimator(BodyHead(), tmp_path, optimization=Optimization(**optimization))
        run.train(line_data, 1)
    assert not (tmp_path / "checkpoint").exists()


def test_groups_with_their_own_losses_and_optimizers_update_only_their_variables(tmp_path):
    model = BodyHead(loss_per_group=True)
    model.groups = {"body": trainer.Group("^body/"), "head": trainer.Group(model.head)}
    run = estimator(
        model,
        tmp_path,
        optimizer={"body": keras.optimizers.SGD(0.0), "head": keras.optimizers.SGD(0.1)},
    )
    before = built(run)
    run.train(line_data, 4)
    after = weights(model)
    np.testing.assert_array_equal(after["body/kernel"], before["body/kernel"])  # rate 0
    assert not np.array_equal(after["head/kernel"], before["head/kernel"])
    result = run.evaluate(line_data)
    assert result["head_loss"] == pytest.approx(2 * result["body_loss"], rel=1e-6)
    assert result["loss"] == pytest.approx(3 * result["body_loss"], rel=1e-6)
    keys = [k for k, _ in tf.train.list_variables(str(tmp_path / "ckpt-4"))]
    assert any(k.startswith("optimizer/body/") for k in keys)
    assert any(k.startswith("optimizer/head/") for k in keys)
    assert {"learning_rate/body", "learning_rate/head", "body_loss"} <= event_tags(
        str(tmp_path / "train")
    )


@pytest.mark.parametrize(
    "groups, loss_per_group, optimizer, message",
    [
        (None, True, None, r"Spec.loss is a dict \('body', 'head'\) but the model declares no "),
        (
            {"body": trainer.Group("^body/")},
            False,
            None,
            r"variables head/kernel, head/bias are in none of its optimizer_groups\(\)",
        ),
        (
            {"body": trainer.Group("^body/"), "all": trainer.Group(".")},
            False,
            None,
            r"variable body/kernel is in group 'body' and in 'all'",
        ),
        (
            {"body": trainer.Group("^body/"), "tail": trainer.Group("^tail/")},
            False,
            None,
            r"group 'tail' pattern '\^tail/' matches none of the model's 4 trainable",
        ),
        (
            {"body": trainer.Group("^body/"), "head": trainer.Group("^head/")},
            False,
            {"body": keras.optimizers.SGD()},
            r"Estimator.optimizer has no optimizer for group 'head': the model's groups are "
            r"'body', 'head'; give one optimizer for each",
        ),
        (
            {"body": trainer.Group("^body/"), "head": trainer.Group("^head/", steps=2)},
            False,
            None,
            r"groups take turns only when each gives steps >= 1, got body None, head 2",
        ),
        (
            {"body": trainer.Group("^body/"), "head": "^head/"},
            False,
            None,
            r"optimizer_groups\(\)\['head'\] is a str: wrap it as trainer.Group",
        ),
        (
            {"x": trainer.Group("^body/"), "head": trainer.Group("^head/")},
            True,
            None,
            r"Spec.loss names 'body', 'head' but the optimizer groups are 'x', 'head'",
        ),
    ],
)
def test_a_group_mistake_is_refused_in_one_line(
    tmp_path, groups, loss_per_group, optimizer, message
):
    with pytest.raises(trainer.UserError, match=message):
        run = estimator(
            BodyHead(groups, loss_per_group),
            tmp_path,
            **({"optimizer": optimizer} if optimizer else {}),
        )
        run.train(line_data, 1)
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gan", "wgan"])
def test_groups_take_turns_alike_on_one_device_towers_and_mirrored(tmp_path, data_dir, kind):
    """Two discriminator steps, then one generator step: each optimizer counts its
    own updates; towers and mirrored replicas end where one device does. 'wgan' is
    WGAN-GP through its own train_step (gradients of gradients), 'gan' is clipped."""
    run = on_two_cpus(
        "tests.support.research_runs", "gan_on_devices", str(tmp_path), data_dir, kind
    )
    one = run["one"]
    assert one["iterations"] == {"discriminator": 20, "generator": 10}
    for name in ("towers", "mirrored"):
        other = run[name]
        assert other["iterations"] == one["iterations"], name
        for part in ("generator", "discriminator"):
            for a, b in zip(one[part], other[part], strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"{name} {part}")
        for metric, value in one["metrics"].items():
            assert other["metrics"][metric] == pytest.approx(value, rel=1e-4, abs=1e-6), name


@pytest.mark.slow
def test_the_gan_experiment_on_two_devices_and_killed_and_resumed(tmp_path, data_dir):
    """experiments/digits_gan.gin through the command line: --num_devices 2 gives the
    one device's losses at step 100; SIGKILL after a checkpoint, then the same command,
    ends bit-equal to an unbroken run (both optimizers' state included); TensorBoard
    holds both losses and generated digits that differ from one another."""
    common = [
        "--gin_file",
        "experiments/digits_gan.gin",
        "--schedule",
        "train_and_evaluate",
        *[
            arg
            for binding in (
                f"digits.input_fn.data_dir = '{data_dir}'",
                "experiment.deterministic = True",
                "experiment.max_steps = 400",
                "experiment.eval_every_steps = 100",
                "Checkpoints.every_steps = 100",
                "Estimator.steps_per_loop = 20",
                "Summaries.image_every_steps = 400",
            )
            for arg in ("--gin_param", binding)
        ],
    ]
    straight, two, killed = tmp_path / "straight", tmp_path / "two", tmp_path / "killed"
    proc = start([*common, "--model_dir", str(killed)])
    try:
        wait_for_checkpoint_after(killed, 0, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert checkpoint_steps(killed)[-1] < 400
    to_100 = ["--num_devices", "2", "--gin_param", "experiment.max_steps = 100"]  # compared there
    for model_dir, extra in ((straight, []), (two, to_100), (killed, [])):
        ran = run_cli(*common, "--model_dir", str(model_dir), *extra)
        assert ran.returncode == 0, ran.stderr[-3000:]
    # The two losses, as one device and two towers evaluate them at step 100.
    one, towers = (eval_rows(d)[100] for d in (straight, two))
    for name in ("discriminator_loss", "generator_loss", "loss"):
        assert towers[name] == pytest.approx(one[name], rel=1e-4), name

    expected, actual = saved_state(straight), saved_state(killed)
    assert {k.split("/")[1] for k in actual if k.startswith("optimizer/")} == {
        "discriminator",
        "generator",
    }
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(value, actual[key], err_msg=key)

    tags = event_tags(str(straight / "train"))
    assert {"discriminator_loss", "generator_loss", "predicted/generated"} <= tags
    generated = generated_images(str(straight / "train"))
    assert generated.shape == (8, 8, 8) and generated.std(axis=0).mean() > 0.05  # not one image


def eval_rows(model_dir):
    """metrics.jsonl's evaluations by step."""
    rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["writer"] == "eval_eval"}


def generated_images(log_dir):
    """The last generated images written to TensorBoard, as [n, 8, 8] in [0, 1]."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    encoded = tf.make_ndarray(acc.Tensors("predicted/generated")[-1].tensor_proto)[2:]
    return np.stack([tf.io.decode_png(png).numpy()[..., 0] / 255.0 for png in encoded])


class OwnStep(BodyHead):
    """BodyHead trained by its own train_step; ``mistake`` makes it misuse the optimizers."""

    def __init__(self, mistake=None, **kwargs):
        super().__init__(**kwargs)
        self.mistake = mistake

    def train_step(self, features, labels, optimizers):
        with tf.GradientTape() as tape:
            spec = self(features, labels, trainer.Mode.TRAIN)
        variables = self.trainable_variables
        gradients = tape.gradient(spec.loss, variables)
        if self.mistake == "stray":  # the head's optimizer given the body's gradients too
            optimizers["head"].apply(gradients, variables)
        elif self.mistake != "nothing":
            optimizers["model"].apply_gradients(zip(gradients, variables, strict=True))
        if self.mistake == "twice":
            optimizers["model"].apply(gradients)
        spec.scalars = {"gradient_norm_here": tf.linalg.global_norm(gradients)}
        return spec


def test_a_models_own_train_step_trains_as_the_declared_loss_does(tmp_path):
    """The same loss, by the framework's step and by the model's own: the same weights
    after 20 steps, and the step's own scalar in the training log."""
    ends, first = {}, None
    for name, model in (("declared", BodyHead()), ("own", OwnStep())):
        run = estimator(model, tmp_path / name, optimizer=keras.optimizers.Adam(0.01))
        first = built(run, first)
        run.train(line_data, 20)
        ends[name] = weights(model)
    for path, value in ends["declared"].items():
        np.testing.assert_allclose(ends["own"][path], value, rtol=1e-5, atol=1e-7, err_msg=path)
    assert "gradient_norm_here" in event_tags(str(tmp_path / "own" / "train"))


@pytest.mark.parametrize(
    "mistake, message",
    [
        ("twice", r"train_step applies optimizers\['model'\] twice in one step: apply each"),
        ("nothing", r"OwnStep.train_step applied no gradients with optimizers\['model'\]"),
        (
            "stray",
            r"train_step gives optimizers\['head'\] a gradient for body/kernel, which is not "
            r"in group 'head': apply it with its own group's optimizer",
        ),
    ],
)
def test_a_train_step_that_misuses_its_optimizers_is_refused_in_one_line(
    tmp_path, mistake, message
):
    groups = {"body": trainer.Group("^body/"), "head": trainer.Group("^head/")}
    model = OwnStep(mistake, groups=groups if mistake == "stray" else None)
    with pytest.raises(trainer.UserError, match=message):
        estimator(model, tmp_path).train(line_data, 1)
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.slow
def test_two_workers_train_the_gan_taking_turns_as_one_process_does(tmp_path, data_dir):
    """Two optimizers under multi_worker (worker processes on 127.0.0.1): each group's
    gradients all-reduced over the workers, the turns kept, the noise drawn where one
    process draws it; both workers end where one process ends."""
    from tests.support.workers import ENV, free_ports, tf_config

    ports = free_ports(2)
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "tests/support/research_runs.py",
                str(tmp_path / "run"),
                data_dir,
                "gan",
            ],
            cwd=REPO,
            env=dict(ENV, TF_CONFIG=tf_config(ports, i), PYTHONPATH=REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    one = on_one_device(tmp_path / "one", data_dir)
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err[-3000:]
        ended = json.loads(out.strip().splitlines()[-1])
        assert ended["iterations"] == one["iterations"] == {"discriminator": 20, "generator": 10}
        for part in ("generator", "discriminator"):
            for a, b in zip(one[part], ended[part], strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=part)


def on_one_device(model_dir, data_dir):
    done = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, str(model_dir), data_dir],
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


ONE_PROCESS = (
    "import json, sys\n"
    "from tests.support import lean_start\n"  # TensorFlow loads as the command line loads it
    "from tests.support.research_runs import train_gan\n"
    "print(json.dumps(train_gan(sys.argv[1], sys.argv[2], 'gan')))\n"
)


def test_one_loss_over_two_loss_scaled_groups_is_unscaled_by_the_scale_it_was_scaled_by(
    tmp_path,
):
    """mixed_float16, one loss, two groups whose scales differ (the head's twice the
    body's): each group's update is the one a single optimizer over both makes; the
    head's was exactly halved when each unscaled by its own scale."""

    def sgd(initial_scale):
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale)

    trainer.set_precision("mixed_float16")
    try:
        model = BodyHead()
        model.groups = {"body": trainer.Group("^body/"), "head": trainer.Group(model.head)}
        two = estimator(
            model, tmp_path / "two", optimizer={"body": sgd(2.0**8), "head": sgd(2.0**9)}
        )
        start = built(two)
        two.train(line_data, 3)
        one_model = BodyHead()
        one = estimator(one_model, tmp_path / "one", optimizer=sgd(2.0**8))
        built(one, start)
        one.train(line_data, 3)
    finally:
        trainer.set_precision(None)
    expected, found = weights(one_model), weights(model)
    for path, value in expected.items():
        np.testing.assert_allclose(found[path], value, rtol=1e-3, atol=1e-5, err_msg=path)
    scales = {g: float(o.dynamic_scale.numpy()) for g, o in two.optimizer.items()}
    assert scales == {"body": 2.0**8, "head": 2.0**8}  # one scale, kept by both


def test_groups_keep_loss_scaling_and_the_moving_average_per_group(tmp_path):
    """mixed_float16: each group's optimizer scales its own loss; EMA averages every
    group's weights and evaluation swaps them in."""
    trainer.set_precision("mixed_float16")
    try:
        model = BodyHead(loss_per_group=True)
        model.groups = {"body": trainer.Group("^body/"), "head": trainer.Group(model.head)}
        run = estimator(
            model,
            tmp_path,
            devices=Devices(mixed_precision="mixed_float16"),
            optimization=Optimization(ema_decay=0.5),
        )
        before = built(run)
        run.train(line_data, 6)
    finally:
        trainer.set_precision(None)
    assert set(run.optimizer) == {"body", "head"}
    for group, optimizer in run.optimizer.items():  # each its own scale: halved per overflow
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer), group
        applied = int(optimizer.iterations.numpy())
        assert 1 <= applied <= 6, group
        assert float(optimizer.dynamic_scale.numpy()) == 2.0**15 / 2 ** (6 - applied), group
    after = weights(model)
    assert all(not np.array_equal(after[k], before[k]) for k in before)
    averaged = run.model.ema.averages
    assert len(averaged) == 4 and all(np.isfinite(a.numpy()).all() for a in averaged)
    result = run.evaluate(line_data)
    assert np.isfinite(result["loss"]) and result["head_loss"] == pytest.approx(
        2 * result["body_loss"], rel=1e-3
    )
