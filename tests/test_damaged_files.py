"""Files a user or an earlier run wrote, damaged or misnamed, through ``python -m trainer``.

Each case runs against a copy of a trained model_dir (``model_dir``: checkpoints at
50 and 100) and checks the exit code, the one stderr line that names the file and the
fix, and that every other file in model_dir is byte for byte what it was. The commands
are forked from one process that has imported the command line (``forked_cli``).
"""

import json

import pytest

from tests.support.helpers import checkpoint_steps, dir_hash


@pytest.fixture
def run(forked_cli):
    """``run(model_dir, faulty_gin, *args, max_steps=150)``: the trained run's command."""

    def command(model_dir, faulty_gin, *args, max_steps=150):
        args = ("--gin_param", f"experiment.max_steps = {max_steps}", *args)
        return forked_cli.run("--gin_file", faulty_gin, "--model_dir", str(model_dir), *args)

    return command


def refused(run, model_dir, faulty_gin, *args, changed=(), **kwargs):
    """Runs and returns the one stderr line; exit 2 and nothing but ``changed`` touched."""
    before = dir_hash(model_dir)
    proc = run(model_dir, faulty_gin, *args, **kwargs)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    after = dir_hash(model_dir)
    assert {k: v for k, v in after.items() if k not in changed} == {
        k: v for k, v in before.items() if k not in changed
    }
    return proc.stderr.strip()


@pytest.mark.slow
@pytest.mark.parametrize(
    "content",
    [
        b"garbage\n\x00\x01",
        b"",
        b"\xff\xfe\x00\x81 not text",
        b'model_checkpoint_path: "../../../etc/passwd"\n'
        b'all_model_checkpoint_paths: "../../../etc/passwd"\n',
    ],
    ids=["garbage", "empty", "binary", "outside model_dir"],
)
def test_an_unreadable_or_foreign_checkpoint_list_is_rebuilt_from_the_files(
    run, model_dir, faulty_gin, content
):
    (model_dir / "checkpoint").write_bytes(content)
    kept = {k: v for k, v in dir_hash(model_dir).items() if k.startswith("ckpt-")}
    proc = run(model_dir, faulty_gin)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"warning: {model_dir}/checkpoint is missing or unreadable; found 2 checkpoints by "
        "their files, the newest ckpt-100 (the list is rewritten)"
    )
    assert "from step 100 to 150" in proc.stdout
    assert checkpoint_steps(model_dir) == [50, 100, 150]
    after = dir_hash(model_dir)
    assert all(after[k] == v for k, v in kept.items())  # the earlier run's files untouched


@pytest.mark.slow
def test_an_unreadable_side_car_record_is_warned_of_and_evaluation_starts_over(
    run, model_dir, faulty_gin
):
    (model_dir / "continuous_eval.json").write_text('{"step": 5')
    proc = run(model_dir, faulty_gin, "--schedule", "continuous_eval", max_steps=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"warning: {model_dir}/continuous_eval.json is unreadable (Expecting ',' delimiter: "
        "line 1 column 11 (char 10)); evaluating every checkpoint again"
    )
    assert (model_dir / "continuous_eval.json").read_text().strip() == '{\n  "step": 100\n}'


@pytest.mark.slow
def test_a_missing_config_record_refuses_a_resume_it_cannot_check(run, model_dir, faulty_gin):
    (model_dir / "operative_config.gin").unlink()
    assert refused(run, model_dir, faulty_gin, "--gin_param", "Adam.learning_rate = 0.5") == (
        f"error: {model_dir} has checkpoints but no operative_config.gin to check this run's "
        "config against: restore it, or pass --overwrite_config to resume with this config"
    )
    proc = run(model_dir, faulty_gin, "--overwrite_config")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkpoint_steps(model_dir)[-1] == 150
    assert "Adam.learning_rate" in (model_dir / "operative_config.gin").read_text()


@pytest.mark.slow
def test_an_evaluation_that_fails_keeps_the_steps_trained_before_it(run, model_dir, faulty_gin):
    """Corrupt eval data found at the final evaluation: the steps since the last
    checkpoint are saved first; with the data repaired, a rerun only evaluates."""
    final = ("--gin_param", "experiment.eval_every_steps = 130", "--overwrite_config")
    proc = run(
        model_dir,
        faulty_gin,
        *final,
        "--gin_param",
        "faulty_digits.fault = 'corrupt_eval'",
        max_steps=130,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == (
        "error: eval set 'eval': input data is corrupt (corrupted record at 4917 in "
        "test.tfrecord); rebuild or re-copy the data files\n"
    )
    assert checkpoint_steps(model_dir) == [50, 100, 130], proc.stdout

    proc = run(model_dir, faulty_gin, *final, max_steps=130)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Evaluation of 'eval' at step 130" in proc.stdout
    assert "Training" not in proc.stdout and checkpoint_steps(model_dir) == [50, 100, 130]


@pytest.mark.slow
def test_metrics_lines_cut_short_by_a_kill_are_dropped_with_a_warning(run, model_dir, faulty_gin):
    metrics = model_dir / "metrics.jsonl"
    good = metrics.read_bytes()
    metrics.write_bytes(good + b'{"step": 100, "time": 1.0, "wri\xff\n{"step": 1')
    proc = run(model_dir, faulty_gin)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count = len(good.splitlines())
    assert proc.stderr == (
        f"warning: {metrics}: dropped 2 unreadable line(s), the first line {count + 1}; kept "
        f"the other {count}\n"
    )
    lines = metrics.read_bytes().splitlines()
    assert lines[:count] == good.splitlines()
    assert {json.loads(line)["step"] for line in lines[count:]} == {150}  # train, eval
