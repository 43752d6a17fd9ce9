"""The input side of the Estimator: calling input_fns, and where the training stream stands.

``Inputs`` calls an ``input_fn`` with the right ``InputParams`` and checks what it
returns. For training it keeps two integers that every checkpoint holds:

* ``position``: how many examples of the training stream earlier steps read
  (skipped bad batches included); a positioned dataset starts there, on any number
  of devices or workers;
* ``seed``: the training order's seed, kept from the first start (drawn then if the
  run's seed is None), so that a resumed run reads on in the same order.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable, Mapping

import tensorflow as tf
from absl import logging

from trainer import checkpoints, evaluation
from trainer.distributed.placement import Placement
from trainer.errors import UserError
from trainer.model_fn import InputParams, Mode, labeled

InputFn = Callable[[Mode, InputParams], tf.data.Dataset]


class Inputs:
    """Builds the datasets of input_fns for one Estimator.

    Args:
      placement: where training runs (a pipeline's batch, the training iterator).
      global_batch_size: examples per training step over all devices.
      eval_batch_size: examples per eval and predict batch.
      seed: the run's seed (None: a training seed is drawn at the first start).
      seconds: where the time went; calling input_fns adds to ``'input'``.
      bare_training: the training input may yield x alone, as fit takes it (a model's
        own train_step).
      input_map: the model's map of each dataset (``ModelFn.input_map``), or None.
    """

    def __init__(
        self,
        placement: Placement,
        global_batch_size: int,
        eval_batch_size: int,
        seed: int | None,
        seconds: collections.Counter | None = None,
        bare_training: bool = False,
        input_map: Callable[[tf.data.Dataset, Mode], tf.data.Dataset] | None = None,
    ):
        self.placement = placement
        self.input_map = input_map  # the model's own map of every dataset (ModelFn.input_map)
        self.bare_training = bare_training  # x alone, as fit takes it: a model's own step
        self.seconds = collections.Counter() if seconds is None else seconds
        self.global_batch_size, self.eval_batch_size = global_batch_size, eval_batch_size
        self.run_seed = seed
        with placement.scope():
            self.position = tf.Variable(0, dtype=tf.int64, trainable=False, name="input_position")
            self.seed = tf.Variable(-1, dtype=tf.int64, trainable=False, name="input_seed")
            self.batch_size = tf.Variable(
                global_batch_size, dtype=tf.int64, trainable=False, name="input_batch_size"
            )

    def state(self) -> dict[str, tf.Variable]:
        """The variables a checkpoint keeps of the input, by checkpoint key."""
        return {"input_position": self.position, "input_seed": self.seed}

    def resume_from(self, checkpoint: str | None) -> None:
        """Takes position and seed from ``checkpoint`` (None: a first start).

        Read before anything restores it, so that the training dataset is built
        once, in place.
        """
        saved = checkpoints.saved_ints(checkpoint, input_position=0, input_seed=-1)
        self.position.assign(saved["input_position"])
        self.seed.assign(self._training_seed(saved["input_seed"]))

    def iterator_state(self, iterator, checkpoint: str | None) -> dict:
        """What a checkpoint keeps of a training iterator that is saved, not positioned.

        Its batch size as well: a restored ``tf.data`` iterator goes on batching as it
        was saved, so a run with another ``global_batch_size`` is refused up front.
        """
        saved = checkpoints.saved_ints(checkpoint, input_batch_size=-1)["input_batch_size"]
        if saved not in (-1, self.global_batch_size):
            raise UserError(
                f"{checkpoint} holds the training input's tf.data iterator, which batches "
                f"{saved} examples, so global_batch_size cannot change to "
                f"{self.global_batch_size} there: keep {saved}, or train in a new --model_dir "
                "(a dataset read by position, as in datasets/, can change it)"
            )
        if checkpoint is not None and saved == -1:  # written before batch sizes were kept
            return {"input": iterator}
        return {"input": iterator, "input_batch_size": self.batch_size}

    def advance(self, steps: int, after: Callable[[int, int], int] | None = None) -> None:
        """Counts ``steps`` more global batches of the stream as read.

        ``after(position, steps)``: where the stream then stands, for batches that vary
        in how many examples they take (``model_fn.sized_by``).
        """
        if after is None:
            self.position.assign_add(steps * self.global_batch_size)
        else:
            self.position.assign(after(int(self.position.numpy()), steps))

    def dataset(
        self, input_fn: InputFn, mode: Mode, params: InputParams | None = None
    ) -> tf.data.Dataset:
        """The input_fn's dataset for ``mode``, checked; one pipeline's unless ``params``.

        In TRAIN it starts at ``position``.
        """
        if params is None:
            whole = self.global_batch_size if mode == Mode.TRAIN else self.eval_batch_size
            batch = self.placement.pipeline_batch(whole, mode)
            params = InputParams(  # a strategy's replicas' shares of a step, in turn
                batch_size=batch,
                global_batch_size=whole,
                seed=self._seed(mode),
                start_example=int(self.position.numpy()) if mode == Mode.TRAIN else 0,
            )
        if not callable(input_fn):
            got = type(input_fn).__name__
            raise UserError(
                f"the input_fn for mode {mode.value!r} must be a function (mode, params) -> "
                f"tf.data.Dataset, got {got} {input_fn!r:.60} (in gin, name it without "
                "parentheses: @my_input_fn)"
            )
        started = time.perf_counter()
        self.placement.workers.heartbeat(f"in its {mode.value} input_fn")
        dataset = input_fn(mode, params)
        self.placement.workers.heartbeat(f"past its {mode.value} input_fn")
        self.seconds["input"] += time.perf_counter() - started
        if not isinstance(dataset, tf.data.Dataset):
            raise UserError(
                f"input_fn {_name(input_fn)} returned {type(dataset).__name__} for mode "
                f"{mode.value!r}; it must return a tf.data.Dataset of (features, labels)"
            )
        spec = dataset.element_spec
        if _single_examples(spec):
            shapes = tf.nest.map_structure(lambda s: s.shape.as_list(), spec)
            shown = f"features {shapes[0]}, labels {shapes[1]}" if labeled(spec) else f"{shapes}"
            raise UserError(
                f"input_fn {_name(input_fn)} yields single examples ({shown}), not batches: "
                "end it with .batch(params.batch_size)"
            )
        if self.input_map is not None:  # a keras-hub task's preprocessor, which may make labels
            dataset = self.input_map(dataset, mode)
        bare = mode == Mode.PREDICT or (mode == Mode.TRAIN and self.bare_training)
        if not (bare or labeled(dataset.element_spec)):
            raise UserError(
                f"input_fn {_name(input_fn)} yields {spec} in mode {mode.value!r}; "
                "TRAIN and EVAL need (features, labels) or (features, labels, sample_weight)"
            )
        return dataset

    def eval_datasets(
        self, eval_input_fns: InputFn | Mapping[str, InputFn]
    ) -> dict[str, tf.data.Dataset]:
        """The EVAL dataset of each eval set, by name (one input_fn is named ``eval``)."""
        named = evaluation.eval_sets(eval_input_fns)
        return {name: self.dataset(fn, Mode.EVAL) for name, fn in named.items()}

    def train_iterator(self, input_fn: InputFn, step: int):
        """A new iterator over the training input, from ``position`` (the step's)."""
        params = InputParams(
            batch_size=self.global_batch_size,
            global_batch_size=self.global_batch_size,
            seed=self._seed(Mode.TRAIN),
            start_example=int(self.position.numpy()),
        )
        return self.placement.train_iterator(
            lambda p: self.dataset(input_fn, Mode.TRAIN, p), params, step
        )

    def _training_seed(self, saved: int) -> int:
        """The training input's seed: the checkpoint's, else the run's, else a new one."""
        if saved >= 0:
            if self.run_seed is not None and self.run_seed != saved:
                logging.warning(
                    "The training input keeps the seed its checkpoints were trained with "
                    "(%d), not seed %d, so that it reads on in the same order",
                    saved,
                    self.run_seed,
                )
            return saved
        if self.run_seed is not None:
            return self.run_seed
        return random.SystemRandom().randrange(2**31)

    def _seed(self, mode: Mode) -> int | None:
        """The seed an input_fn is given: training's is kept in the checkpoints."""
        if mode == Mode.TRAIN and int(self.seed.numpy()) >= 0:
            return int(self.seed.numpy())
        return self.run_seed


def _single_examples(element_spec) -> bool:
    """Whether a dataset yields examples one by one: a batch has one leading dimension.

    A scalar cannot be a batch, nor can tensors whose known first sizes differ.
    """
    specs = [s for s in tf.nest.flatten(element_spec) if isinstance(s, tf.TensorSpec)]
    if any(s.shape.rank == 0 for s in specs):
        return True
    firsts = {s.shape[0] for s in specs if s.shape.rank}
    return None not in firsts and len(firsts) > 1


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
