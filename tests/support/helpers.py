"""Reading back what a run wrote (event files with TensorBoard's own loader, files), and
the id-table runs of tests/support/resume_runs.py."""

import contextlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from tensorboard.backend.event_processing import event_accumulator

from tests.support.commands import REPO


def event_tags(log_dir):
    """Scalar and tensor tags (tf.summary writes scalars as tensors) in ``log_dir``."""
    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    return set(acc.Tags()["tensors"]) | set(acc.Tags()["scalars"])


def scalar_series(log_dir, tag):
    """``[(step, value)]`` of one scalar tag in ``log_dir``."""
    import tensorflow as tf

    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def checkpoint_steps(model_dir):
    """Global steps of the checkpoints present in ``model_dir``, sorted."""
    return sorted(
        int(f[len("ckpt-") : -len(".index")])
        for f in os.listdir(model_dir)
        if f.startswith("ckpt-") and f.endswith(".index")
    )


def dir_hash(directory):
    """Every file under ``directory``: relative path to its bytes."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


def resume_run(model_dir, setup, max_steps, env=None, clip=None):
    """Starts tests/support/resume_runs.py: the id-table model trained to ``max_steps``."""
    return subprocess.Popen(
        [
            sys.executable,
            os.path.join(REPO, "tests", "support", "resume_runs.py"),
            str(model_dir),
            setup,
            str(max_steps),
            *([str(clip)] if clip else []),
        ],
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process, stops=1):
    """The run's last table (a list of its last ``stops`` tables if more than one)."""
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    tables = [json.loads(line) for line in out.splitlines() if line.startswith("{")][-stops:]
    return tables if stops > 1 else tables[0]


def _calling(module: str, function: str, before: str = "") -> str:
    """A script that prints ``module.function(*sys.argv[1:])`` as JSON, TensorFlow loaded
    as the command line loads it, after ``before`` (code run before the module loads)."""
    return (
        "import json, sys\n"
        "from tests.support import lean_start\n"
        f"{before}"
        f"from {module} import {function}\n"
        f"print(json.dumps({function}(*sys.argv[1:])))\n"
    )


def on_two_cpus(module: str, function: str, *args: str):
    """``module.function(*args)`` in a subprocess that split its CPU into two logical
    devices before TensorFlow started; its JSON result."""
    script = _calling(module, function, "import trainer\ntrainer.split_cpu(2)\n")
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def on_workers(count: int, module: str, function: str, *args: str) -> list:
    """``module.function(*args)`` in ``count`` processes on 127.0.0.1, each a worker of
    one TF_CONFIG cluster (task ``i`` of ``count``); their JSON results, chief first."""
    from trainer.distributed.launcher import free_ports, tf_config

    script = _calling(module, function)
    ports = free_ports(count)
    environment = {name: value for name, value in os.environ.items() if name != "TF_CONFIG"}
    with tempfile.TemporaryDirectory() as logs:  # files, not pipes: a full pipe would stall
        outputs = [os.path.join(logs, f"worker-{i}") for i in range(count)]
        workers = []
        for i, output in enumerate(outputs):
            with open(output + ".out", "w") as out, open(output + ".err", "w") as err:
                workers.append(
                    subprocess.Popen(
                        [sys.executable, "-c", script, *args],
                        cwd=REPO,
                        env=dict(
                            environment, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=tf_config(ports, i)
                        ),
                        stdout=out,
                        stderr=err,
                    )
                )
        try:
            codes = [worker.wait(timeout=300) for worker in workers]
        finally:
            for worker in workers:
                worker.kill()
        said = [(open(o + ".out").read(), open(o + ".err").read()) for o in outputs]
    failed = [
        f"worker {i} (exit {code}):\n{err[-2000:]}"
        for i, (code, (_, err)) in enumerate(zip(codes, said, strict=True))
        if code != 0
    ]
    assert not failed, "\n".join(failed)  # each one's end: the first to fail may be any
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in said]


STATE_PREFIXES = ("model/", "optimizer/", "rng/", "step/")  # a checkpoint's training state


def saved_state(model_dir):
    """The training state in ``model_dir``'s newest checkpoint: ``{key: value}``."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(model_dir)))
    return {
        key: reader.get_tensor(key)
        for key in reader.get_variable_to_shape_map()
        if key.startswith(STATE_PREFIXES)
    }


def start(args):
    """``python -m trainer ARGS`` started in the background (its stderr piped)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_checkpoint_after(model_dir, step, proc, timeout=120):
    """The step of the first checkpoint after ``step`` that ``proc`` writes in ``model_dir``."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        steps = checkpoint_steps(model_dir) if model_dir.exists() else []
        if steps and steps[-1] > step:
            return steps[-1]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint after step {step}; exit {proc.poll()}")


def closed_form_eval_mse():
    """The diabetes test set's mean squared error of the least-squares fit on train."""
    import numpy as np

    from datasets import diabetes

    x, y = diabetes.arrays("train")
    design = np.c_[x, np.ones(len(x))]
    theta = np.linalg.solve(design.T @ design, design.T @ y)  # (X^T X)^-1 X^T y
    x_test, y_test = diabetes.arrays("test")
    return float(np.mean((np.c_[x_test, np.ones(len(x_test))] @ theta - y_test) ** 2))


@contextlib.contextmanager
def http_served(handler):
    """``handler`` (a request handler class, or a partial of one) serving on a free
    port of 127.0.0.1 in a thread; yields the address, ``http://127.0.0.1:PORT``."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
