"""Shared fixtures: absl flags parsed, gin cleared between tests, one TFDS data dir."""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gin  # noqa: E402
import pytest  # noqa: E402
from absl import flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# absl flags are unparsed under pytest; library code that reads them would raise.
flags.FLAGS.mark_as_parsed()


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A TFDS data_dir private to this test session (digits get built into it once)."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))


def run_cli(*args, cwd=REPO, env=None, timeout=300):
    """Runs ``python -m trainer ARGS`` in a subprocess; returns the CompletedProcess."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def digits_args(data_dir, model_dir, *extra):
    """CLI arguments running the default digits experiment on this session's data."""
    return [
        "--gin_file",
        "experiments/digits_mlp.gin",
        "--model_dir",
        str(model_dir),
        "--gin_param",
        f"digits.input_fn.data_dir = '{data_dir}'",
        *extra,
    ]
