"""``--workers N``: the N worker processes of one multi_worker run, on this machine.

Each worker is ``python -m trainer`` with the same flags, ``Devices.distribution =
'multi_worker'``, and a TF_CONFIG naming a free port on 127.0.0.1 for every worker
and its own index. The chief's output is shown as it comes (its bar included); the
other workers' lines on stderr are shown at the end, prefixed with their worker,
unless the chief said the same. SIGINT, SIGTERM, SIGUSR1 and SIGHUP (as SIGTERM) are passed on
to every worker, which then save one checkpoint together and exit 75 (a second one
kills them); the job exits with the code that says the most
(``exit_codes.PRECEDENCE``: a mistake, divergence, a crash, restart me, done). A worker dies
with the command if it is killed. ``{timestamp}`` in ``--model_dir`` is expanded
once, here, so that every worker has the same model_dir.

Nothing here imports TensorFlow: the workers do.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from trainer import exit_codes

# What the command passes on to every worker: SIGHUP (its terminal closed, an ssh
# connection dropped) as SIGTERM, so that they save before they stop.
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
STOP_SECONDS = 30  # after one worker fails, how long the others have to stop
# After a signal passed on, once one worker has ended, how long the others have. A
# worker joining the cluster waits inside TensorFlow for its peers, deaf to signals,
# up to Devices.startup_timeout: a peer that stopped before joining never comes.
STRAGGLER_SECONDS = 10


def run(count: int, argv: list[str]) -> int:
    """Runs ``count`` workers of the command ``argv``; returns the job's exit code.

    ``argv`` is the command's own arguments; its ``--workers`` is dropped.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    crowded = crowding(count, cores or 1)
    if crowded:
        sys.stderr.write(f"warning: {crowded}\n")
    ports = free_ports(count)
    argv = with_start_time(without_flags(argv, ["workers"]), time.strftime("%Y%m%d-%H%M%S"))
    args = [*argv, "--gin_param", "Devices.distribution = 'multi_worker'"]
    workers = [_start(args, ports, index) for index in range(count)]
    said: set[str] = set()  # every line shown: another worker's same line is not
    said_by_others: set[str] = set()  # the chief's repeats of its own lines are shown
    forwarded: list[int] = []  # the signals this command received and passed on
    stopping = threading.Event()  # set once a worker failed and the others are stopped
    relay_args = (workers[0].stderr, said, said_by_others, forwarded, stopping)
    readers = [threading.Thread(target=_relay, args=relay_args, daemon=True)]
    others = [[] for _ in workers[1:]]
    readers += [
        threading.Thread(target=_collect, args=(w.stderr, lines), daemon=True)
        for w, lines in zip(workers[1:], others, strict=True)
    ]
    for reader in readers:
        reader.start()
    forward = forward_signals(workers, forwarded)
    previous = {s: signal.signal(s, forward) for s in PASSED_ON}
    shown: set[int] = set()  # the workers whose lines are shown already
    stopped_by: list[int] = []  # the worker whose own failure stopped the others

    def failed(index: int) -> None:  # shown first, then the others are stopped
        stopped_by.append(index)
        stopping.set()
        if index:
            readers[index].join()
            _show(index, others[index - 1], said, said_by_others, forwarded)
            shown.add(index)

    try:
        codes = _wait(workers, failed, forwarded)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for reader in readers:
        reader.join()
    if len(forwarded) > 1:  # the workers were killed: they have nothing more to say
        name = signal.Signals(forwarded[1]).name
        sys.stderr.write(
            f"interrupted: a second {name} stopped the workers at once, without saving; "
            "rerun the same command to resume from the last checkpoint\n"
        )
        return 128 + forwarded[1]
    for index, lines in enumerate(others, 1):
        # A worker stopped by another's failure (it lost that peer, saved on the SIGTERM
        # sent to it, took that SIGTERM before training, or was killed) has nothing of
        # its own to say.
        stopped = codes[index] in (exit_codes.PREEMPTED, exit_codes.of_signal(signal.SIGTERM))
        if stopped_by and (stopped or codes[index] < 0):
            continue
        if index not in shown:
            _show(index, lines, said, said_by_others, forwarded)
    return job_code(codes)


def _show(index: int, lines: list[str], said: set[str], by_others: set[str], forwarded) -> None:
    """A worker's lines on stderr, prefixed with it, but those said already."""
    for line in lines:
        line = _as_the_commands(line, forwarded)
        if line not in said:
            said.add(line)
            by_others.add(line)
            sys.stderr.write(f"[worker {index}] {line}")
    sys.stderr.flush()


def _wait(
    workers: list[subprocess.Popen],
    failed,
    forwarded: list[int],
    straggler_seconds: float = STRAGGLER_SECONDS,
) -> list[int]:
    """Every worker's exit code; the first to fail makes the others stop at once.

    A failure is an exit other than done (0) or restart (75), by the worker itself
    (one killed by a signal is a lost worker, which the others find and stop for,
    saying which): ``failed(index)`` is called, the others are sent SIGTERM (a
    worker in training saves and exits 75), and those still running
    ``STOP_SECONDS`` later are killed. Not once a signal was passed on to them
    (``forwarded``): a worker that ends first with 128 + n is then no failure, and a
    SIGTERM on top of the SIGINT would make another end 143 instead of 130. Then a
    worker still running ``straggler_seconds`` after another ended is killed, and
    counts as ended by the signal.
    """
    deadline = None
    stragglers: set[int] = set()
    while any(worker.poll() is None for worker in workers):
        ended = [i for i, w in enumerate(workers) if w.poll() is not None]
        if forwarded and ended and deadline is None:
            deadline = time.monotonic() + straggler_seconds
            stragglers = {i for i in range(len(workers)) if i not in ended}
        elif deadline is None:
            failures = [  # a worker killed by a signal is lost: the others say so, exit 75
                i
                for i in ended
                if workers[i].poll() >= 0
                and workers[i].poll() not in (exit_codes.DONE, exit_codes.PREEMPTED)
            ]
            if failures:
                failed(failures[0])
                for worker in workers:
                    if worker.poll() is None:
                        worker.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + STOP_SECONDS
        elif time.monotonic() > deadline:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
        time.sleep(0.05)
    codes = [worker.wait() for worker in workers]
    killed = {i for i in stragglers if codes[i] == -signal.SIGKILL and len(forwarded) == 1}
    return [_answer(forwarded[0]) if i in killed else code for i, code in enumerate(codes)]


def _answer(number: int) -> int:
    """The exit code of a worker that answered signal ``number`` (passed on) before training."""
    sent = signal.SIGTERM if number == signal.SIGHUP else number
    return exit_codes.PREEMPTED if sent == signal.SIGUSR1 else exit_codes.of_signal(sent)


def crowding(count: int, cores: int) -> str | None:
    """What to say when ``count`` workers are more than this machine's ``cores``."""
    if count <= cores:
        return None
    return (
        f"{count} workers on {cores} cores: each is a TensorFlow process of its own (its "
        "memory, its threads), so they share the cores and run slower than fewer would; "
        "--workers is for trying a cluster, --num_devices for one machine's devices"
    )


def job_code(codes: list[int]) -> int:
    """The job's exit code from its workers': the most telling one.

    A worker killed by a signal (a negative return code) while the others stopped
    to be restarted (75) is a lost worker: the job is restarted too (75). Otherwise
    a signal ``n`` is ``128 + n``, as a shell reports it.
    """
    lost = exit_codes.PREEMPTED if exit_codes.PREEMPTED in codes else None
    codes = [(lost or exit_codes.of_signal(-c)) if c < 0 else c for c in codes]
    crashes = [c for c in codes if c not in exit_codes.PRECEDENCE]
    for code in exit_codes.PRECEDENCE:
        if code is None and crashes:
            return crashes[0]
        if code in codes:
            return code
    return 0


def with_start_time(argv: list[str], started: str) -> list[str]:
    """``argv`` with ``{timestamp}`` in its ``--model_dir`` made the job's start time.

    Expanded once, here: each worker expanding it would give each its own model_dir.
    """
    expanded, model_dir_next = [], False
    for arg in argv:
        if model_dir_next or arg.startswith("--model_dir="):
            arg = arg.replace("{timestamp}", started)
        model_dir_next = arg == "--model_dir"
        expanded.append(arg)
    return expanded


def without_flags(argv: list[str], names: Sequence[str]) -> list[str]:
    """``argv`` without the flags ``names``, given as ``--name value`` or ``--name=value``."""
    flags = [f"--{name}" for name in names]
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in flags)):
            kept.append(arg)
    return kept


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports on 127.0.0.1 that were free a moment ago.

    Drawn at random below the kernel's range of ephemeral ports: a port from that
    range (what binding port 0 gives) can be taken, before a worker listens on it, as
    the local end of any program's outgoing connection, other workers' included.
    """
    low, _ = _ephemeral_ports()
    draw = random.SystemRandom()
    ports: list[int] = []
    for _ in range(100 * count):
        port = draw.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in ports:
            ports.append(port)
        if len(ports) == count:
            return ports
    raise OSError(f"found no {count} free TCP ports on 127.0.0.1")


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; else IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def tf_config(ports: list[int], index: int) -> str:
    """The TF_CONFIG of worker ``index`` of a cluster on 127.0.0.1 ``ports``."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def _start(args: list[str], ports: list[int], index: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        env=dict(os.environ, TF_CONFIG=tf_config(ports, index)),
        stdout=None if index == 0 else subprocess.DEVNULL,  # the chief shows the progress
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # signals reach the workers once, from here
        preexec_fn=end_with_parent,
    )


def end_with_parent() -> None:
    """Linux: the worker is killed if the command dies (killed itself), not left running."""
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _relay(stream, said: set[str], by_others: set[str], forwarded: list[int], stopping) -> None:
    """The chief's lines as they come, but those another worker said already.

    Nor its answer to the SIGTERM that another worker's failure made the command send
    it: the failure is the news; like the other workers, the chief has nothing to add.
    """
    for line in stream:
        line = _as_the_commands(line, forwarded)
        if line in by_others or (stopping.is_set() and _answers_sigterm(line)):
            continue
        said.add(line)
        sys.stderr.write(line)
        sys.stderr.flush()


def _as_the_commands(line: str, forwarded: list[int]) -> str:
    """A worker's line, told as the command's own when the command passed the signal on.

    Every worker is sent it, so whichever noticed first ('worker 1 received SIGTERM'),
    the command received it: one line, the same from every worker, naming the signal
    the command received (SIGHUP, which the workers were sent as SIGTERM).
    """
    if not forwarded:
        return line
    name = signal.Signals(forwarded[0]).name
    return re.sub(
        r"^(\w+): (worker \d+ received SIG\w+|SIG\w+ received):", rf"\1: {name} received:", line
    )


def _answers_sigterm(line: str) -> bool:
    """Whether ``line`` is a worker's last word on a SIGTERM it was sent."""
    return re.match(r"^\w+: (SIGTERM received|worker \d+ received SIGTERM)\b", line) is not None


def _collect(stream, lines: list[str]) -> None:
    lines.extend(stream)


def forward_signals(workers: list[subprocess.Popen], received: list[int]):
    """Passes the first signal of ``PASSED_ON`` on; a second one kills the workers.

    ``received`` lists the signals.
    """

    def forward(number, _frame):
        received.append(number)
        first = signal.SIGTERM if number == signal.SIGHUP else number  # a closed terminal
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(first if len(received) == 1 else signal.SIGKILL)

    return forward
