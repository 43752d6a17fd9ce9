"""A run's hyperparameters, for TensorBoard's HParams tab: its operative gin bindings.

When a training run of the command line ends, its chief writes every operative gin
binding as one hyperparameter (``Adam.learning_rate``; a list, a reference or None as
its gin text) to an events file at the model_dir's root, with how the run ended. The
HParams plugin then shows the model_dir as one session whose metric groups are
``train`` and each ``eval_<name>``, each metric at its last value, so runs in sibling
model_dirs compare side by side. What only says where, how long or how often a run
goes (the resumable settings, any ``data_dir``) is left out, so a resumed or extended
run stays one session.
"""

from __future__ import annotations

import ast
import contextlib
import os
import time
from collections.abc import Callable

import tensorflow as tf
from tensorboard.plugins.hparams import api as hp
from tensorboard.plugins.hparams import api_pb2
from tensorboard.plugins.hparams import summary as hparams_summary

from trainer import checkpoints, config_diff
from trainer.errors import Preempted, TrainingDiverged


def of_config(text: str, left_out: set[str]) -> dict[str, bool | int | float | str]:
    """The hyperparameters of a gin config text: ``{'Adam.learning_rate': 0.001, ...}``.

    ``left_out`` names ``'Configurable.param'`` bindings that are not hyperparameters.
    """
    values = {}
    for key, text_value in config_diff.bindings(text).items():
        short = config_diff.short_name(key)
        if short in left_out or short.endswith(".data_dir"):
            continue
        values[key] = _scalar(text_value)
    return values


def _scalar(text: str) -> bool | int | float | str:
    """A number, a truth value or a string as itself; anything else as its gin text."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, (bool, int, float, str)) else text


@contextlib.contextmanager
def session(model_dir: str, config_text: Callable[[], str], left_out: set[str], chief: bool):
    """Writes the run's hyperparameters and its end status once it ends, if it trained.

    A run that stopped to be resumed (preempted) is left running; one that diverged
    is marked failed. A mistake (a ``UserError``, any other exception) changes
    nothing in model_dir, and nothing is written where training never checkpointed.
    """
    started = time.time()
    status: int | None = api_pb2.STATUS_SUCCESS
    try:
        yield
    except Preempted:
        status = api_pb2.STATUS_RUNNING
        raise
    except TrainingDiverged:
        status = api_pb2.STATUS_FAILURE
        raise
    except BaseException:
        status = None
        raise
    finally:
        if status is not None and chief and checkpoints.all_checkpoints(model_dir):
            write(model_dir, of_config(config_text(), left_out), started, status)


def write(model_dir: str, values: dict, started: float, status: int) -> None:
    """The session's start (its hyperparameters) and, unless still running, its end."""
    writer = tf.summary.create_file_writer(model_dir)
    with writer.as_default():
        hp.hparams(
            values,
            trial_id=os.path.basename(os.path.abspath(model_dir)),
            start_time_secs=int(started),
        )
        if status != api_pb2.STATUS_RUNNING:
            end = hparams_summary.session_end_pb(status, end_time_secs=int(time.time()))
            tf.summary.experimental.write_raw_pb(end.SerializeToString(), step=0)
    writer.close()
