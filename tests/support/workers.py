"""Worker processes of a multi_worker run on 127.0.0.1, started through the CLI."""

import os
import subprocess
import sys
import time

import pytest

from tests.support.commands import REPO, digits_args
from tests.support.helpers import checkpoint_steps
from trainer.distributed.launcher import free_ports, tf_config

BINDINGS = (
    "Estimator.global_batch_size = 64",
    "Estimator.steps_per_loop = 10",
    "Estimator.log_every_steps = 50",
    "MLP.dropout_rate = 0.0",
)
# As a user's shell: no TF_CONFIG of its own (each worker gets one), TensorFlow's start quiet.
ENV = {name: value for name, value in os.environ.items() if name != "TF_CONFIG"}
ENV["TF_CPP_MIN_LOG_LEVEL"] = "2"


def trainer_command(data_dir, model_dir, *settings):
    """``python -m trainer`` on the digits MLP with the workers' bindings and ``settings``."""
    args = digits_args(data_dir, model_dir, "--schedule", "train")
    bindings = [*BINDINGS, *settings]
    return [
        sys.executable,
        "-m",
        "trainer",
        *args,
        *(a for b in bindings for a in ("--gin_param", b)),
    ]


def run_local_workers(data_dir, model_dir, count, *settings, timeout=240):
    """``... --workers COUNT``, as a user reruns local workers; the CompletedProcess."""
    return subprocess.run(
        [*trainer_command(data_dir, model_dir, *settings), "--workers", str(count)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_workers(data_dir, model_dir, count, *settings, ports=None, only=None, index=None):
    """``count`` multi_worker trainers on 127.0.0.1, each its own command with its own
    TF_CONFIG (to signal, kill or misconfigure one of them); returns the processes.

    ``only``: start just these task indices (the others are started by another call).
    ``ports``: the cluster's, one a worker (``count`` free ones by default).
    ``index``: the task index every started worker is given (each its own by default).
    """
    ports = ports or free_ports(count)
    command = trainer_command(
        data_dir, model_dir, "Devices.distribution = 'multi_worker'", *settings
    )
    return [
        subprocess.Popen(
            command,
            cwd=REPO,
            env=dict(ENV, TF_CONFIG=tf_config(ports, i if index is None else index)),
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
