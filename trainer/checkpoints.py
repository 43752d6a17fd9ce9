"""Save and restore training state in ``model_dir`` over tf.train.CheckpointManager."""

from __future__ import annotations

import tensorflow as tf
from absl import logging

CHECKPOINT_NAME = "ckpt"


def latest_checkpoint(model_dir: str) -> str | None:
    """The path prefix of the newest complete checkpoint in ``model_dir``, or None."""
    return tf.train.latest_checkpoint(model_dir)


def step_of(path: str) -> int:
    """The global step a checkpoint path was saved at (``.../ckpt-1200`` -> 1200)."""
    return int(path.rsplit("-", 1)[1])


class Checkpointer:
    """Saves every named trackable together and restores the newest checkpoint.

    Args:
      model_dir: where checkpoints and the ``checkpoint`` index file live.
      max_to_keep: how many recent checkpoints to keep (older ones are deleted).
      **trackables: what to save: model, optimizer, step, input iterator, RNG state.
    """

    def __init__(self, model_dir: str, max_to_keep: int = 5, **trackables):
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, model_dir, max_to_keep=max_to_keep, checkpoint_name=CHECKPOINT_NAME
        )

    @property
    def latest(self) -> str | None:
        """The newest checkpoint's path prefix, or None."""
        return self.manager.latest_checkpoint

    def restore_latest(self, partial: bool = False) -> str | None:
        """Restores the newest checkpoint, if any, and returns its path.

        Args:
          partial: allow the checkpoint to hold state this object does not ask for
            (an evaluator does not need the training input iterator).
        """
        path = self.latest
        if path is None:
            return None
        status = self.checkpoint.restore(path)
        if partial:
            status.expect_partial()
        else:
            status.assert_existing_objects_matched()
        logging.info("Restored %s", path)
        return path

    def save(self, step: int) -> str:
        """Writes a checkpoint numbered by ``step`` unless one for it exists already."""
        if self.latest is not None and step_of(self.latest) == step:
            return self.latest
        path = self.manager.save(checkpoint_number=step)
        logging.info("Saved checkpoint %s", path)
        return path
