"""Under multi_worker, a worker that stops making progress ends the run, named.

TensorFlow notices a worker that dies or stops heartbeating; one stuck while its
process still answers (in an input_fn, a deadlock) holds every other worker in its next
collective forever. So each worker beats its progress (``heartbeat``: the phase it enters,
at which step), and a thread of its own publishes the beat through the coordination
service every few seconds and reads every other worker's. When no worker's beat has
changed for ``timeout`` seconds the run is stalled: the workers behind the others
(fewest beats: the ones the others wait for) are named, this worker's collectives are
aborted, so that its training ends as it does for a lost peer (exit 75, every worker
resumes from the last checkpoint), and a worker whose main thread is stuck outside a
collective is ended by this thread after ``GRACE_SECONDS``, with the same line.
"""

from __future__ import annotations

import json
import threading
import time

import tensorflow as tf
from absl import logging

from trainer import exit_codes, internals

MARKER = "progress watchdog: "  # begins the reason carried by the aborted collectives
END = " |"  # ends it
GRACE_SECONDS = 10  # for the main thread to end on its own once collectives are aborted


class Watchdog:
    """Publishes this worker's heartbeats and watches every worker's while inside ``with``.

    Args:
      index: this worker's place among ``addresses`` (the chief first).
      addresses: every worker's address, for the message.
      timeout: seconds without a new heartbeat on any worker before the run is ended.
      run: this process's train() calls so far; keys differ between runs.
      end: ends this process with a line (``workers.exit_now``), when its main thread
        does not end on its own.
    """

    def __init__(self, index: int, addresses: list[str], timeout: float, run: int, end):
        self.index, self.addresses, self.timeout, self.end = index, addresses, timeout, end
        self.prefix = f"trainer/progress/{run}/"
        self.record = (0, 0, "starting")  # beats so far, step, phase
        self.period = max(min(5.0, timeout / 4), 0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def heartbeat(self, phase: str, step: int | None = None) -> None:
        """This worker enters ``phase`` (or goes on in it) at ``step`` (None: the same)."""
        beats, last, _ = self.record
        self.record = (beats + 1, last if step is None else step, phase)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        # Not longer: a call to a coordination service that stopped answering (a
        # hung chief) never returns, and the thread is a daemon.
        self._thread.join(timeout=1)

    def _watch(self) -> None:
        store = internals.key_value_store()
        started = time.monotonic()
        seen: dict[int, tuple] = {}
        changed = dict.fromkeys(range(len(self.addresses)), started)
        while not self._stop.wait(self.period):
            self._publish(store)
            now = time.monotonic()
            for index in changed:
                record = self._read(store, index)
                if record is not None and record != seen.get(index):
                    seen[index], changed[index] = record, now
            if all(now - when >= self.timeout for when in changed.values()):
                self._stalled(store, seen)
                return

    def _publish(self, store) -> None:
        key = f"{self.prefix}{self.index}"
        try:  # a key is written once: the last beat is taken away first
            store.delete_config_key_value(key)
            store.set_config_key_value(key, json.dumps(self.record))
        except (tf.errors.OpError, RuntimeError):  # the service is gone: beats stop coming
            pass

    def _read(self, store, index: int) -> tuple | None:
        try:
            text = store.get_config_key_value(f"{self.prefix}{index}", timeout_in_ms=500)
        except (tf.errors.OpError, RuntimeError):  # not yet published, or being replaced
            return None
        return tuple(json.loads(text))

    def _stalled(self, store, seen: dict[int, tuple]) -> None:
        """Ends the run: aborts this worker's collectives, then the process if it lingers."""
        reason, behind = self._verdict(seen)
        logging.info("%s%s", MARKER, reason, extra={"console": False})  # the end says it
        task = f" /job:worker/replica:0/task:{behind[0]}" if len(behind) == 1 else ""
        store.abort_collective_ops(tf.errors.UNAVAILABLE, f"{MARKER}{reason}{END}{task}")
        if not self._stop.wait(GRACE_SECONDS):
            self.end(
                f"{reason}; every worker resumes from the last checkpoint when all "
                f"{len(self.addresses)} are started again with the same command",
                exit_codes.PREEMPTED,
                "error",
            )

    def _verdict(self, seen: dict[int, tuple]) -> tuple[str, list[int]]:
        """What stalled, in words, and the indices of the workers behind the others."""
        beats = {index: seen.get(index, (0, 0, "starting")) for index in range(len(self.addresses))}
        fewest = min(record[0] for record in beats.values())
        behind = sorted(i for i, record in beats.items() if record[0] == fewest)
        took = f"for {self.timeout:g}s (Devices.progress_timeout)"
        if len(behind) == len(beats):
            _, step, phase = beats[0]
            return f"no worker made progress {took}, all {phase} at step {step}", []
        names = ", ".join(
            f"worker {i} ({self.addresses[i]}, {beats[i][2]} at step {beats[i][1]})" for i in behind
        )
        return f"{names} made no progress {took} while the others waited", behind


def reason(error: Exception) -> str | None:
    """The watchdog's reason carried by an aborted collective's error, if it is one."""
    text = str(error)
    if MARKER not in text:
        return None
    return text.split(MARKER, 1)[1].split(END, 1)[0]
