"""Several workers as one run, through the CLI: real processes on 127.0.0.1, real signals."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.commands import REPO
from tests.support.helpers import checkpoint_steps, resume_run
from tests.support.helpers import finish as table
from tests.support.workers import (
    ENV,
    finish,
    free_ports,
    run_local_workers,
    start_workers,
    tf_config,
    trainer_command,
    wait_for_checkpoint,
)


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_all_at_one_checkpoint_and_a_rerun_finishes(tmp_path, data_dir):
    model_dir = tmp_path / "run"
    settings = ("experiment.max_steps = 3000", "Checkpoints.every_steps = 100")
    workers = start_workers(data_dir, model_dir, 2, *settings)
    wait_for_checkpoint(model_dir, workers)
    workers[1].send_signal(signal.SIGTERM)  # a cluster's preemption notice to one worker
    (chief_code, chief_err), (code, err) = finish(workers, timeout=120)
    assert (chief_code, code) == (75, 75), chief_err[-3000:] + err[-3000:]
    where = re.escape(str(model_dir))
    saved = rf"saved {where}/ckpt-(\d+) at step \1; rerun the same command to resume\n"
    chief_line = re.fullmatch(f"preempted: worker 1 received SIGTERM: {saved}", chief_err)
    worker_line = re.fullmatch(f"preempted: SIGTERM received: {saved}", err)
    assert chief_line and worker_line, (chief_err, err)
    step = int(chief_line.group(1))
    assert int(worker_line.group(1)) == step == checkpoint_steps(model_dir)[-1]
    written = [
        os.path.relpath(os.path.join(r, n), model_dir)
        for r, _, ns in os.walk(model_dir)
        for n in ns
    ]
    assert all("/" not in p for p in written if "ckpt-" in p)  # one set, the chief's

    # Rerun both, as the message says: they resume from that checkpoint and finish.
    settings = (f"experiment.max_steps = {step + 20}", "Checkpoints.every_steps = 100")
    proc = run_local_workers(data_dir, model_dir, 2, *settings)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from step {step}" in proc.stdout  # the chief's start line: a resume
    assert checkpoint_steps(model_dir)[-1] == step + 20


@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "fault"),
    [(1, signal.SIGKILL), (0, signal.SIGKILL), (0, signal.SIGSTOP)],
    ids=["killed worker", "killed chief", "stopped chief"],
)
def test_a_lost_worker_is_named_by_the_survivor_in_one_line_and_a_rerun_finishes(
    tmp_path, data_dir, victim, fault
):
    """Killed, or stopped (a hung machine: its collectives would wait forever)."""
    model_dir = tmp_path / "run"
    settings = ("experiment.max_steps = 3000", "Checkpoints.every_steps = 100")
    workers = start_workers(data_dir, model_dir, 2, *settings)
    wait_for_checkpoint(model_dir, workers)
    killed = time.monotonic()
    workers[victim].send_signal(fault)
    [(code, err)] = finish([workers[1 - victim]], timeout=60)
    seconds = time.monotonic() - killed
    workers[victim].kill()
    workers[victim].wait()
    assert code == 75, err[-3000:]
    newest = checkpoint_steps(model_dir)[-1]
    assert re.fullmatch(
        rf"error: lost worker {victim} \(127\.0\.0\.1:\d+\) after step \d+: it died or stopped "
        rf"answering; every worker resumes from {re.escape(str(model_dir))}/ckpt-{newest} when "
        r"all 2 are started again with the same command\n",
        err,
    ), err
    assert seconds < 60
    log = "trainer.log" if victim == 1 else "trainer-worker_1.log"
    assert "Traceback" in (model_dir / log).read_text()  # the details are kept, off the console
    if fault == signal.SIGKILL and victim == 0:
        settings = (
            f"experiment.max_steps = {newest + 20}",
            "Checkpoints.every_steps = 100",
        )
        proc = run_local_workers(data_dir, model_dir, 2, *settings)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert checkpoint_steps(model_dir)[-1] == newest + 20


def worker_pid(launcher, index):
    """The pid of the launcher's worker ``index`` (found by its TF_CONFIG)."""
    for child in subprocess.run(
        ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
    ).stdout.split():
        with open(f"/proc/{child}/environ", "rb") as f:
            if f'"index": {index}}}'.encode() in f.read():
                return int(child)
    pytest.fail(f"no worker {index} under the launcher")


@pytest.mark.slow
def test_a_closed_terminal_or_a_lost_worker_ends_the_launcher_as_readme_says(tmp_path, data_dir):
    """SIGHUP (the terminal closed) saves as SIGTERM does, said once: exit 75; the run's
    '{timestamp}' model_dir is one directory for both workers; on the rerun, worker 1
    killed with SIGKILL makes the job exit 75 (it was 247, the signal passed on)."""
    settings = ("experiment.max_steps = 3000", "Checkpoints.every_steps = 100")
    command = [
        *trainer_command(data_dir, tmp_path / "run_{timestamp}", *settings),
        "--workers",
        "2",
    ]
    job = subprocess.Popen(
        command, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    while not [d for d in tmp_path.glob("run_*") if checkpoint_steps(d)]:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.2)
    (model_dir,) = tmp_path.glob("run_*")  # one, not one per worker
    assert re.fullmatch(r"run_\d{8}-\d{6}", model_dir.name)
    job.send_signal(signal.SIGHUP)
    err = job.communicate(timeout=120)[1]
    assert job.returncode == 75, err[-3000:]
    step = checkpoint_steps(model_dir)[-1]
    assert err == (
        f"preempted: SIGHUP received: saved {model_dir}/ckpt-{step} at step {step}; rerun "
        "the same command to resume\n"
    )

    rerun = [*trainer_command(data_dir, model_dir, *settings), "--workers", "2"]
    job = subprocess.Popen(
        rerun, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    while checkpoint_steps(model_dir)[-1] == step:
        assert job.poll() is None and time.monotonic() < deadline + 120, job.communicate()[1]
        time.sleep(0.2)
    os.kill(worker_pid(job, 1), signal.SIGKILL)
    err = job.communicate(timeout=120)[1]
    assert job.returncode == 75, err[-3000:]
    assert err.startswith("error: lost worker 1 (127.0.0.1:") and "every worker resumes" in err


@pytest.mark.slow
def test_ctrl_c_while_the_workers_start_or_twice_in_training_is_one_line(tmp_path, data_dir):
    """Ctrl-C (SIGINT to the command's process group) as TensorFlow loads: one line, exit
    130, no model_dir; twice in training: the workers are killed, one line says so."""
    command = [*trainer_command(data_dir, tmp_path / "run"), "--workers", "2"]
    options = dict(cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    job = subprocess.Popen(command, **options, text=True, start_new_session=True)
    time.sleep(1.0)  # the workers are importing TensorFlow
    os.killpg(job.pid, signal.SIGINT)
    err = job.communicate(timeout=120)[1]
    assert (job.returncode, err) == (
        130,
        "interrupted: SIGINT received before training started or after it ended: nothing "
        "was being trained; rerun the same command to start or resume\n",
    )
    assert not (tmp_path / "run").exists()

    settings = ("experiment.max_steps = 3000", "Checkpoints.every_steps = 100")
    command = [*trainer_command(data_dir, tmp_path / "run", *settings), "--workers", "2"]
    job = subprocess.Popen(command, **options, text=True, start_new_session=True)
    wait_for_checkpoint(tmp_path / "run", [job])
    os.killpg(job.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(job.pid, signal.SIGINT)
    err = job.communicate(timeout=120)[1]
    assert job.returncode == 130, err[-3000:]
    assert err.splitlines()[-1] == (
        "interrupted: a second SIGINT stopped the workers at once, without saving; rerun the "
        "same command to resume from the last checkpoint"
    )
    assert "Traceback" not in err and len(err.splitlines()) <= 2


def run_faulty_workers(tmp_path, data_dir, *settings):
    """``--workers 2`` on tests/user_project's faulty_digits with ``settings``; the result."""
    settings = ("import faulty", "experiment.input_fn = @faulty_digits", *settings)
    command = [*trainer_command(data_dir, tmp_path / "run", *settings), "--workers", "2"]
    env = {**ENV, "PYTHONPATH": os.path.join(REPO, "tests", "user_project")}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_worker_that_fails_is_said_first_and_the_others_are_stopped_at_once(tmp_path, data_dir):
    """Worker 1's labels go out of range at its 30th batch: its one line comes first, the
    chief is stopped (not left to find the lost peer), and the job exits 2."""
    done = run_faulty_workers(
        tmp_path,
        data_dir,
        "faulty_digits.fault = 'label_on_worker_1'",
        "faulty_digits.at_batch = 30",
        "experiment.max_steps = 3000",
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[0].startswith("[worker 1] error: training step ") and "label" in lines[0]
    assert "Traceback" not in done.stderr and len(lines) <= 2, done.stderr


@pytest.mark.slow
def test_workers_that_see_other_checkpoints_or_a_changed_config_stop_before_training(
    tmp_path, data_dir
):
    """A model_dir that is not shared names the worker that cannot see ckpt-20; a changed
    model under the checkpoints is refused by every worker, not by the chief alone."""
    model_dir, elsewhere = tmp_path / "run", tmp_path / "not_shared"
    settings = ("experiment.max_steps = 20", "Checkpoints.every_steps = 100")
    assert run_local_workers(data_dir, model_dir, 2, *settings).returncode == 0
    before = sorted(os.listdir(model_dir))
    ports = free_ports(2)
    (chief,) = start_workers(data_dir, model_dir, 2, *settings, ports=ports, only=[0])
    (other,) = start_workers(data_dir, elsewhere, 2, *settings, ports=ports, only=[1])
    results = finish([chief, other], timeout=120)
    line = (
        "error: the workers see different checkpoints in {} (worker 0 ckpt-20, worker 1 "
        "none): model_dir must be one directory every worker sees (shared storage), or pass "
        "each worker the same --model_dir\n"
    )
    assert results == [(2, line.format(model_dir)), (2, line.format(elsewhere))]
    assert sorted(os.listdir(model_dir)) == before and not elsewhere.exists()

    changed = (*settings, "MLP.hidden_units = [128]")
    results = finish(start_workers(data_dir, model_dir, 2, *changed))
    refusal = (
        "error: the config differs from the one the checkpoints in this model_dir were trained "
        "with (MLP.hidden_units: [256, 256] -> [128]), and they do not fit the model it makes "
        "(logits/kernel has shape (128, 10), which no saved value has): use a new --model_dir, "
        "or restore the config they were trained with\n"
    )
    assert results == [(2, refusal), (2, refusal)]
    assert sorted(os.listdir(model_dir)) == before


@pytest.mark.slow
def test_workers_given_different_configs_or_clusters_stop_in_one_line(tmp_path, data_dir):
    """What differs between workers is named on every worker, before anything is written."""
    model_dir, settings = tmp_path / "run", ("experiment.max_steps = 20",)
    ports = free_ports(3)
    chief = start_workers(data_dir, model_dir, 2, *settings, ports=ports[:2], only=[0])
    other = start_workers(
        data_dir, model_dir, 2, *settings, "MLP.hidden_units = [128]", ports=ports[:2], only=[1]
    )
    line = (
        "error: worker 1 was started with another config than worker 0: MLP.hidden_units: "
        "[256, 256] -> [128] (worker 0 -> 1); start every worker with the same --gin_file and "
        "--gin_param (only a data_dir may differ)\n"
    )
    assert finish(chief + other, timeout=120) == [(2, line), (2, line)]

    # Worker 1 was told of another address for itself: without the check, both hang.
    chief = start_workers(data_dir, model_dir, 2, *settings, ports=ports[:2], only=[0])
    other = start_workers(data_dir, model_dir, 2, *settings, ports=ports[::2], only=[1])
    results = finish(chief + other, timeout=120)
    clusters = [f'{{"worker": ["127.0.0.1:{ports[0]}", "127.0.0.1:{p}"]}}' for p in ports[1:]]
    line = (
        "error: TF_CONFIG's cluster differs between workers: worker {} has {}, worker {} has "
        "{}; give every worker the same cluster (only task.index differs)\n"
    )
    assert results == [
        (2, line.format(0, clusters[0], 1, clusters[1])),
        (2, line.format(1, clusters[1], 0, clusters[0])),
    ]
    assert not model_dir.exists()  # nothing written, not even the directory

    # Two workers given index 0: the second cannot take the first one's port.
    first = start_workers(data_dir, model_dir, 2, *settings, ports=ports[:2], only=[0])
    time.sleep(3)  # the first one listens
    second = start_workers(data_dir, model_dir, 2, *settings, ports=ports[:2], only=[1], index=0)
    assert finish(second, timeout=120) == [
        (
            2,
            f"error: could not listen on 127.0.0.1:{ports[0]}, worker 0 of 2's address in "
            "TF_CONFIG: is another worker using the same task index, or another program the "
            "same port?\n",
        )
    ]
    first[0].kill()  # it waits for worker 1, as a worker started before the others does
    assert "Joining the cluster as worker 0 of 2" in first[0].communicate()[0]
    assert not model_dir.exists() or not os.listdir(model_dir)


@pytest.mark.slow
def test_a_worker_whose_peers_never_come_gives_up_or_answers_signals_while_it_waits(
    tmp_path, data_dir
):
    """Worker 1 started alone gives up after Devices.startup_timeout naming worker 0
    (exit 75); worker 0 alone answers SIGTERM while it waits (143). One line each, no
    model_dir: TensorFlow's own wait would hold both forever, deaf to signals."""
    ports = free_ports(4)
    alone = start_workers(
        data_dir, tmp_path / "a", 2, "Devices.startup_timeout = 4", ports=ports[:2], only=[1]
    )
    waiting = start_workers(data_dir, tmp_path / "b", 2, ports=ports[2:], only=[0])
    assert "Joining the cluster as worker 0 of 2" in waiting[0].stdout.readline()
    time.sleep(1)
    waiting[0].send_signal(signal.SIGTERM)
    assert finish(alone + waiting, timeout=120) == [
        (
            75,
            f"error: worker 1 of 2: worker 0 (127.0.0.1:{ports[0]}) did not start in 4s "
            "(Devices.startup_timeout): start every worker of TF_CONFIG's cluster with the "
            "same command, or allow longer\n",
        ),
        (
            143,
            "interrupted: SIGTERM received before training started or after it ended: "
            "nothing was being trained; rerun the same command to start or resume\n",
        ),
    ]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_a_worker_stuck_in_its_input_fn_is_named_and_the_run_ends_resumable(tmp_path, data_dir):
    """Worker 1's input_fn never returns while its process still heartbeats (TensorFlow
    would wait forever): after Devices.progress_timeout the watchdog names it, every
    worker ends 75 in one line, and nothing is left half-written."""
    done = run_faulty_workers(
        tmp_path,
        data_dir,
        "faulty_digits.fault = 'hang_on_worker_1'",
        "Devices.progress_timeout = 8",
    )
    assert done.returncode == 75, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) <= 2, done.stderr
    stuck = r"worker 1 \(127\.0\.0\.1:\d+, in its train input_fn at step 0\) made no " + re.escape(
        "progress for 8s (Devices.progress_timeout) while the others waited"
    )
    assert re.search(stuck, done.stderr), done.stderr
    assert not (tmp_path / "run").exists() or checkpoint_steps(tmp_path / "run") == []


def weights(stop: dict) -> dict:
    """What a run printed at a stop, but the gradient norm (rounded by the replica count)."""
    return {"step": stop["step"], "table": stop["table"]}


@pytest.mark.slow
def test_reruns_on_fewer_or_more_workers_read_what_one_uninterrupted_run_reads(tmp_path):
    """Stopped at step 6 on 2 workers, resumed on 3 to step 12 and on 1 to step 16: every
    step reads the examples one uninterrupted process reads, and the weights are bit-equal
    (the id-table model of tests/support/resume_runs.py)."""
    straight = resume_run(tmp_path / "straight", "towers:1", "6,12,16")
    model_dir, tables = tmp_path / "run", []
    for count, steps in ((2, 6), (3, 12), (1, 16)):
        ports = free_ports(count)
        env = [{"TF_CONFIG": tf_config(ports, i)} for i in range(count)]
        runs = [resume_run(model_dir, "multi_worker:1", steps, env[i]) for i in range(count)]
        tables.append([weights(table(run)) for run in runs])
    expected = [weights(stop) for stop in table(straight, stops=3)]
    assert np.std(expected[-1]["table"]) > 0.1  # the table tells steps and examples apart
    for seen, wanted in zip(tables, expected, strict=True):
        assert all(worker == wanted for worker in seen)  # every worker holds the same weights
    assert checkpoint_steps(model_dir)[-1] == 16


@pytest.mark.slow
def test_a_users_own_input_fn_is_shared_out_between_workers_as_one_process_reads_it(tmp_path):
    """README's input_fn (arrays, shuffle, batch by params.batch_size), which does not read
    params.input_pipeline_id: two workers read what one process reads at the same global
    batch (bit-equal id tables), not the same batches twice."""
    own = {"RESUME_RUNS_INPUT": "own"}
    straight = resume_run(tmp_path / "straight", "towers:1", "4,8", own)
    ports = free_ports(2)
    runs = [  # trained to 4 then to 8: a second train() in the same processes (item 9)
        resume_run(
            tmp_path / "run", "multi_worker:1", "4,8", {"TF_CONFIG": tf_config(ports, i), **own}
        )
        for i in range(2)
    ]
    expected = [stop["table"] for stop in table(straight, stops=2)]
    for run in runs:
        assert [stop["table"] for stop in table(run, stops=2)] == expected
    assert np.std(expected[-1]) > 0.1


@pytest.mark.slow
def test_two_workers_clip_the_summed_gradient_as_one_process_does(tmp_path):
    """The global norm of the gradient summed over the workers (and over each one's 3
    micro-batches) is clipped: the id-table model's weights equal one process's, and
    differ from unclipped training. Its learning rate is the step: a micro-batch counted
    as a step would show."""
    straight = resume_run(tmp_path / "straight", "towers:1", 8, clip=0.1)
    unclipped = resume_run(tmp_path / "unclipped", "towers:1", 8)
    ports = free_ports(2)
    runs = [
        resume_run(
            tmp_path / "run",
            "multi_worker:1",
            8,
            {"TF_CONFIG": tf_config(ports, i), "RESUME_RUNS_MICROBATCHES": "3"},
            0.1,
        )
        for i in range(2)
    ]
    expected, tables = table(straight), [table(run) for run in runs]
    for run in tables:
        np.testing.assert_allclose(run["table"], expected["table"], rtol=1e-6, atol=1e-7)
        assert run["gradient_norm"] == pytest.approx(expected["gradient_norm"], rel=1e-5)
    expected = expected["table"]
    assert np.abs(np.subtract(table(unclipped)["table"], expected)).max() > 0.1


@pytest.mark.slow
def test_workers_flag_starts_local_workers_passes_signals_on_and_says_things_once(
    tmp_path, data_dir
):
    """--workers 2: one run over two processes; SIGTERM to the command stops both at one
    checkpoint (exit 75); a mistake both workers make is said once."""
    model_dir = tmp_path / "run"
    settings = ("experiment.max_steps = 3000", "Checkpoints.every_steps = 100")
    job = subprocess.Popen(
        [*trainer_command(data_dir, model_dir, *settings), "--workers", "2"],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(model_dir, [job])
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 75, err[-3000:]
    step = checkpoint_steps(model_dir)[-1]
    assert err == (
        f"preempted: SIGTERM received: saved {model_dir}/ckpt-{step} at step {step}; rerun "
        "the same command to resume\n"
    )
    assert "over 2 replicas" in out  # the chief's start line: one run of two workers

    proc = run_local_workers(data_dir, model_dir, 2, "Estimator.global_batch_size = 65")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "does not divide over the 2 replicas" in proc.stderr


def test_a_worker_deaf_to_a_signal_passed_on_is_stopped_once_another_has_ended():
    """Ctrl-C while the workers join: one ends at once (130); the chief, waiting inside
    TensorFlow for a peer that will never come, cannot answer. The launcher kills it
    once the other has ended a while, and the job ends as interrupted (it hung 300 s)."""
    from trainer.distributed import launcher

    answers = "import signal, sys, time\nsignal.signal(signal.SIGINT, lambda *a: sys.exit(130))\n"
    deaf = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    ready = "print('ready', flush=True)\ntime.sleep(600)\n"
    workers = [
        subprocess.Popen([sys.executable, "-c", code + ready], stdout=subprocess.PIPE, text=True)
        for code in (deaf, answers)
    ]
    try:
        for worker in workers:
            assert worker.stdout.readline() == "ready\n"  # their handlers are set
        forwarded = []
        launcher.forward_signals(workers, forwarded)(signal.SIGINT, None)
        codes = launcher._wait(workers, lambda index: None, forwarded, straggler_seconds=1)
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert codes == [130, 130] and launcher.job_code(codes) == 130


def test_the_launchers_exit_code_start_time_and_crowding_in_one_place():
    from trainer.distributed import launcher

    # A worker killed by a signal while the others stopped to restart is a lost worker.
    assert launcher.job_code([75, -9]) == 75 and launcher.job_code([-9, 75]) == 75
    assert launcher.job_code([0, -9]) == 128 + 9  # as a shell says a SIGKILL
    assert launcher.job_code([2, -9, 75]) == 2  # a mistake says the most
    assert launcher.job_code([143, 75]) == 143 and launcher.job_code([0, 0]) == 0
    # The chief's answer to the SIGTERM another worker's failure made the command send.
    assert launcher._answers_sigterm("interrupted: SIGTERM received before training started")
    assert launcher._answers_sigterm("preempted: worker 1 received SIGTERM: saved ckpt-3")
    assert not launcher._answers_sigterm("error: Estimator.global_batch_size 65 does not divide")
    argv = ["--model_dir", "out/{timestamp}", "--gin_param", "x = '{timestamp}'"]
    assert launcher.with_start_time(argv, "T") == [
        "--model_dir",
        "out/T",
        "--gin_param",
        "x = '{timestamp}'",
    ]
    assert launcher.with_start_time(["--model_dir=a/{timestamp}"], "T") == ["--model_dir=a/T"]
    assert launcher.crowding(2, 2) is None
    assert launcher.crowding(64, 2).startswith("64 workers on 2 cores: each is a TensorFlow")
