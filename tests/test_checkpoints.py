"""Checkpoints on their own: round trip, what is kept, mismatches, config record, warm start."""

import json
import os

import keras
import pytest
import tensorflow as tf

from tests.support.commands import digits_args
from tests.support.helpers import checkpoint_steps
from trainer import ModelFn, Spec, UserError, checkpoint_writer, checkpoints, warm_start


class Two(ModelFn):
    """Two Dense layers, so a warm start can take one and leave the other."""

    def __init__(self, width=4):
        super().__init__()
        self.body = keras.layers.Dense(width, name="body")
        self.head = keras.layers.Dense(1, name="head")

    def __call__(self, features, labels, mode):
        y = self.head(self.body(features["x"]))[:, 0]
        return Spec({"y": y}, loss=tf.reduce_mean(y) if labels is not None else None)


def built(width=4, value=None):
    model = Two(width)
    model({"x": tf.zeros([1, 3])}, None, "infer")
    if value is not None:
        for v in model.trainable_variables:
            v.assign(tf.fill(v.shape, value))
    return model


def test_the_newest_checkpoint_comes_back_and_only_the_last_ones_are_kept(tmp_path):
    model, step = built(value=1.0), tf.Variable(0, dtype=tf.int64)
    saver = checkpoint_writer.Checkpointer(str(tmp_path), 2, model=model, step=step)
    for s in (10, 20, 30):
        step.assign(s)
        saver.save(s)
    assert checkpoint_steps(tmp_path) == [20, 30]
    assert checkpoints.step_of(checkpoints.latest_checkpoint(str(tmp_path))) == 30
    fresh, fresh_step = built(value=0.0), tf.Variable(0, dtype=tf.int64)
    loader = checkpoint_writer.Checkpointer(str(tmp_path), model=fresh, step=fresh_step)
    assert loader.restore_latest().endswith("ckpt-30")
    assert int(fresh_step.numpy()) == 30
    assert float(fresh.body.kernel.numpy()[0, 0]) == 1.0
    assert checkpoints.saved_ints(loader.latest, step=-1, absent=7) == {"step": 30, "absent": 7}
    assert checkpoints.saved_ints(None, step=-1) == {"step": -1}


def test_a_checkpoint_of_another_model_is_named_in_one_line(tmp_path):
    checkpoint_writer.Checkpointer(str(tmp_path), model=built(width=4)).save(1)
    other = checkpoint_writer.Checkpointer(str(tmp_path), model=built(width=5))
    with pytest.raises(UserError) as raised:
        other.restore_latest()
    message = str(raised.value)
    assert "\n" not in message
    assert "does not fit this model" in message and "body/kernel" in message
    assert "new --model_dir" in message


def test_the_config_record_guards_resume_and_keeps_the_text(tmp_path):
    seen = []
    record = checkpoints.ConfigRecord(str(tmp_path), lambda: "a = 1\n", lambda *t: seen.append(t))
    with pytest.raises(UserError, match="has checkpoints but no operative_config.gin"):
        record.check()  # called when checkpoints exist: without a record, nothing to check
    assert seen == []
    assert record.write() == "a = 1\n"
    assert (tmp_path / checkpoints.OPERATIVE_CONFIG).read_text() == "a = 1\n"
    checkpoints.ConfigRecord(str(tmp_path), lambda: "a = 2\n", lambda *t: seen.append(t)).check()
    assert seen == [("a = 1\n", "a = 2\n")]
    assert checkpoints.ConfigRecord(str(tmp_path), None, None).write() is None


def test_a_warm_start_takes_only_the_weights_its_pattern_names(tmp_path):
    checkpoint_writer.Checkpointer(str(tmp_path), model=built(value=3.0)).save(5)
    model = built(value=0.0)
    warm_start.warm_start(model, str(tmp_path), pattern="^body")
    assert float(model.body.kernel.numpy()[0, 0]) == 3.0
    assert float(model.head.kernel.numpy()[0, 0]) == 0.0
    with pytest.raises(UserError, match="cannot warm-start from .*nowhere"):
        warm_start.warm_start(model, os.path.join(str(tmp_path), "nowhere"))


def test_a_relative_model_dir_lists_restores_warm_starts_and_names_damage(tmp_path, monkeypatch):
    """As a user types it: ``output/run``, relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    model, step = built(value=1.0), tf.Variable(0, dtype=tf.int64)
    saver = checkpoint_writer.Checkpointer("output/run", 5, model=model, step=step)
    for s in (10, 20):
        step.assign(s)
        saver.save(s)
    assert checkpoints.all_checkpoints("output/run") == ["output/run/ckpt-10", "output/run/ckpt-20"]
    assert checkpoints.latest_checkpoint("output/run") == "output/run/ckpt-20"
    again = checkpoint_writer.Checkpointer("output/run", 5, model=built(value=0.0), step=step)
    assert again.restore_latest() == "output/run/ckpt-20"
    warm = built(value=0.0)
    warm_start.warm_start(warm, "output/run", "^body")
    assert float(warm.body.kernel[0, 0]) == 1.0 and float(warm.head.kernel[0, 0]) == 0.0
    os.remove("output/run/ckpt-20.index")
    with pytest.raises(UserError) as raised:
        checkpoints.latest_checkpoint("output/run")
    assert str(raised.value) == (
        "checkpoint output/run/ckpt-20 is damaged (ckpt-20.index is missing); intact: "
        "ckpt-10; move ckpt-20.* out of output/run to resume from ckpt-10"
    )


@pytest.mark.parametrize(
    "pointer", [b"", b"\xff\xfe\x00binary", b'model_checkpoint_path: "../../etc/passwd"\n']
)
def test_an_empty_binary_or_foreign_checkpoint_list_is_rebuilt_from_the_files(tmp_path, pointer):
    model, step = built(value=1.0), tf.Variable(10, dtype=tf.int64)
    checkpoint_writer.Checkpointer(str(tmp_path), 5, model=model, step=step).save(10)
    (tmp_path / "checkpoint").write_bytes(pointer)
    assert checkpoints.latest_checkpoint(str(tmp_path)) == f"{tmp_path}/ckpt-10"


def test_checkpoints_listed_again_after_a_lost_list_are_still_deleted_past_the_last_ones(
    tmp_path,
):
    """The list rebuilt from the files keeps each checkpoint's time: without it TensorFlow
    kept every checkpoint listed forever (4 of keep_checkpoint_max = 2, and growing)."""
    model, step = built(value=1.0), tf.Variable(0, dtype=tf.int64)
    saver = checkpoint_writer.Checkpointer(str(tmp_path), 5, model=model, step=step)
    for s in (10, 20, 30, 40):
        saver.save(s)
    os.remove(tmp_path / "checkpoint")
    assert checkpoints.latest_checkpoint(str(tmp_path), repair=True).endswith("ckpt-40")
    rerun = checkpoint_writer.Checkpointer(str(tmp_path), 2, model=model, step=step)
    for s in (50, 60):
        rerun.save(s)
    assert checkpoint_steps(tmp_path) == [50, 60]
    assert [checkpoints.step_of(p) for p in checkpoints.all_checkpoints(str(tmp_path))] == [50, 60]


@pytest.mark.slow
def test_checkpoint_policies_hold_across_restarts_and_a_lost_list(tmp_path, data_dir, forked_cli):
    """The newest two, every multiple of 25 and the best export's step are kept and
    listed; after a restart, and after the list was lost, the same rule; a kept
    checkpoint is evaluated by its step."""
    model_dir = tmp_path / "run"
    policy = [
        "MLP.hidden_units = [32]",
        "Checkpoints.every_steps = 10",
        "Checkpoints.keep = 2",
        "Checkpoints.keep_every_steps = 25",  # saved there too, off the cadence
        "Checkpoints.keep_best = True",
        "BestExport.metric = 'loss'",
        "BestExport.higher = False",
        "experiment.eval_every_steps = 20",
        "experiment.eval_steps = 2",
    ]
    args = digits_args(data_dir, model_dir, *(a for b in policy for a in ("--gin_param", b)))

    def run(max_steps, *extra):
        proc = forked_cli.run(*args, "--gin_param", f"experiment.max_steps = {max_steps}", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        best = json.loads((model_dir / "export" / "best" / "best.json").read_text())
        saved = sorted({*range(10, max_steps + 1, 10), *range(25, max_steps + 1, 25)})
        kept = sorted({*saved[-2:], *range(25, max_steps + 1, 25), best[0]["step"]})
        assert checkpoint_steps(model_dir) == kept
        listed = checkpoints.all_checkpoints(str(model_dir))
        assert [checkpoints.step_of(p) for p in listed] == kept
        return proc

    run(60)
    run(80)  # restarted
    (model_dir / "checkpoint").unlink()
    assert f"found {len(checkpoint_steps(model_dir))} checkpoints by their files" in run(100).stderr
    results = tmp_path / "at25.json"
    evaluated = forked_cli.run(
        *args, "--schedule", "evaluate", "--checkpoint", "25", "--results", str(results)
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(results.read_text())["global_step"] == 25
    missing = forked_cli.run(*args, "--schedule", "export", "--checkpoint", "30")
    assert missing.returncode == 2 and missing.stderr.strip() == (
        f"error: no checkpoint of step 30 in {model_dir} (its checkpoints: "
        + ", ".join(map(str, checkpoint_steps(model_dir)))
        + "): name one of them, or keep more (Checkpoints.keep_every_steps)"
    )


def test_a_run_that_saved_in_the_background_lets_go_of_its_writer(tmp_path):
    """TensorFlow's async writer thread holds a copy of every variable until the process
    exits: each run ends it, so a notebook's runs do not pile up models. A second run
    of the same Estimator saves in the background again, whole."""
    import threading

    import trainer

    def writers():
        return [t for t in threading.enumerate() if "_async_save" in t.name]

    def input_fn(mode, params):
        x = tf.random.stateless_normal([64, 3], seed=[1, 2])
        return tf.data.Dataset.from_tensor_slices(({"x": x}, x[:, 0])).batch(8).repeat()

    before = len(writers())
    estimator = trainer.Estimator(
        Two(), str(tmp_path), global_batch_size=8, steps_per_loop=5, progress=False,
        checkpoints=trainer.Checkpoints(every_steps=5, background=True, input=False),
    )  # fmt: skip
    for steps in (10, 20):
        estimator.train(input_fn, steps)
        assert len(writers()) == before
        assert checkpoint_steps(tmp_path)[-1] == steps
    restored = checkpoint_writer.Checkpointer(str(tmp_path), model=built())
    assert restored.restore_latest(partial=True).endswith("ckpt-20")
