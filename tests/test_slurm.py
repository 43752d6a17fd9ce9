"""The SLURM recipes of docs/guide/parallel.md, run on a real one-node SLURM.

Two jobs of two tasks share the node at once; ``scancel --signal=TERM`` saves; the
time limit's warning (SIGUSR1) saves and the batch script requeues the job, which then
resumes from the checkpoint and finishes. What one node cannot show (several nodes,
GPUs per task) is tested with SLURM's variables faked, in test_parallel.py.
"""

import re
import subprocess
import time

import pytest

from tests.support import guides, pacing
from tests.support.commands import REPO
from tests.support.helpers import checkpoint_steps
from tests.support.slurm import LocalSlurm, unavailable


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    cluster.start()
    yield cluster
    cluster.stop()


def readme_batch_script(model_dir, *bindings) -> str:
    """README's sbatch script, on the digits and ``model_dir``, with ``bindings`` added."""
    script = re.search(r"```bash\n(#!/bin/bash\n.*?)```", guides.text(), re.S)[1]
    script = script.replace("experiments/cifar10_alexnet.gin", "experiments/digits_mlp.gin")
    script = script.replace("/shared/runs/c10", str(model_dir))
    added = "".join(f' --gin_param "{b}"' for b in bindings)
    return script.replace("'multi_worker'\"\n", f"'multi_worker'\"{added}\n", 1)


def srun_command(model_dir, *bindings) -> str:
    """The batch script's srun command, as one line."""
    script = readme_batch_script(model_dir, *bindings).replace("\\\n", " ")
    return next(line for line in script.splitlines() if line.startswith("srun "))


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g}s for {what}"
        time.sleep(0.5)


@pytest.mark.slow
def test_two_jobs_of_two_tasks_share_the_node_and_scancel_term_saves(slurm, tmp_path):
    """README's srun line as two jobs at once, 2 tasks each: each job listens on ports of
    its own (both took 8888 before), one trains to its end, the other is sent
    `scancel --signal=TERM`, saves and returns 75."""
    jobs = {}
    for name, steps in (("short", 300), ("long", 100000)):
        command = srun_command(
            tmp_path / name,
            f"experiment.max_steps = {steps}",
            "Checkpoints.every_steps = 200",
        ).replace("srun ", f"srun --job-name={name} --ntasks=2 --oversubscribe ", 1)
        jobs[name] = subprocess.Popen(
            ["bash", "-c", command],
            cwd=REPO,
            env=slurm.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def saved() -> bool:
        assert jobs["long"].poll() is None, jobs["long"].communicate()[1][-3000:]
        return (tmp_path / "long").exists() and bool(checkpoint_steps(tmp_path / "long"))

    wait_until(saved, 240, "the long job's checkpoint")
    job_id = slurm.run("squeue", "-h", "-n", "long", "-o", "%i").stdout.strip()
    slurm.run("scancel", "--signal=TERM", job_id)
    results = {name: (job.wait(timeout=240), *job.communicate()) for name, job in jobs.items()}
    code, out, err = results["long"]
    assert code == 75, err[-3000:]
    saved = checkpoint_steps(tmp_path / "long")[-1]
    assert f"preempted: SIGTERM received: saved {tmp_path / 'long'}/ckpt-{saved}" in err
    code, out, err = results["short"]
    assert code == 0, err[-3000:]
    assert checkpoint_steps(tmp_path / "short")[-1] == 300
    ports = [
        re.findall(r'"worker": \[([^\]]*)\]', results[name][1])[0] for name in ("short", "long")
    ]
    assert ports[0] != ports[1] and "8888" not in ports[0] + ports[1], ports


@pytest.mark.slow
def test_the_time_limits_warning_saves_and_the_batch_script_requeues_the_job(slurm, tmp_path):
    """README's batch script with a one-minute limit and the warning 30 s before it: the
    workers stop on SIGUSR1 with 75 and the script requeues the job; started again, it
    resumes from the checkpoint, and `scancel --signal=TERM` requeues it once more."""
    model_dir, out = tmp_path / "run", tmp_path / "job.out"
    script = tmp_path / "c10.sbatch"
    bindings = ("experiment.max_steps = 100000", "Checkpoints.every_steps = 200")
    bindings += pacing.BINDINGS  # a tenth of the CPU while the test waits on the clock
    script.write_text(readme_batch_script(model_dir, *bindings))
    options = ["--nodes=1", "--ntasks-per-node=2", "--oversubscribe", "--time=1"]
    submitted = slurm.run(
        "sbatch",
        "--parsable",
        *options,
        "--signal=USR1@30",
        f"--output={out}",
        str(script),
        cwd=REPO,
    )
    job = submitted.stdout.strip().split(";")[0]

    def requeued(times: int) -> str:
        """The job's output once it has been requeued ``times`` times."""

        def held() -> bool:  # requeued, and held until its begin time (set after a moment)
            fields = slurm.job(job)
            return fields.get("Restarts") == str(times) and fields.get("Reason") == "BeginTime"

        wait_until(held, 180, "a requeue")
        text = out.read_text()
        assert "Traceback" not in text and not re.search(r"^error: ", text, re.M), text[-3000:]
        return text

    first = requeued(1)
    assert "SIGUSR1 received" in first, first[-3000:]
    saved = checkpoint_steps(model_dir) if model_dir.exists() else []
    before = saved[-1] if saved else 0  # none when the warning came before training
    if before:  # the warning came once training had started (else it ended at once, 75)
        assert f"preempted: SIGUSR1 received: saved {model_dir}/ckpt-{before}" in first
    # SLURM holds a requeued job a minute or two: start it now, with time to spare.
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=10")
    wait_until(  # (no model_dir yet if the warning came before training started)
        lambda: model_dir.exists() and checkpoint_steps(model_dir)[-1:] > [before],
        180,
        "a new checkpoint",
    )
    slurm.run("scancel", "--signal=TERM", job)
    second = requeued(2)[len(first) :]
    if before:
        assert f"Restored {model_dir}/ckpt-{before}" in second
    assert "preempted: SIGTERM received: saved" in second, second[-3000:]
    slurm.run("scancel", job)
