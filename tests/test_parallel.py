"""Several devices: make_parallel and towers, tf.distribute strategies, two workers.

Logical CPU devices must be made before TensorFlow starts, so the device runs happen
in subprocesses (tests/support/parallel_runs.py, and the CLI for multi-worker).
"""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import datasets.digits
from models.mlp import MLP
from tests.support import guides
from tests.support.commands import REPO, digits_args, run_cli
from tests.support.helpers import on_two_cpus
from tests.support.workers import free_ports, run_local_workers, tf_config
from trainer import Estimator, UserError, batch_statistics
from trainer.distributed import cluster, devices, strategies, towers
from trainer.distributed.devices import check as check_devices
from trainer.settings import Devices, Summaries

DEVICES = ["/CPU:0"] * 3  # the shard logic does not care that they are one device


def test_split_gives_shards_one_apart_in_batch_order():
    batch = {"x": tf.reshape(tf.range(20), [10, 2]), "y": tf.range(10)}
    shards, sizes = towers.split(batch, 4)
    assert sizes.numpy().tolist() == [3, 3, 2, 2]
    assert [s["y"].numpy().tolist() for s in shards] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert shards[3]["x"].numpy().tolist() == [[16, 17], [18, 19]]
    _, sizes = towers.split(tf.zeros([2, 5]), 4)
    assert sizes.numpy().tolist() == [1, 1, 0, 0]


def test_make_parallel_concatenates_tower_outputs_in_order():
    layer = keras.layers.Dense(3, kernel_initializer="ones")
    x = tf.reshape(tf.range(14, dtype=tf.float32), [7, 2])
    out = towers.make_parallel(lambda x: {"y": layer(x), "x": x}, DEVICES, x=x)
    np.testing.assert_allclose(out["y"].numpy(), layer(x).numpy())
    np.testing.assert_array_equal(out["x"].numpy(), x.numpy())
    assert len(layer.weights) == 2  # one set of variables, shared by the towers


def test_towers_give_the_full_batch_loss_gradient_and_metrics():
    keras.utils.set_random_seed(1)
    dense = keras.layers.Dense(4)
    x, y = tf.random.normal([11, 3]), tf.random.normal([11, 4])

    def forward(features, labels):
        per_example = tf.reduce_mean((dense(features) - labels) ** 2, axis=1)
        return tf.reduce_mean(per_example), {"first": per_example[0]}, {"error": per_example}

    with tf.GradientTape() as tape:
        loss, _, per_example = forward(x, y)
    expected = tape.gradient(loss, dense.trainable_variables)

    def with_gradients(features, labels):  # each tower takes its own shard's gradients
        with tf.GradientTape() as tape:
            loss, scalars, per_example = forward(features, labels)
        return loss, scalars, per_example, tape.gradient(loss, dense.trainable_variables)

    tower_loss, _, tower_per_example, grads = towers.Towers(DEVICES).run(with_gradients, x, y)
    np.testing.assert_allclose(tower_loss.numpy(), loss.numpy(), rtol=1e-6)
    np.testing.assert_allclose(tower_per_example["error"].numpy(), per_example["error"].numpy())
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_each_towers_forward_and_gradient_ops_run_on_its_device_and_only_the_sum_crosses(
    tmp_path,
):
    """make_parallel's colocated gradients, checked op by op in the traced step."""
    ops = on_two_cpus("tests.support.towers", "tower_placement", str(tmp_path))
    for i in (0, 1):
        mine = [op for op in ops if op["tower"] == i and not op["shared"]]
        assert {op["device"] for op in mine} == {f"/device:CPU:{i}"}
        gradients = [op for op in mine if op["name"].startswith("gradient_tape/")]
        assert sum(op["type"] == "MatMul" for op in mine) == 2 + 3  # forward, gradients
        assert {"MatMul", "ReluGrad", "BiasAddGrad"} <= {op["type"] for op in gradients}
        # A tower reads its own ops' outputs and the shared parameters, nobody else's.
        assert all(op["reads"] in ([], [i]) for op in mine), i
    # Outside the towers, what reads their outputs is the weighted sum of the losses
    # and gradients, and the batch's per-example values put back together.
    readers = {op["type"] for op in ops if op["tower"] is None and op["reads"]}
    assert readers == {"AddN", "MulNoNan", "ConcatV2"}, readers


@pytest.mark.slow
def test_the_several_optimizer_steps_ops_run_on_their_towers_devices_too(tmp_path):
    """The GAN's step (two losses, two optimizers, one persistent tape per tower):
    every forward and gradient op of tower i on device i, for both groups."""
    ops = on_two_cpus("tests.support.towers", "tower_placement", str(tmp_path), "gan")
    for i in (0, 1):
        mine = [op for op in ops if op["tower"] == i and not op["shared"]]
        assert {op["device"] for op in mine} == {f"/device:CPU:{i}"}
        gradients = {op["type"] for op in mine if op["name"].startswith("gradient_tape/")}
        # The generator's ReLU and sigmoid, the discriminator's leaky ReLU, both Dense.
        assert {"MatMul", "ReluGrad", "LeakyReluGrad", "SigmoidGrad", "BiasAddGrad"} <= gradients
        assert all(op["reads"] in ([], [i]) for op in mine), i
    readers = {op["type"] for op in ops if op["tower"] is None and op["reads"]}
    assert readers == {"AddN", "MulNoNan", "ConcatV2"}, readers


def test_towers_update_batch_norm_statistics_from_the_whole_batch():
    keras.utils.set_random_seed(1)
    dense, norm = keras.layers.Dense(4), keras.layers.BatchNormalization(momentum=0.5)
    x = tf.random.normal([11, 3])

    def forward(features, labels):
        outputs = norm(dense(features), training=True)
        return tf.reduce_mean(outputs), {}, {}, None

    forward(x, None)
    start = [v.numpy() for v in norm.non_trainable_variables]
    forward(x, None)
    whole_batch = [v.numpy() for v in norm.non_trainable_variables]
    for v, value in zip(norm.non_trainable_variables, start, strict=True):
        v.assign(value)
    towers.Towers(
        DEVICES,
        batch_statistics.Parts(
            norm.non_trainable_variables,
            [batch_statistics.Moments(norm.moving_mean, norm.moving_variance, 0.5)],
        ),
    ).run(forward, x, None)
    # The mean of the shard means, weighted by shard size, is the batch mean, and the
    # variance adds the spread of the shards' means (the law of total variance); the
    # TF1 recipe took the statistics of the first tower's shard only.
    for found, expected in zip(norm.non_trainable_variables, whole_batch, strict=True):
        np.testing.assert_allclose(found.numpy(), expected, rtol=1e-5, atol=1e-6)

    # Evaluation leaves the statistics exactly as they were (shard sizes 4, 4, 3).
    before = norm.moving_mean.numpy()
    evaluating = towers.Towers(DEVICES, batch_statistics.Parts(norm.non_trainable_variables))
    evaluating.run(
        lambda features, _: (tf.reduce_mean(norm(features, training=False)), {}, {}, None),
        dense(x),
        None,
        training=False,
    )
    np.testing.assert_array_equal(norm.moving_mean.numpy(), before)


def device_runs(tmp_path, data_dir, *groups):
    """Runs each group of RUNs in its own process, the processes side by side."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(REPO, "tests", "support", "parallel_runs.py"),
                str(tmp_path / str(i)),
            ]
            + [data_dir, *runs],
            cwd=REPO,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, runs in enumerate(groups)
    ]
    results = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            results.update(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return results


def assert_same_training(run, reference, rtol=1e-5):
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=rtol)
    # The logged gradient norm (of each block's last step), under strategies too.
    assert np.all(np.isfinite(run["gradient_norms"]))
    np.testing.assert_allclose(run["gradient_norms"], reference["gradient_norms"], rtol=rtol * 10)
    for w, r in zip(run["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(w, r, rtol=rtol, atol=rtol / 10)
    assert run["metrics"]["accuracy"] == pytest.approx(reference["metrics"]["accuracy"])


@pytest.mark.slow
def test_one_two_and_four_devices_train_alike(tmp_path, data_dir):
    """50 steps at one global batch: same loss curve and weights on 1, 2 and 4 devices,
    with and without clipping the gradient's global norm, and with mixed batches."""
    runs = device_runs(
        tmp_path,
        data_dir,
        ["towers:1@128", "towers:2@128", "towers:4@128", "mirrored:2@128"]
        + ["towers:1@30", "towers:4@30"]  # 30 examples on 4 towers: shards of 8, 8, 7, 7
        + ["towers:1@128/keras", "towers:1@128/keras+clip", "mirrored:2@128/clip"]
        + ["towers:1@128/compiled+keras", "towers:2@128/compiled+keras"]
        + ["mirrored:2@128/compiled+keras", "mirrored:2@128/keras+clip+micro4"]
        + ["towers:1@128/mix", "towers:2@128/mix", "towers:1@128/keras+mix"]
        + ["mirrored:2@128/keras+mix"],
        # Two MirroredStrategies of different sizes cannot share a process's collectives.
        ["mirrored:4@128", "towers:4@30/micro4"],
    )
    reference = runs["towers:1@128"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it did learn
    for run in ["towers:2@128", "towers:4@128"]:
        assert_same_training(runs[run], reference)
    assert_same_training(runs["towers:4@30"], runs["towers:1@30"])
    # Micro-batches: 30 examples in slices of 7, 8, 7, 8, each on 4 towers.
    assert_same_training(runs["towers:4@30/micro4"], runs["towers:1@30"])
    # Strategies run Keras's Adam update, one device and towers the fused kernel: the
    # same arithmetic, rounded otherwise, which Adam's division by sqrt(v) amplifies
    # (1e-4 relative in some weights after 50 steps). So they compare with Keras's.
    for run in ["mirrored:2@128", "mirrored:4@128"]:
        assert_same_training(runs[run], runs["towers:1@128/keras"])
    # Clipping acts on the summed gradient under a strategy too: the same weights.
    clipped = runs["towers:1@128/keras+clip"]
    unclipped = runs["towers:1@128/keras"]
    assert abs(clipped["losses"][-1] - unclipped["losses"][-1]) > 0.01  # the clipping acted
    assert_same_training(runs["mirrored:2@128/clip"], clipped)
    assert_same_training(runs["mirrored:2@128/keras+clip+micro4"], clipped)  # summed, clipped
    # A compiled Keras model trains alike everywhere, and holds the weights afterwards.
    compiled = runs["towers:1@128/compiled+keras"]
    assert compiled["losses"][-1] < compiled["losses"][0] - 0.5
    for run in ["towers:2@128/compiled+keras", "mirrored:2@128/compiled+keras"]:
        assert_same_training(runs[run], compiled)
    for run in [r for r in runs if "compiled" in r]:
        np.testing.assert_allclose(runs[run]["keras_predict"], runs[run]["predict"], atol=1e-5)
    # MixUp and CutMix mix the same pairs whatever the devices: the same training.
    mixed = runs["towers:1@128/mix"]
    assert abs(mixed["losses"][0] - reference["losses"][0]) > 0.01  # the batches were mixed
    assert_same_training(runs["towers:2@128/mix"], mixed)
    assert_same_training(runs["mirrored:2@128/keras+mix"], runs["towers:1@128/keras+mix"])


def test_device_settings_that_cannot_run_are_refused():
    with pytest.raises(UserError) as error:  # from Python, with the CPU not split
        strategies.choose_devices(3)
    assert str(error.value) == (
        "num_devices=3 but this machine has 1 CPU device and no GPU: /device:CPU:0; ask for "
        "at most 1 or use 'auto' (or call trainer.split_cpu(3) before TensorFlow "
        "starts, as python -m trainer --num_devices does, to try it on logical CPUs)"
    )
    with pytest.raises(UserError, match="global_batch_size 3 is smaller than the 4 devices"):
        check_devices("towers", 4, 3, False)
    with pytest.raises(UserError, match="30 does not divide over the 4 replicas.*'towers'"):
        check_devices("mirrored", 4, 30, False)
    with pytest.raises(UserError, match="jit_compile"):
        check_devices("towers", 2, 32, True)
    with pytest.raises(UserError, match="distribution must be one of auto, towers, mirrored"):
        Estimator(MLP(num_classes=10), "/tmp/unused", devices=Devices(distribution="mirror"))


def test_auto_is_all_reduce_over_gpus_and_towers_elsewhere(caplog):
    gpus = [f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(8)]
    cpus = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    assert devices.choose("auto", gpus, 256) == "mirrored"
    assert devices.choose("auto", gpus[:2], 128) == "mirrored"
    assert devices.choose("auto", gpus[:1], 128) == "towers"  # one device: no split
    assert devices.choose("auto", cpus, 128) == "towers"  # logical CPUs share memory
    assert devices.choose("towers", gpus, 256) == "towers"  # what is asked is kept
    caplog.set_level("INFO")
    assert devices.choose("auto", gpus, 100) == "towers"  # 100 does not divide by 8
    assert "Global batch 100 does not divide over 8 GPUs: towers" in caplog.text


def train_locally(data_dir, model_dir, max_steps):
    """The same MLP and global batch as the workers' run, in this process."""
    keras.utils.set_random_seed(0)
    estimator = Estimator(
        MLP(num_classes=10, hidden_units=[256, 256], dropout_rate=0.0),
        str(model_dir),
        global_batch_size=64,
        seed=0,
        summaries=Summaries(write_graph=False),
    )
    input_fn = lambda mode, params: datasets.digits.input_fn(mode, params, data_dir=data_dir)  # noqa: E731
    if max_steps:
        estimator.train(input_fn, max_steps)
    return estimator.evaluate(input_fn)


@pytest.mark.slow
def test_two_workers_train_one_model_that_restores_on_one_device(tmp_path, data_dir):
    model_dir = tmp_path / "run"
    settings = ("experiment.max_steps = 60", "Checkpoints.every_steps = 30")
    proc = run_local_workers(data_dir, model_dir, 2, *settings)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # The chief wrote the run, one set of checkpoints; worker 1 removed what it saved.
    assert tf.train.latest_checkpoint(model_dir).endswith("ckpt-60")
    assert (model_dir / "operative_config.gin").exists() and (model_dir / "train").is_dir()
    written = [
        os.path.relpath(os.path.join(r, n), model_dir)
        for r, _, ns in os.walk(model_dir)
        for n in ns
    ]
    assert sorted(p for p in written if "ckpt-" in p) == [
        f"ckpt-{s}.{e}" for s in (30, 60) for e in ("data-00000-of-00001", "index")
    ]

    # The chief's checkpoint restores into a one-device evaluate, and the two-worker
    # run (each worker reads its half of the data) learned as much as one process.
    distributed = train_locally(data_dir, model_dir, max_steps=0)
    single = train_locally(data_dir, tmp_path / "single", max_steps=60)
    assert distributed["accuracy"] == pytest.approx(single["accuracy"], abs=0.05)
    assert distributed["loss"] == pytest.approx(single["loss"], rel=0.2)
    assert distributed["accuracy"] > 0.8


@pytest.mark.slow
@pytest.mark.parametrize(
    "tf_config, line",
    [
        (
            '{"cluster": {"worker": ["127.0.0.1:1"]}}',
            "TF_CONFIG must be JSON like {.*}; its 'task' is missing or not an object",
        ),
        (
            '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
            '"task": {"type": "worker", "index": "1"}}',
            "TF_CONFIG task index must be a number, got '1' \\(str\\): write \"index\": 1",
        ),
    ],
)
def test_a_malformed_tf_config_is_one_line_and_leaves_no_model_dir(tmp_path, tf_config, line):
    proc = run_cli(
        "--gin_file",
        "experiments/digits_mlp.gin",
        "--model_dir",
        str(tmp_path / "run"),
        "--gin_param",
        "Devices.distribution = 'multi_worker'",
        env={"TF_CONFIG": tf_config},
    )
    assert proc.returncode == 2
    assert re.fullmatch(f"error: {line}", proc.stderr.strip()), proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "tf_config, line",
    [
        (
            "{not json",
            r"TF_CONFIG must be JSON like .*; it is not JSON \(Expecting property name.*",
        ),
        (
            '{"cluster": {"worker": ["a:1"], "evaluator": ["b:2"]}, "task": {"type": '
            '"evaluator", "index": 0}}',
            "TF_CONFIG task type 'evaluator' is not one this trainer runs: give each machine "
            "'worker' (or one 'chief'); an evaluator beside training is --schedule "
            "continuous_eval, run without TF_CONFIG",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
            "TF_CONFIG task type 'chief' has no list in its cluster",
        ),
        (
            '{"cluster": {"worker": ["a:1", "b"]}, "task": {"type": "worker", "index": 0}}',
            "TF_CONFIG cluster 'worker' has address 'b'; give each as 'host:port'",
        ),
        (
            '{"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}',
            "TF_CONFIG cluster 'worker' must be a list of 'host:port', got 'a:1'",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 2}}',
            "TF_CONFIG task index 2 is outside its 1 workers",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": true}}',
            'TF_CONFIG task index must be a number, got True (bool): write "index": 0',
        ),
    ],
)
def test_each_tf_config_mistake_is_named_before_anything_starts(monkeypatch, tf_config, line):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(UserError) as refused:
        cluster.find()
    said = str(refused.value)
    assert said == line or line.startswith("TF_CONFIG must") and re.fullmatch(line, said), said
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"index": 1}}')
    assert cluster.find().where == ("worker 1 of 2", "b:2")


@pytest.mark.slow
def test_num_devices_on_a_machine_without_gpus_splits_its_cpu(tmp_path, data_dir):
    """The command line splits the CPU before TensorFlow starts, and says why."""
    args = digits_args(data_dir, tmp_path / "run", "--gin_param", "experiment.max_steps = 20")
    proc = run_cli(*args, "--num_devices", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(
        "No GPU here: the CPU is split into 2 logical devices to try multi-device training on "
        "(for trying and testing: it is not faster than one)\n"
    )
    assert "on 2 devices (CPU:0, CPU:1), towers" in proc.stdout


def eval_run(model_dir, data_dir, setup, train_steps=0, env=None):
    """Starts tests/support/eval_runs.py: evaluates (after training, with ``train_steps``)."""
    args = [str(model_dir), data_dir, setup, *([str(train_steps)] if train_steps else [])]
    return subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "support", "eval_runs.py"), *args],
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def evaluated(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_evaluation_is_split_over_replicas_and_workers_and_counts_each_example_once(
    tmp_path, data_dir
):
    """One checkpoint evaluated on 1 device, 2 and 4 replicas and 2 workers: the same
    metrics, confusion matrix and PR curve, each of the 360 examples once (batches of 50
    split unevenly, a last batch of 10), and each replica evaluating about its share."""
    model_dir = tmp_path / "run"
    reference = evaluated(eval_run(model_dir, data_dir, "towers:1", train_steps=30))
    assert reference["counts"] == [360.0]
    # Streamed Keras metrics over the whole set: scikit-learn's of the same predictions
    # (AUC within Keras's 200 thresholds' approximation; precision exactly).
    ours, theirs = reference["metrics"], reference["sklearn"]
    assert abs(ours["even_auc"] - theirs["even_auc"]) < 0.005, (ours, theirs)
    assert ours["even_precision"] == pytest.approx(theirs["even_precision"], abs=1e-6)
    # The confusion matrix and per-class figures: scikit-learn's of the same predictions;
    # the PR curve's counts: those of the thresholds applied to each probability.
    ours, theirs = reference["classes"], reference["sklearn_classes"]
    assert ours["confusion_matrix"] == theirs["confusion_matrix"]
    for name in ("precision", "recall"):
        assert ours[name] == pytest.approx(theirs[name], abs=1e-12), name
    assert ours["support"] == theirs["support"] and sum(ours["support"]) == 360
    assert reference["pr_curve_3"][:2] == reference["direct_pr_3"]
    ports = free_ports(2)
    runs = {
        "towers:2": [eval_run(model_dir, data_dir, "towers:2")],
        "mirrored:2": [eval_run(model_dir, data_dir, "mirrored:2")],
        "mirrored:4": [eval_run(model_dir, data_dir, "mirrored:4")],
        "2 workers": [
            eval_run(model_dir, data_dir, "multi_worker:1", env={"TF_CONFIG": tf_config(ports, i)})
            for i in range(2)
        ],
    }
    for name, processes in runs.items():
        results = [evaluated(p) for p in processes]
        counts = [c for result in results for c in result["counts"]]
        assert sum(counts) == 360, (name, counts)
        assert all(abs(c - 360 / len(counts)) <= 50 for c in counts), (name, counts)
        for result in results:  # every worker reports the metrics of the whole set
            for metric, value in reference["metrics"].items():
                assert result["metrics"][metric] == pytest.approx(value, rel=1e-6), name
            assert result["classes"] == reference["classes"], name  # summed exactly
            assert result["pr_curve_3"] == reference["pr_curve_3"], name


def in_slurm_step(monkeypatch, **variables):
    """SLURM's variables of a task of a job step on nodes gpu-node07 and gpu-node08."""
    for name, value in {"STEP_NODELIST": "gpu-node[07-08]", **variables}.items():
        monkeypatch.setenv(f"SLURM_{name}", value)


def test_the_cluster_is_found_in_a_slurm_job_step_or_its_absence_named(monkeypatch):
    """srun's variables for a 2-task step on two nodes, no TF_CONFIG and no SLURM here."""
    monkeypatch.setenv("TF_CONFIG", "")  # as unset, and restored after the find below sets it
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    with pytest.raises(UserError) as error:
        cluster.find()
    assert str(error.value) == (
        "distribution 'multi_worker' needs its cluster: TF_CONFIG is not set and this is not "
        "a task of a SLURM job step (SLURM_PROCID and SLURM_STEP_NODELIST are not set); set "
        "TF_CONFIG on each worker (see docs/guide/parallel.md, 'Several machines'), or start "
        "the workers with srun"
    )
    in_slurm_step(monkeypatch, PROCID="1", STEP_NUM_TASKS="2", STEP_TASKS_PER_NODE="1(x2)")
    assert cluster.find().where == ("worker 1 of 2", "gpu-node08:8888")
    assert json.loads(os.environ["TF_CONFIG"]) == {
        "cluster": {"worker": ["gpu-node07:8888", "gpu-node08:8888"]},
        "task": {"type": "worker", "index": 1},
    }


def test_slurm_tasks_sharing_a_node_get_their_gpus_and_their_jobs_ports(monkeypatch):
    """Job 4242's step of 4 tasks, 2 on each of two nodes, with SLURM's --gres=gpu:4: each
    task gets its half of the node's GPUs before TensorFlow lists a device, and ports
    chosen by the job id (two jobs on one node no longer both take 8888); fewer GPUs than
    tasks is one line; SLURM's own per-task GPUs and reserved ports are kept."""
    monkeypatch.setenv("TF_CONFIG", "")  # as unset, and restored after find() sets it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # --gres=gpu:4 sets it per job
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)

    def listed(*args):
        raise AssertionError("TensorFlow listed devices before the GPUs were shared out")

    monkeypatch.setattr(tf.config, "list_physical_devices", listed)
    in_slurm_step(
        monkeypatch,
        JOB_ID="4242",
        PROCID="3",
        LOCALID="1",
        STEP_NUM_TASKS="4",
        STEP_TASKS_PER_NODE="2(x2)",
    )
    base = 10000 + 4242 % 687 * 32
    assert cluster.find().where == ("worker 3 of 4", f"gpu-node08:{base + 1}")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"] == [
        f"gpu-node07:{base}",
        f"gpu-node07:{base + 1}",
        f"gpu-node08:{base}",
        f"gpu-node08:{base + 1}",
    ]
    assert cluster.slurm_port_base() != cluster.PORT_BASE

    # srun --resv-ports, and --gpus-per-task (SLURM bound the task's own GPU already).
    monkeypatch.setenv("SLURM_STEP_RESV_PORTS", "12000-12001")
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    config = json.loads(cluster.slurm_tf_config())
    assert config["cluster"]["worker"][3] == "gpu-node08:12001"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"

    # Two tasks on a node of one GPU: one line (the resolver divided by zero).
    monkeypatch.delenv("SLURM_GPUS_PER_TASK")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(UserError) as error:
        cluster.slurm_tf_config()
    assert str(error.value) == (
        "2 tasks of this job step share 1 GPU(s) on gpu-node08: start at most 1 per node "
        "(srun --ntasks-per-node=1), or give each task its own with --gpus-per-task"
    )
    # No GPU at all (this machine): nothing to share, nothing set.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert json.loads(cluster.slurm_tf_config())["task"] == {"type": "worker", "index": 3}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.slow
def test_cost_model_counts_what_towers_and_the_ring_move():
    """benchmarks/costs.py: the guide's table of what a step costs on many GPUs."""
    from benchmarks import costs

    mlp = costs.describe("MLP", MLP(num_classes=10, hidden_units=[512, 512]), (28, 28, 1))
    assert mlp.parameters == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert mlp.forward_flops == 2 * (784 * 512 + 512 * 512 + 512 * 10)  # the matmuls
    g = mlp.gradient_bytes
    one = costs.step(mlp, 8, 1, link=1e9, gpu=1e12)
    assert one.towers_bytes == 7 * g and one.ring_bytes == 2 * 7 / 8 * g
    assert one.towers == 7 * g / 1e9
    four = costs.step(mlp, 8, 4, link=1e9, gpu=1e12)  # the first machine's card
    assert four.towers_bytes == 24 * g and four.ring_bytes == 2 * 31 / 32 * g
    two = costs.step(mlp, 2, 1, link=1e9, gpu=1e12)
    assert two.towers_bytes == two.ring_bytes == g  # alike at 2 devices
    rows = costs.table([mlp])
    assert len(rows) == 2 + 5 and rows[4].startswith("| MLP | 8 | NVLink 4 | 18.8 MB / 4.7 MB")
    networks = costs.networks()  # ImageNet's AlexNet and ResNet-50 traced, once
    shown = costs.table(networks)  # what benchmarks/devices.py prints
    assert "\n".join(shown) in guides.text()
    alexnet = networks[0]
    assert alexnet.parameters == 62_378_344  # experiments/alexnet_imagenet.gin's count
