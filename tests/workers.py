"""Worker processes of a multi_worker run on 127.0.0.1, started through the CLI."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, digits_args
from tests.helpers import checkpoint_steps
from trainer.launcher import free_ports, tf_config


def start_workers(data_dir, model_dir, count, *settings, ports=None, only=None, index=None):
    """``count`` multi_worker trainers on 127.0.0.1 (digits MLP); returns the processes.

    ``only``: start just these task indices (the others are started by another call).
    ``ports``: the cluster's, one a worker (``count`` free ones by default).
    ``index``: the task index every started worker is given (each its own by default).
    """
    ports = ports or free_ports(count)
    bindings = [
        "Estimator.distribution = 'multi_worker'",
        "Estimator.global_batch_size = 64",
        "Estimator.steps_per_loop = 10",
        "Estimator.log_every_steps = 50",
        "MLP.dropout_rate = 0.0",
        *settings,
    ]
    args = digits_args(data_dir, model_dir, "--schedule", "train")
    args += [arg for binding in bindings for arg in ("--gin_param", binding)]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "trainer", *args],
            cwd=REPO,
            env=dict(
                os.environ,
                TF_CPP_MIN_LOG_LEVEL="2",
                TF_CONFIG=tf_config(ports, i if index is None else index),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (range(count) if only is None else only)
    ]


def finish(workers, timeout=240):
    """Waits for every worker; returns [(exit code, stderr)], killing any left."""
    try:
        return [(w.wait(timeout=timeout), w.communicate()[1]) for w in workers]
    finally:
        for w in workers:
            w.kill()


def wait_for_checkpoint(model_dir, workers, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if model_dir.is_dir() and checkpoint_steps(model_dir):
            return
        for w in workers:
            if w.poll() is not None:
                said = w.communicate()[1] if w.stderr else ""
                pytest.fail(f"a worker ended ({w.returncode}) before its first checkpoint: {said}")
        time.sleep(0.2)
    pytest.fail("no checkpoint in time")
