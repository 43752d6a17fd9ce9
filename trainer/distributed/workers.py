"""Several workers as one run: one checkpoint for all, and a stop they agree on.

Under ``'multi_worker'`` every worker runs the same loop. What keeps them one run:

* **One set of checkpoints.** Every worker restores the chief's checkpoint from
  ``model_dir``, which must be one directory all of them see (shared storage, as
  TensorFlow requires). The others write what a save needs to a scratch directory of
  their own and remove it (TensorFlow's recommended pattern), so ``model_dir`` holds
  one set of checkpoints whatever the worker count.
* **The same start.** Before the first step the workers compare their configs
  (through the coordination service's key-value store, which MultiWorkerMirroredStrategy
  starts) and the step each would resume from; if either differs (a worker given
  another gin file, one that cannot see the chief's checkpoints), every worker stops
  in one line before training.
* **A stop they agree on.** At each block boundary the workers share whether any of
  them was sent SIGTERM, SIGINT or SIGUSR1 (one all-reduce of a few integers per block), so a
  signal to any one worker makes every worker save the same step and exit 75.

The agreement is a sum over replicas of one-hot rows: each replica writes its values
in its own row, and every worker reads every row.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging as std_logging
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import NoReturn

import tensorflow as tf
from absl import logging

from trainer import config_diff, internals
from trainer.distributed import cluster, watchdog
from trainer.errors import PeerLost, UserError

_CONFIG_CHECKS = itertools.count()  # this process's config checks so far
_WATCHES = itertools.count()  # this process's watched runs so far
SCRATCH: list[str] = []  # this process's scratch directories, removed at exit


def remove_scratch() -> None:
    """Removes this process's scratch directories (at exit, or before ``os._exit``)."""
    while SCRATCH:
        shutil.rmtree(SCRATCH.pop(), ignore_errors=True)


def exit_now(message: str, exit_code: int, prefix: str) -> NoReturn:
    """Ends a worker's process at once, after its last line (``prefix: message``, if any).

    Python's own exit frees TensorFlow's runtime, which under multi_worker can take
    from a second to tens of seconds (a tf.data thread, the coordination service
    waiting on peers already gone), while a scheduler gives a preempted job about 30 s
    before SIGKILL. What the run wrote is closed by then (checkpoints, summaries); the
    log is flushed and the scratch directory removed here.
    """
    if message:
        print(f"{prefix}: {message}", file=sys.stderr)
    std_logging.shutdown()  # trainer.log and the console's handlers, flushed and closed
    remove_scratch()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class OneProcess:
    """A run of one process (one device, towers or mirrored): ``Workers``' questions answered.

    The loop asks the same of one process as of several workers; here a stop signal is
    this process's own, it writes ``model_dir`` itself, and nothing watches it.
    """

    several = False  # every worker of a run saves together; one process saves alone

    def watch(self, timeout: float):
        """Nothing to watch: a process that stops making progress is its own to see."""
        del timeout
        return contextlib.nullcontext()

    def heartbeat(self, phase: str, step: int | None = None) -> None:
        """Nothing to tell: no watchdog."""

    def write_dir(self, model_dir: str) -> str:
        """Where the process writes: ``model_dir``."""
        return model_dir

    def check_same_start(
        self, find_latest: Callable[[], str | None], model_dir: str, config: Callable[[], str]
    ) -> str | None:
        """The checkpoint to resume from: ``find_latest()``; there is no one to agree with."""
        del model_dir, config
        return find_latest()

    def signalled(self, signals: list[str]) -> str | None:
        """The stop signal this process received, in words, or None."""
        return f"{signals[0]} received" if signals else None


class Workers:
    """The workers of a ``MultiWorkerMirroredStrategy`` run, seen from one of them.

    Args:
      strategy: the run's ``MultiWorkerMirroredStrategy``.
      worker: this worker's name (``'worker_1'``), None for the chief.
    """

    several = True

    def __init__(
        self, strategy: tf.distribute.Strategy, worker: str | None, found: cluster.Cluster
    ):
        self.strategy, self.worker = strategy, worker
        # The chief first, as the replicas are ordered.
        self.addresses, self.index = list(found.addresses), found.index
        self.per_worker = max(strategy.num_replicas_in_sync // max(len(self.addresses), 1), 1)
        self._gather = None
        self.scratch: str | None = None
        self.watchdog: watchdog.Watchdog | None = None

    def watch(self, timeout: float) -> watchdog.Watchdog:
        """A watchdog over every worker's progress (``watchdog``), for one training run."""
        self.watchdog = watchdog.Watchdog(
            self.index, self.addresses, timeout, next(_WATCHES), exit_now
        )
        return self.watchdog

    def heartbeat(self, phase: str, step: int | None = None) -> None:
        """This worker's progress, for the watchdog: it enters ``phase`` at ``step``."""
        if self.watchdog is not None:
            self.watchdog.heartbeat(phase, step)

    def write_dir(self, model_dir: str) -> str:
        """Where this worker writes: ``model_dir`` for the chief, else a scratch directory."""
        if self.worker is None:
            return model_dir
        if self.scratch is None:
            self.scratch = tempfile.mkdtemp(prefix=f"trainer-{self.worker}-")
            SCRATCH.append(self.scratch)
            atexit.register(remove_scratch)
        return self.scratch

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """``values`` of every worker, in worker order (one small all-gather)."""
        if self._gather is None:

            @tf.function
            def gather(row: tf.Tensor) -> tf.Tensor:
                rows = self.strategy.run(lambda: row[None, :])  # each replica's [1, n]
                return self.strategy.gather(rows, axis=0)  # [replicas, n], in replica order

            self._gather = gather
        rows = self._gather(tf.constant(list(values), tf.int64)).numpy().tolist()
        return rows[:: self.per_worker]

    def check_same_start(
        self, find_latest: Callable[[], str | None], model_dir: str, config: Callable[[], str]
    ) -> str | None:
        """The checkpoint to resume from; refuses workers given different configs or ones.

        ``config()`` is this worker's configuration as text; ``find_latest()`` finds the
        checkpoint it would resume from, called once every worker has exchanged its
        config: by then the chief has finished writing its previous save (a second
        ``train()`` in one process could look before the chief's checkpoint list was
        written, and see none).
        """
        self._check_same_config(config())
        latest = find_latest()
        step = int(latest.rsplit("-", 1)[1]) if latest else -1
        steps = [row[0] for row in self.gather([step])]
        if len(set(steps)) == 1:
            return latest
        seen = ", ".join(
            f"worker {i} {'ckpt-' + str(s) if s >= 0 else 'none'}" for i, s in enumerate(steps)
        )
        raise UserError(
            f"the workers see different checkpoints in {model_dir} ({seen}): model_dir must "
            "be one directory every worker sees (shared storage), or pass each worker the "
            "same --model_dir"
        )

    def _wait_for_readers(self, store, check: int, seconds: float = 10) -> None:
        """Waits (a while) until every other worker has read the configs exchanged."""
        for index in range(1, len(self)):
            with contextlib.suppress(tf.errors.OpError):  # a worker gone cannot read
                key = f"trainer/config/{check}/read/{index}"
                store.get_config_key_value(key, timeout_in_ms=int(seconds * 1000))

    def _check_same_config(self, config: str) -> None:
        store = internals.key_value_store()
        # A key is written once: each check (a train() call) has its own, numbered
        # alike on every worker, which makes the same calls in the same order.
        check = next(_CONFIG_CHECKS)
        store.set_config_key_value(f"trainer/config/{check}/{self.index}", config)
        texts = [
            store.get_config_key_value(f"trainer/config/{check}/{i}") for i in range(len(self))
        ]
        store.set_config_key_value(f"trainer/config/{check}/read/{self.index}", "read")
        for index, text in enumerate(texts[1:], 1):
            changes = config_diff.differences(texts[0], text)
            if changes:
                if self.index == 0:  # the store ends with the chief: the others read first
                    self._wait_for_readers(store, check)
                raise UserError(
                    f"worker {index} was started with another config than worker 0: "
                    f"{'; '.join(changes)} (worker 0 -> {index}); start every worker with the "
                    "same --gin_file and --gin_param (only a data_dir may differ)"
                )

    def __len__(self) -> int:
        return len(self.addresses)

    def signalled(self, signals: list[str]) -> str | None:
        """Whether any worker was sent a stop signal: ``'worker 1 received SIGTERM'``."""
        mine = int(getattr(signal, signals[0])) if signals else 0
        received = [number for (number,) in self.gather([mine])]
        if mine:  # its own first: under --workers every worker is sent it
            return f"{signal.Signals(mine).name} received"
        for index, number in enumerate(received):
            if number:
                return f"worker {index} received {signal.Signals(number).name}"
        return None

    def lost(self, error: Exception, step: int, latest: str | None) -> PeerLost:
        """The one line for a collective that failed because a peer died or hung.

        The error itself (a gRPC status, a traceback) goes to the log, not the console.
        """
        logging.info("A collective failed:", exc_info=error, extra={"console": False})
        resume = f"every worker resumes from {latest}" if latest else "no checkpoint yet"
        lost = _what_stopped(error, f"after step {step}", self.index, self.addresses)
        return PeerLost(
            f"{lost}; {resume} when all {len(self)} are started again with the same command"
        )


def check_same_cluster(found: cluster.Cluster, timeout_seconds: int = 60) -> None:
    """Refuses, on every worker, a TF_CONFIG whose cluster differs between workers.

    Once the strategy is made every worker has joined the coordination service; each
    puts its cluster in the service's key-value store and compares the others' with
    its own, the chief's first. Without this a worker given another address hangs, and
    one given another worker count dies in a collective.
    """
    mine = json.dumps(found.spec, sort_keys=True)
    addresses, index = found.addresses, found.index
    store = internals.key_value_store()
    try:
        store.set_config_key_value(f"trainer/cluster/{index}", mine)
    except tf.errors.AlreadyExistsError:
        raise UserError(
            f"two workers were given TF_CONFIG task index {index}: give each worker its own "
            f"index, 0 to {len(addresses) - 1}"
        ) from None
    for other in sorted(set(range(len(addresses))) - {index}):
        try:
            theirs = store.get_config_key_value(
                f"trainer/cluster/{other}", timeout_in_ms=timeout_seconds * 1000
            )
        except tf.errors.DeadlineExceededError:
            raise UserError(
                f"worker {other} ({addresses[other]}) of TF_CONFIG's cluster did not join in "
                f"{timeout_seconds}s: give every worker the same cluster in TF_CONFIG"
            ) from None
        if theirs != mine:
            raise UserError(
                f"TF_CONFIG's cluster differs between workers: worker {index} has {mine}, "
                f"worker {other} has {theirs}; give every worker the same cluster (only "
                "task.index differs)"
            )


# What a collective raises when a peer dies or stops answering.
PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
)


def lost_before_training(error: Exception, found: cluster.Cluster) -> PeerLost:
    """The one line for a peer lost while the workers start (the loop's own is ``lost``)."""
    addresses = list(found.addresses)
    lost = _what_stopped(error, "before training", found.index, addresses)
    return PeerLost(f"{lost}; start all {len(addresses)} workers again with the same command")


def _what_stopped(error: Exception, when: str, index: int, addresses: list[str]) -> str:
    """The watchdog's reason an aborted collective carries, or the peer a failed one lost."""
    stalled = watchdog.reason(error)
    if stalled:
        return f"stopped {when}: {stalled}"
    who = _named_peer(error, index, addresses)
    return f"lost {who} {when}: it died or stopped answering"


def _named_peer(error: Exception, index: int, addresses: list[str]) -> str:
    peer = lost_peer(error, index)
    if peer is None:
        return "a peer worker"
    return f"worker {peer} ({addresses[peer] if peer < len(addresses) else '?'})"


def lost_peer(error: Exception, index: int) -> int | None:
    """The task index of the peer a collective error names, if it names one but this one.

    A heartbeat to the coordination service that went unanswered names its leader,
    the chief: it stopped (a process stopped, a machine hung) rather than died.
    """
    for task in re.findall(r"/job:(?:worker|chief)/replica:\d+/task:(\d+)", str(error)):
        if int(task) != index:
            return int(task)
    if "CoordinationService/Heartbeat" in str(error) and index != 0:
        return 0
    return None
