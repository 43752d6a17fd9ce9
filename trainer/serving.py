"""What an export serves: examples as the data stores them, preprocessed as in training.

An input_fn declares how its examples are stored and the function that makes the
model's features of one of them, by marking its dataset with ``serves``::

    dataset = pipeline.build(source, mode, params, preprocess)
    stored = {"image": tf.TensorSpec([8, 8, 1], tf.uint8)}
    return trainer.serves(dataset, features_of, stored)

where ``preprocess`` calls ``features_of`` too: training and serving run one
function, so they cannot drift (the classic training/serving skew). The export then
has these signatures:

* ``serving_default``: the stored features (uint8 images as the records hold them),
  a batch of them; preprocessed by ``features_of`` inside the SavedModel;
* ``serving_examples``: serialized ``tf.train.Example`` strings, ``[batch]``, as in
  the project's TFRecord shards (with ``parse_examples`` declared);
* ``serving_features``: the features as the model sees them, for a client that
  preprocesses itself.

Text is stored as strings and tokenized inside (``datasets/text/``): its
``features_of`` takes a whole batch (``batched``), since a batch is padded to its
longest. An export whose preprocessing runs ops of a library TensorFlow loads on
import (tensorflow-text's WordPiece) names it (``imports``); ``trainer.load_export``
imports it before loading, or says in one line what to install.

An input_fn that declares nothing is exported with ``serving_default`` taking the
model's features, and the export says so in its log line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import tensorflow as tf

from trainer import dataset_marks


@dataclasses.dataclass(frozen=True)
class Serving:
    """How stored examples become the model's features; see ``serves``."""

    features_of: Callable[[dict], dict]
    stored: Mapping[str, tf.TensorSpec]
    parse_examples: Callable[[tf.Tensor], dict] | None = None
    batched: bool = False
    imports: tuple[str, ...] = ()

    def signature(self) -> dict[str, tf.TensorSpec]:
        """A batch of stored features, named by key."""
        return {
            name: tf.TensorSpec([None, *spec.shape], spec.dtype, name=name)
            for name, spec in self.stored.items()
        }

    def features(self, stored: dict) -> dict:
        """The model's features of a batch of stored ones (``features_of`` of each, or of all)."""
        if self.batched:
            return self.features_of(stored)
        return tf.vectorized_map(self.features_of, stored, fallback_to_while_loop=True)


def serves(
    dataset: tf.data.Dataset,
    features_of: Callable[[dict], dict],
    stored: Mapping[str, tf.TensorSpec],
    parse_examples: Callable[[tf.Tensor], dict] | None = None,
    batched: bool = False,
    imports: tuple[str, ...] = (),
) -> tf.data.Dataset:
    """Marks an input_fn's dataset with how its exported model takes examples.

    Args:
      dataset: what the input_fn returns; returned marked.
      features_of: one stored example's features (a dict of tensors) -> the model's
        features of it: the function the pipeline's own preprocessing calls.
      stored: one stored example's features, as ``{name: tf.TensorSpec}`` without
        the batch dimension (``None`` for a size that varies).
      parse_examples: serialized ``tf.train.Example`` strings ``[batch]`` -> a batch
        of stored features; gives the export a ``serving_examples`` signature.
      batched: ``features_of`` takes a batch of stored examples (a tokenizer, which
        pads the batch to its longest), not one.
      imports: modules whose ops ``features_of`` runs, to import before loading.
    """
    serving = Serving(features_of, dict(stored), parse_examples, batched, tuple(imports))
    return dataset_marks.put(dataset, "serving", serving)


def declared(dataset: tf.data.Dataset) -> Serving | None:
    """What ``serves`` marked ``dataset`` with (kept by prefetch, not by a map), or None."""
    return dataset_marks.find(
        dataset,
        "serving",
        through_maps=False,
        dropped="the export takes the model's features, not stored examples: mark the "
        "dataset the input_fn returns with trainer.serves, its features_of doing the map",
    )
