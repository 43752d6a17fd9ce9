"""Several workers as one run: one checkpoint for all, and a stop they agree on.

Under ``'multi_worker'`` every worker runs the same loop. What keeps them one run:

* **One set of checkpoints.** Every worker restores the chief's checkpoint from
  ``model_dir``, which must be one directory all of them see (shared storage, as
  TensorFlow requires). The others write what a save needs to a scratch directory of
  their own and remove it (TensorFlow's recommended pattern), so ``model_dir`` holds
  one set of checkpoints whatever the worker count.
* **The same start.** Before the first step the workers compare the step each would
  resume from; if they differ (a worker that cannot see the chief's checkpoints),
  every worker stops in one line before training.
* **A stop they agree on.** At each block boundary the workers share whether any of
  them was sent SIGTERM or SIGINT (one all-reduce of a few integers per block), so a
  signal to any one worker makes every worker save the same step and exit 75.

The agreement is a sum over replicas of one-hot rows: each replica writes its values
in its own row, and every worker reads every row.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Sequence

import tensorflow as tf
from absl import logging

from trainer.errors import PeerLost, UserError


class Workers:
    """The workers of a ``MultiWorkerMirroredStrategy`` run, seen from one of them.

    Args:
      strategy: the run's ``MultiWorkerMirroredStrategy``.
      worker: this worker's name (``'worker_1'``), None for the chief.
    """

    def __init__(self, strategy: tf.distribute.Strategy, worker: str | None):
        self.strategy, self.worker = strategy, worker
        resolver = strategy.cluster_resolver
        self.index = resolver.task_id or 0
        self.addresses = _addresses()
        self.per_worker = max(strategy.num_replicas_in_sync // max(len(self.addresses), 1), 1)
        self._gather = None
        self.scratch: str | None = None

    def write_dir(self, model_dir: str) -> str:
        """Where this worker writes: ``model_dir`` for the chief, else a scratch directory."""
        if self.worker is None:
            return model_dir
        if self.scratch is None:
            self.scratch = tempfile.mkdtemp(prefix=f"trainer-{self.worker}-")
            atexit.register(shutil.rmtree, self.scratch, ignore_errors=True)
        return self.scratch

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """``values`` of every worker, in worker order (one small all-reduce)."""
        if self._gather is None:
            replicas = self.strategy.num_replicas_in_sync

            @tf.function
            def gather(row: tf.Tensor) -> tf.Tensor:
                def one_hot_row() -> tf.Tensor:
                    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                    return tf.one_hot(replica, replicas, dtype=tf.int64)[:, None] * row[None, :]

                rows = self.strategy.run(one_hot_row)
                return self.strategy.reduce(tf.distribute.ReduceOp.SUM, rows, axis=None)

            self._gather = gather
        rows = self._gather(tf.constant(list(values), tf.int64)).numpy().tolist()
        return rows[:: self.per_worker]

    def check_same_start(self, latest: str | None, model_dir: str) -> None:
        """Refuses, on every worker, a run whose workers would resume from different steps."""
        step = int(latest.rsplit("-", 1)[1]) if latest else -1
        steps = [row[0] for row in self.gather([step])]
        if len(set(steps)) == 1:
            return
        seen = ", ".join(
            f"worker {i} {'ckpt-' + str(s) if s >= 0 else 'none'}" for i, s in enumerate(steps)
        )
        raise UserError(
            f"the workers see different checkpoints in {model_dir} ({seen}): model_dir must "
            "be one directory every worker sees (shared storage), or pass each worker the "
            "same --model_dir"
        )

    def signalled(self, signals: list[str]) -> str | None:
        """Whether any worker was sent SIGTERM or SIGINT: ``'worker 1 received SIGTERM'``."""
        mine = int(getattr(signal, signals[0])) if signals else 0
        for index, (number,) in enumerate(self.gather([mine])):
            if number:
                name = signal.Signals(number).name
                return (
                    f"{name} received" if index == self.index else f"worker {index} received {name}"
                )
        return None

    def lost(self, error: Exception, step: int, latest: str | None) -> PeerLost:
        """The one line for a collective that failed because a peer died or hung.

        The error itself (a gRPC status, a traceback) goes to the log, not the console.
        """
        logging.info("A collective failed:", exc_info=error, extra={"console": False})
        peer = lost_peer(error, self.index)
        if peer is None:
            who = "a peer worker"
        else:
            address = self.addresses[peer] if peer < len(self.addresses) else "?"
            who = f"worker {peer} ({address})"
        resume = f"every worker resumes from {latest}" if latest else "no checkpoint yet"
        return PeerLost(
            f"lost {who} after step {step}: it died or stopped answering; {resume} when all "
            f"{len(self.addresses)} are started again with the same command"
        )


# What a collective raises when a peer dies or stops answering.
PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
)


def _addresses() -> list[str]:
    """The workers' addresses from TF_CONFIG, chief first (checked by parallel.make_strategy)."""
    cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
    return [*cluster.get("chief", []), *cluster.get("worker", [])]


def lost_peer(error: Exception, index: int) -> int | None:
    """The task index of the peer a collective error names, if it names one but this one."""
    for task in re.findall(r"/job:(?:worker|chief)/replica:\d+/task:(\d+)", str(error)):
        if int(task) != index:
            return int(task)
    return None
