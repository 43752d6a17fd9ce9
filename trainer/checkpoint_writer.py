"""Writing checkpoints: which are kept, and saves that do not stop training.

``Retention`` decides what a model_dir keeps after each save: the newest
``Checkpoints.keep``, every checkpoint at a multiple of
``Checkpoints.keep_every_steps`` (the same on every restart and every worker), and those
of the best exports (``Checkpoints.keep_best``). It deletes the others and lists the
kept ones, newest last, in the ``checkpoint`` file, so that each can still be named
by its step. TensorFlow's CheckpointManager keeps only the newest N by count, or
by hours, and drops what it keeps by hours from its list.

``Background`` writes a checkpoint while training goes on: training waits only while
the values are copied to host memory (TensorFlow's async checkpointing), a thread
waits for the files and then lists the checkpoint. A checkpoint is listed only once
it is whole, so a process killed mid-save resumes from the one before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as pylogging
import os
import re
import threading
import warnings
from collections.abc import Callable

import tensorflow as tf
from absl import logging

from trainer import checkpoints, errors, internals
from trainer.checkpoints import CHECKPOINT_NAME, READ_ERRORS, Damaged, step_of
from trainer.errors import UserError

_LISTING = threading.Lock()  # one change to a model_dir's list at a time


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a training run keeps besides its newest checkpoints, and how it writes them."""

    keep_every: int | None = None  # keep every checkpoint at a multiple of this step
    protected: Callable[[], set[int]] = set  # the steps of the best exports, if kept
    background: bool = False  # write in the background
    keep_best: bool = False  # whether ``protected`` names the best exports' steps

    def retention(self, model_dir: str, keep_max: int) -> Retention:
        """The rule that keeps checkpoints in ``model_dir`` under this policy."""
        return Retention(model_dir, keep_max, self.keep_every, self.protected)

    def exported(self, model_dir: str, keep_max: int) -> None:
        """The best exports changed: so may the checkpoints kept for them (the chief's call)."""
        if self.keep_best:
            self.retention(model_dir, keep_max).add()


def policy(
    keep_every: int | None,
    keep_best: bool,
    background: bool | None,
    best_exporter,
    distribution: str | None,
) -> Policy:
    """The Estimator's checkpoint settings, checked; ``distribution`` names a strategy."""
    if keep_best and best_exporter is None:
        raise UserError(
            "Checkpoints.keep_best keeps the checkpoints of the best exports: set "
            "BestExport.metric (and BestExport.keep, how many) too"
        )
    if background and distribution is not None:
        raise UserError(
            f"Checkpoints.background = True cannot write in the background under "
            f"distribution '{distribution}': leave it None (saves wait there), or train "
            "on one device or with towers"
        )
    return Policy(
        keep_every,
        (lambda: {entry["step"] for entry in best_exporter.kept}) if keep_best else set,
        distribution is None if background is None else background,
        keep_best,
    )


class Retention:
    """Which checkpoints of ``model_dir`` stay after a save; lists them.

    Args:
      model_dir: where the checkpoints and their ``checkpoint`` list are.
      keep_max: the newest this many are kept.
      keep_every: every checkpoint at a multiple of this step is kept too (None: none).
      protected: returns steps kept besides (those of the best exports).
    """

    def __init__(
        self,
        model_dir: str,
        keep_max: int,
        keep_every: int | None = None,
        protected: Callable[[], set[int]] = set,
    ):
        self.model_dir, self.keep_max, self.keep_every = model_dir, keep_max, keep_every
        self.protected = protected

    def kept(self, steps: list[int]) -> list[int]:
        """The steps of ``steps`` (oldest first) to keep, oldest first."""
        newest = set(steps[-self.keep_max :])
        every = {s for s in steps if self.keep_every and s % self.keep_every == 0}
        return [s for s in steps if s in newest | every | self.protected()]

    def add(self, path: str | None = None) -> None:
        """Lists the whole checkpoint ``path`` as the newest; deletes those not kept.

        Without a path, applies the rule again (the best exports changed).
        """
        with _LISTING:  # a background save lists from its thread
            listed = checkpoints.all_checkpoints(self.model_dir)
            steps = {checkpoints.step_of(p) for p in listed}
            steps = sorted(steps | ({checkpoints.step_of(path)} if path else set()))
            kept = self.kept(steps)
            if not kept:
                return
            checkpoints.relist(self.model_dir, [self._path(s) for s in kept])  # list first
            for step in set(steps) - set(kept):
                remove(self._path(step))

    def _path(self, step: int) -> str:
        return os.path.join(self.model_dir, f"{checkpoints.CHECKPOINT_NAME}-{step}")


def remove(prefix: str) -> None:
    """Deletes checkpoint ``prefix``'s files, and any a failed write left."""
    for path in tf.io.gfile.glob(prefix + ".*") + tf.io.gfile.glob(prefix + "_temp*"):
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        else:
            tf.io.gfile.remove(path)


class Background:
    """One checkpoint write at a time, in the background, listed once whole.

    ``write(path, done)`` starts a write of ``checkpoint`` and returns once its values
    are copied; ``done(path)`` is called from a thread when the files are complete.
    ``wait()`` returns when the write in flight (if any) is done, raising what made it
    fail: before the next write, before anything reads the newest checkpoint, and
    before training returns or stops.
    """

    OPTIONS = tf.train.CheckpointOptions(enable_async=True)

    def __init__(self, checkpoint: tf.train.Checkpoint):
        internals.copy_keras_variables_again()
        # Copying a tf.data iterator in a tf.function reads its dataset's options there,
        # which tf.data warns of each time; the copy serializes the iterator's state,
        # whatever its options say.
        warnings.filterwarnings(
            "ignore", "To make it possible to preserve tf.data options", UserWarning
        )
        self.checkpoint = checkpoint
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.path: str | None = None  # the write in flight, or the last one

    def write(self, path: str, done: Callable[[str], None]) -> None:
        """Starts writing ``path``; ``done(path)`` is called once it is whole."""
        self.wait()
        self.path = path
        self.checkpoint.write(path, options=self.OPTIONS)
        self.thread = threading.Thread(target=self._finish, args=(path, done), daemon=True)
        self.thread.start()

    def _finish(self, path: str, done: Callable[[str], None]) -> None:
        try:
            self.checkpoint.sync()
            done(path)
        except BaseException as error:  # noqa: BLE001 - raised in the main thread by wait()
            self.error = error

    def wait(self) -> None:
        """Returns once no write is in flight; raises what made the last one fail."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Lets go of TensorFlow's writer thread, and the copy of the variables it holds.

        Called with no write in flight (after ``wait``, which said any write that failed:
        TensorFlow raises it again here, so it is not said twice).
        """
        with contextlib.suppress(tf.errors.OpError, OSError):
            internals.release_async_checkpoint(self.checkpoint)


def input_changed(path: str) -> str:
    """What a checkpoint whose saved input iterator no longer fits its input_fn says."""
    return (
        f"checkpoint {path} holds the training input's tf.data iterator, which does not fit "
        "this input_fn's pipeline (changed since it was saved: a map, a source, an order); "
        "its weights, optimizer and step are intact: go on from them with "
        "Checkpoints.input = False (the input starts again at its first batch), or train "
        "with the input_fn it was saved with"
    )


class Checkpointer:
    """Saves every named trackable together and restores the newest checkpoint.

    Args:
      model_dir: where checkpoints and the ``checkpoint`` index file live.
      max_to_keep: how many recent checkpoints to keep (older ones are deleted).
      save_dir: another worker than the chief saves here, and removes what it saved:
        what every worker restores is the chief's, in model_dir (trainer/distributed/workers.py).
      keep_every: keep the checkpoints at multiples of this step too (``Retention``).
      protected: returns the steps whose checkpoints are kept besides.
      background: write in the background (``Background``), training going on.
      **trackables: what to save: model, optimizer, step, input iterator, RNG state.
    """

    def __init__(
        self,
        model_dir: str,
        max_to_keep: int = 5,
        save_dir: str | None = None,
        keep_every: int | None = None,
        protected: Callable[[], set[int]] = set,
        background: bool = False,
        **trackables,
    ):
        _hush_tensorflow()
        self.model_dir = model_dir
        self.scratch = save_dir if save_dir not in (None, model_dir) else None
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self._trackables = trackables
        model = trackables.get("model")
        self._variables = [  # to name a mismatched variable by its Keras path
            *getattr(model, "trainable_variables", []),
            *getattr(model, "non_trainable_variables", []),
        ]
        self.found = checkpoints.latest_checkpoint(model_dir)  # checked whole
        self.saved: str | None = None  # the newest this object saved (listed once whole)
        self.retention = Retention(model_dir, max_to_keep, keep_every, protected)
        self.background = Background(self.checkpoint) if background and not self.scratch else None

    @property
    def latest(self) -> str | None:
        """The newest checkpoint's path prefix, or None (a save in flight finished first)."""
        self.wait()
        return self.saved or self.found

    def wait(self) -> None:
        """Returns once the save in flight, if any, is written whole and listed.

        Raises:
          UserError: it failed (disk full); its files are removed, the one before stays.
        """
        if self.background is None:
            return
        try:
            self.background.wait()
        except (tf.errors.OpError, OSError) as error:
            raise self._failed(error) from None

    def close(self) -> None:
        """After the run's last save and ``wait``: the background writer let go."""
        if self.background is not None:
            self.background.close()

    def restore_latest(self, partial: bool = False, step: int | None = None) -> str | None:
        """Restores the newest checkpoint (or that of ``step``), if any; returns its path.

        Args:
          partial: allow the checkpoint to hold state this object does not ask for
            (an evaluator does not need the training input iterator); what it asks for
            must be there either way.
          step: the step of a listed checkpoint to restore instead of the newest.

        Raises:
          UserError: the checkpoint was written by a different model or input pipeline,
            or no checkpoint of ``step`` is listed.
        """
        path = self.latest if step is None else self._listed_at(step)
        if path is None:
            return None
        try:
            status = self.checkpoint.restore(path)
            if partial:
                status.expect_partial()
            status.assert_existing_objects_matched()
        except (*READ_ERRORS, AssertionError, ValueError, tf.errors.OpError) as error:
            raise self._not_restored(path, error) from None
        logging.info("Restored %s", path)
        return path

    def _not_restored(self, path: str, error: Exception) -> UserError:
        """Why ``path`` did not restore: its input iterator alone, its files, or its fit."""
        if self._fits_but_the_input(path):
            return UserError(input_changed(path))
        if isinstance(error, READ_ERRORS):
            return Damaged(path, checkpoints.read_error(error))
        return UserError(
            f"checkpoint {path} does not fit this model: {_mismatch(error, self._variables)}; "
            "train in a new --model_dir, or restore the config this checkpoint was trained with"
        )

    def _fits_but_the_input(self, path: str) -> bool:
        """Whether all but the saved input iterator restores from ``path``."""
        others = {key: value for key, value in self._trackables.items() if key != "input"}
        if len(others) == len(self._trackables):
            return False
        try:
            status = tf.train.Checkpoint(**others).restore(path)
            status.expect_partial()
            status.assert_existing_objects_matched()
        except (*READ_ERRORS, AssertionError, ValueError, tf.errors.OpError):
            return False
        return True

    def _listed_at(self, step: int) -> str:
        """The listed checkpoint of ``step``; refused, naming those listed, if none is."""
        listed = checkpoints.all_checkpoints(self.model_dir)
        for path in listed:
            if step_of(path) == step:
                return path
        steps = ", ".join(str(step_of(p)) for p in listed) or "none"
        raise UserError(
            f"no checkpoint of step {step} in {self.model_dir} (its checkpoints: {steps}): "
            "name one of them, or keep more (Checkpoints.keep_every_steps)"
        )

    def restore(self, path: str) -> None:
        """Restores one given checkpoint (used to roll back to the last good state)."""
        self.checkpoint.restore(path).assert_existing_objects_matched()
        logging.info("Restored %s", path)

    def save(self, step: int) -> str:
        """Writes a checkpoint numbered by ``step`` unless one for it exists already.

        In the background, it returns once the values are copied; the checkpoint is
        listed (and ``latest``) once its files are whole.

        Raises:
          UserError: the write failed (disk full, permissions); partial files are removed
            and the previous checkpoint stays the newest.
        """
        if self.latest is not None and step_of(self.latest) == step:
            return self.latest
        path = os.path.join(self.scratch or self.model_dir, f"{CHECKPOINT_NAME}-{step}")
        self.checkpoint.save_counter.assign_add(1)  # as tf.train.Checkpoint.save does
        try:
            if self.background is not None:
                self.background.write(path, self._listed)
                return path
            self.checkpoint.write(path)
        except (tf.errors.OpError, OSError) as error:
            raise self._failed(error, path) from None
        if self.scratch:  # the chief's copy is the one kept
            remove(path)
            self.saved = os.path.join(self.model_dir, os.path.basename(path))
            return self.saved
        self._listed(path)
        return path

    def _listed(self, path: str) -> None:
        self.retention.add(path)
        self.saved = path
        logging.info("Saved checkpoint %s", path)

    def _failed(self, error: Exception, path: str | None = None) -> UserError:
        """What to raise for a failed write; its files are removed."""
        path = path or self.background.path
        remove(path)
        fix = "free space or choose another --model_dir"
        if "SerializeIterator" in str(error) and "is stateful" in str(error):
            fix = (
                "the training input's tf.data iterator runs a stateful op (a py_function, "
                "say) that it cannot save: read the data by position (trainer.positioned), "
                "or set the dataset's options().experimental_external_state_policy to "
                "IGNORE if that op keeps no state"
            )
        return UserError(
            f"could not write checkpoint {os.path.basename(path)} in {self.model_dir} "
            f"({errors.first_line(error)}); {fix}. The newest complete checkpoint is still "
            f"{self.saved or self.found}"
        )


class _OneTracePerSave(pylogging.Filter):
    """Drops TensorFlow's "excessive retracing" warning about async checkpointing's copy.

    Each Checkpoint has its own copy function, traced once; TensorFlow counts the
    traces of all of them together, so the fifth model trained in one process (a
    sweep's fifth trial) was warned of retracing it did not do.
    """

    def filter(self, record: pylogging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("_copy_to_cpu" in message and "retracing" in message)


def _hush_tensorflow() -> None:
    """Drops TensorFlow's noise about checkpoints from its logger, once.

    The filters (``checkpoints.RestoreNoise``, ``_OneTracePerSave``) go in when
    checkpoints are first made or read here, not when the module is imported: importing
    the framework changes nothing of the process's logging.
    """
    logger = tf.get_logger()
    for made in (checkpoints.RestoreNoise, _OneTracePerSave):
        if not any(isinstance(f, made) for f in logger.filters):
            logger.addFilter(made())


def _mismatch(error: Exception, variables: list) -> str:
    """Names the variables a failed restore complained about, in one line.

    TensorFlow names a variable by its short name (``dense/kernel``); when exactly one
    of ``variables`` has the shape it complains about, its Keras path is used instead.
    """
    text = str(error)
    if "DeserializeIterator" in text:
        return (
            "its saved input position does not fit this input pipeline (did the input_fn change?)"
        )
    shapes = re.search(
        r"incompatible tensor with shape (\(.*?\)) when attempting to restore "
        r"variable with shape (\(.*?\)) and name (\S+)",
        text,
    )
    if shapes:
        name = re.sub(r"(:0)?\.?$", "", shapes.group(3))
        same = [v.path for v in variables if str(tuple(v.shape)) == shapes.group(2)]
        name = same[0] if len(same) == 1 else name
        return f"{name} has shape {shapes.group(2)} here but {shapes.group(1)} in the checkpoint"
    paths = sorted(set(re.findall(r"path=([^,>\s]+)", text)))
    if paths:
        shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
        return f"no saved value for {shown}"
    return errors.first_line(text)
