"""The command line as a user runs it: ``python -m trainer`` in a subprocess."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_PROJECT = os.path.join(REPO, "tests", "user_project")  # a user's own models and inputs
ENV = {"PYTHONPATH": USER_PROJECT}


def run_cli(*args, cwd=REPO, env=None, timeout=300, unset=()):
    """Runs ``python -m trainer ARGS`` in a subprocess; returns the CompletedProcess.

    ``env`` adds variables to this process's environment; ``unset`` removes some.
    """
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    for name in unset:
        full_env.pop(name, None)
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
