"""What a NaN or Inf in training does: stop, or roll back to the last checkpoint.

The compiled loop (``step.Steps``) flags a non-finite loss at the step it happens
and non-finite weights after each block; ``Divergence`` turns the flags into what
the training loop does next: go on, rerun steps one by one to find the bad one,
skip a batch after a rollback, or end the run with ``TrainingDiverged``.
"""

from __future__ import annotations

from typing import NoReturn

import tensorflow as tf
from absl import logging

from trainer import checkpoint_writer
from trainer.errors import TrainingDiverged
from trainer.step import Steps


class Divergence:
    """What a NaN or Inf in training does: stop, or roll back and skip the bad batch.

    ``Steps`` checks each step's loss, and the weights after each block. A bad block
    of several steps is first rerun one step per block from the last checkpoint,
    which holds the input's position so the same batches come again: a NaN gradient
    can leave its own loss finite and show in a later step's loss, and only a rerun
    names the step that did it. Then the policy (``Optimization.nonfinite_loss``)
    decides: ``'stop'`` raises TrainingDiverged (the bad step's update is in the weights then: the
    caller must not use them), ``'rollback'`` restores the checkpoint and drops the bad
    step's batch, at most ``Optimization.max_rollbacks`` times.
    """

    def __init__(
        self,
        policy: str,
        max_rollbacks: int,
        checkpointer: checkpoint_writer.Checkpointer,
        global_step: tf.Variable,
    ):
        self.policy, self.max_rollbacks = policy, max_rollbacks
        self.checkpointer = checkpointer
        self.global_step = global_step
        self.skip_at: set[int] = set()  # steps whose batch is dropped
        self.rerun_until = 0  # steps up to this one run one per block
        self.rollbacks = self.reruns = 0

    def skips(self, step: int) -> bool:
        """Whether the batch of ``step`` is to be skipped: it went bad before a rollback.

        Asked once per step: the stream skips it then (``TrainingStream.skip_batch``).
        """
        if step not in self.skip_at:
            return False
        self.skip_at.discard(step)
        return True

    def limits(self, step: int) -> list[int]:
        """Caps on the next block's length: end before a batch to skip; one step in reruns."""
        caps = [s - 1 - step for s in self.skip_at if s - 1 > step]
        return caps + ([1] if step < self.rerun_until else [])

    def check(self, steps: Steps, first: int, n: int) -> int | None:
        """None if the block of ``n`` steps from ``first`` stayed finite.

        Otherwise the step training goes on from: the checkpoint's, to rerun the block
        or after a rollback; or TrainingDiverged.
        """
        bad_loss = bool(steps.nonfinite.numpy())  # the block ended before counting it
        if not bad_loss and not steps.nonfinite_weights.numpy():
            return None
        last = self._step() + 1 if bad_loss else self._step()
        latest = self.checkpointer.latest
        if n > 1 and latest is not None:
            return self._rerun(first, last, latest)
        self.rollbacks += 1
        where = f"at step {last}" if n == 1 else f"in steps {first}-{last}"
        kept = (
            f"the last good checkpoint, {latest}, is untouched" if latest else "no checkpoint yet"
        )
        allowed = self.max_rollbacks
        if self.policy != "rollback" or latest is None or self.rollbacks > allowed:
            hint = (
                f"gave up after {allowed} rollbacks"
                if self.rollbacks > allowed
                else "lower the learning rate, clip gradients, or set "
                "Optimization.nonfinite_loss = 'rollback' to skip bad batches"
            )
            self._diverged(f"loss or gradients NaN or Inf {where}; {kept}; {hint}")
        self.checkpointer.restore(latest)
        logging.warning(
            "Loss or gradients NaN or Inf at step %d: rolled back to %s; its batch is skipped",
            last,
            latest,
        )
        self.skip_at.add(last)
        self.rerun_until = 0
        return self._step()

    def _rerun(self, first: int, last: int, latest: str) -> int:
        """Restores ``latest`` so that steps up to ``last`` run again, one per block."""
        found = f"loss or weights NaN or Inf in steps {first}-{last}"
        self.reruns += 1
        if self.reruns > self.max_rollbacks:
            self._diverged(
                f"{found}; gave up after {self.reruns - 1} reruns; lower the learning rate "
                "or clip gradients"
            )
        self.checkpointer.restore(latest)
        logging.warning("%s: rerunning them one at a time from %s to find which", found, latest)
        self.rerun_until = last
        return self._step()

    def _step(self) -> int:
        return int(self.global_step.numpy())

    def _diverged(self, message: str) -> NoReturn:
        raise TrainingDiverged(message)
