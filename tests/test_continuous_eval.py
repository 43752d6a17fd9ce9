"""A side-car evaluator beside training: every checkpoint evaluated exactly once."""

import json
import os
import subprocess
import sys

import pytest

from datasets import digits
from tests.support.commands import REPO, digits_args, run_cli
from tests.support.helpers import scalar_series


@pytest.mark.slow
def test_continuous_eval_beside_training_evaluates_each_checkpoint_once(tmp_path, data_dir):
    digits.load("train", data_dir)  # prepared data, as in a real setup (no build race)
    model_dir = tmp_path / "run"
    common = digits_args(
        data_dir,
        model_dir,
        "--gin_param",
        "experiment.max_steps = 1200",
        "--gin_param",
        "Checkpoints.every_steps = 200",
        "--gin_param",
        "Checkpoints.keep = 10",
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    results, log_path = tmp_path / "eval.json", tmp_path / "evaluator.log"
    with open(log_path, "w") as log:  # a file: a full pipe could block the child
        evaluator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainer",
                *common,
                "--schedule",
                "continuous_eval",
                "--results",
                str(results),
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
        )
        trainer = run_cli(*common, "--schedule", "train")
        try:
            evaluator.wait(timeout=180)
        finally:
            evaluator.kill()
    assert trainer.returncode == 0, trainer.stderr[-2000:]
    assert evaluator.returncode == 0, log_path.read_text()[-2000:]
    steps = [step for step, _ in scalar_series(model_dir / "eval_eval", "accuracy")]
    assert steps == [200, 400, 600, 800, 1000, 1200]
    assert json.loads(results.read_text())["metrics"]["eval"]["accuracy"] >= 0.95
    assert json.loads((model_dir / "continuous_eval.json").read_text()) == {"step": 1200}

    again = run_cli(*common, "--schedule", "continuous_eval", timeout=120)
    assert again.returncode == 0  # nothing left: exits at once, evaluating nothing twice
    assert [s for s, _ in scalar_series(model_dir / "eval_eval", "accuracy")] == steps
