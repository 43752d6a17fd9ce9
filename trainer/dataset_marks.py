"""Marks an input function puts on its dataset, kept through the user's ``.map()``.

Three marks say what the framework may rely on: ``model_fn.positioned`` (a training
stream that starts at ``params.start_example``), ``model_fn.counted`` (how many
examples an eval set yields) and ``serving.serves`` (what an export takes). A
user's input_fn often goes on from a marked dataset: ``.map(add_feature)``,
``.prefetch()``. ``find`` looks for a mark on the dataset and, through the stages
that keep what it says, on the dataset each stage reads:

* a stage that passes the same elements on (prefetch, options, cache, a cardinality
  assertion) keeps every mark;
* a map keeps each element's place in the stream and the count, so ``positioned``
  and ``counted`` hold; it changes the features, so ``serves`` does not (an export
  would not apply the map): mark the mapped dataset with a ``features_of`` that does.

Any other stage (filter, shuffle, batch, take, ...) drops the mark, and ``find``
says so once in the log: which mark, which stage, and what the run does instead.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from absl import logging

from trainer import internals

_SAID: set[tuple[str, str]] = set()  # (mark, stage) said once a process


def put(dataset: tf.data.Dataset, mark: str, value: Any) -> tf.data.Dataset:
    """``dataset``, marked with ``value``."""
    setattr(dataset, f"_trainer_{mark}", value)
    return dataset


def find(dataset: tf.data.Dataset, mark: str, through_maps: bool, dropped: str) -> Any:
    """The value of ``mark`` on ``dataset`` or, through stages that keep it, on what it reads.

    ``through_maps``: whether a map keeps the mark. ``dropped`` says what follows
    when a stage dropped it: logged once per mark and stage, and None is returned.
    """
    stage, dropped_by = dataset, None
    while stage is not None:
        value = getattr(stage, f"_trainer_{mark}", None)
        if value is not None:
            return value if dropped_by is None else _say(mark, dropped_by, dropped)
        kind = internals.dataset_stage(stage)
        if dropped_by is None and not (kind == "same" or (kind == "map" and through_maps)):
            dropped_by = type(stage).__name__
        read = internals.dataset_inputs(stage) if isinstance(stage, tf.data.Dataset) else []
        stage = read[0] if len(read) == 1 else None
    return None


def _say(mark: str, stage: str, dropped: str) -> None:
    if (mark, stage) not in _SAID:
        _SAID.add((mark, stage))
        logging.warning(
            "The input_fn's dataset was marked %s, but a %s stage after the mark drops it: %s",
            mark,
            stage.strip("_").removesuffix("Dataset"),
            dropped,
        )
