"""The training stream: the input's one owner from ``input_fn`` to the step.

One training run's input goes through these stages, all in this module:

* **made**: the input_fn's dataset, starting where the checkpoint's input stands
  (``open``: position and seed are read from the checkpoint before anything is
  restored, so the dataset is built once, in place);
* **iterated**: one process (one device, towers) iterates it with an iterator a
  checkpoint can hold; a tf.distribute strategy's distributed iterator, which no
  checkpoint can hold, is made after restoring, at the restored step (``start``);
* **saved**: what every checkpoint keeps of it (``checkpoint_items``): its position
  and seed, and for a dataset not read by position (a user's shuffled pipeline) the
  tf.data iterator itself, whose size is checked after the first save (``saved``);
* **moved on**: ``advance`` after each block; ``skip_batch`` past the batch of a
  step that went non-finite before a rollback; ``rewind`` to the restored position
  after a rollback (a positioned dataset; a saved iterator is restored with the
  checkpoint).

The training loop (``training.py``) asks the stream for its ``iterator`` and tells it
what happened; divergence handling decides which batch to skip and the stream skips
it; nothing else holds the iterator.
"""

from __future__ import annotations

from absl import logging

from trainer import monitoring
from trainer.distributed.placement import Placement
from trainer.inputs import InputFn, Inputs
from trainer.model_fn import Mode, batch_sizes, is_positioned


class TrainingStream:
    """The training input of one run: its dataset, iterator, saved state and position.

    Args:
      inputs: calls input_fns and keeps the stream's position and seed.
      placement: where training runs (which kind of iterator).
      input_fn: the training input_fn.
      checkpoint_input: keep a dataset not read by position in the checkpoints, as
        its tf.data iterator (``Checkpoints.input``).
    """

    def __init__(
        self, inputs: Inputs, placement: Placement, input_fn: InputFn, checkpoint_input: bool
    ):
        self.inputs, self.placement, self.input_fn = inputs, placement, input_fn
        self.checkpoint_input = checkpoint_input
        self.dataset = None
        self.iterator = None  # made by checkpoint_items (one process) or start (strategies)
        self.positioned = False  # read by position: restarts anywhere on any devices
        self.sizes = None  # batches that vary in examples: where the stream stands after
        self._size_unchecked = False  # a saved iterator's size is checked once

    def open(self, checkpoint: str | None):
        """The training dataset, from where ``checkpoint``'s input stands (None: the start)."""
        self.inputs.resume_from(checkpoint)
        self.dataset = self.inputs.dataset(self.input_fn, Mode.TRAIN)
        self.positioned = is_positioned(self.dataset)
        self.sizes = batch_sizes(self.dataset) if self.positioned else None
        return self.dataset

    @property
    def saves_iterator(self) -> bool:
        """Whether the checkpoints hold the tf.data iterator (not only a position)."""
        return self.checkpoint_input and self.iterator is not None and not self.positioned

    def checkpoint_items(self, checkpoint: str | None) -> dict:
        """What a checkpoint keeps of the stream, by key; makes the iterator it may hold."""
        self.placement.workers.heartbeat("making its input pipeline")  # calls the input_fn again
        self.iterator = self.placement.saved_iterator(self.dataset)
        items = self.inputs.state()
        if self.saves_iterator:
            items.update(self.inputs.iterator_state(self.iterator, checkpoint))
            self._size_unchecked = True
        return items

    def start(self, step: int) -> None:
        """Before the first block: a strategy's iterator, made at the restored ``step``."""
        if self.iterator is None:
            self.placement.workers.heartbeat("making its input pipeline", step)
            self.iterator = self.inputs.train_iterator(self.input_fn, step)

    def examples_read(self) -> int:
        """How many examples of the stream the steps so far have read (its position)."""
        return int(self.inputs.position.numpy())

    def advance(self, steps: int) -> None:
        """Counts ``steps`` more global batches as read (after a block)."""
        self.inputs.advance(steps, self.sizes)

    def skip_batch(self, step: int) -> None:
        """Reads past the batch of ``step``, which went non-finite before a rollback."""
        next(self.iterator)
        self.inputs.advance(1, self.sizes)
        logging.warning("Skipping the batch of step %d (NaN or Inf)", step)

    def rewind(self, step: int) -> None:
        """After a rollback to ``step``: a positioned stream starts again from there.

        A saved iterator was restored with the checkpoint; a strategy's iterator goes on
        (its batches are not checkpointed).
        """
        if self.positioned:
            self.iterator = self.inputs.train_iterator(self.input_fn, step)

    def saved(self, path: str) -> None:
        """After a checkpoint: the first one's saved iterator is checked for its size."""
        if self._size_unchecked:
            self._size_unchecked = False
            monitoring.check_input_state(path, self.dataset)
