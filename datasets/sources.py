"""What a pipeline reads: sources of single examples, read by index where they allow.

* ``ArraySource``: examples in memory, a (nested) dict of arrays, or of
  ``tf.RaggedTensor`` for examples that vary in length (tokens: values and row splits);
* ``RandomAccess``: serialized records readable by index (TFRecord shards with their
  index, TFDS's ArrayRecord), and ``RecordExamples``, the examples parsed from them;
* ``in_memory``: a source as the pipeline will read it: in memory when it fits
  ``pipeline.memory_limit_mb``, else by index from its records, else (a ``tf.data``
  source too large or of varying shapes) the reason it must be read in sequence.

``datasets.pipeline`` turns them into an input_fn's batches; its users name these
classes as ``pipeline.ArraySource`` and so on.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import UserError, errors

Preprocess = Callable[[dict], tuple[dict, dict]]


class ArraySource:
    """Examples in memory: a (nested) dict of arrays sharing their first dimension.

    Examples that vary in length are a ``tf.RaggedTensor`` (its values and row splits,
    e.g. ``tf.ragged.constant(token_lists)``): read by index as the arrays are, and
    batched padded with zeros to the batch's longest.

    Args:
      arrays: e.g. ``{'image': uint8 [n, 32, 32, 3], 'label': int64 [n]}``, or
        ``{'tokens': tf.RaggedTensor [n, None], 'label': int64 [n]}``.
      name: names the source in messages.
    """

    windows = None  # the blocks of the records it was read from (``RecordExamples.windows``)

    def __init__(self, arrays: Mapping | tuple, name: str = "source"):
        self.name = name
        self.arrays = tf.nest.map_structure(_held, arrays)
        self._preprocessed: dict = {}
        leaves = tf.nest.flatten(self.arrays)
        sizes = {_rows(a) for a in leaves}
        if len(sizes) != 1 or None in sizes:
            shapes = tf.nest.map_structure(lambda a: list(a.shape), self.arrays)
            raise UserError(
                f"{name}: arrays must share their first (example) dimension, got {shapes}"
            )
        self.size = sizes.pop()
        self._tensors = None

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Memory the arrays take."""
        return sum(_nbytes(a) for a in tf.nest.flatten(self.arrays))

    def tensors(self):
        """The arrays as tensors, made once (a dataset captures them, never copies)."""
        if self._tensors is None:
            with tf.init_scope():  # eager even when first asked from inside a map function
                self._tensors = tf.nest.map_structure(_constant, self.arrays)
        return self._tensors

    @tf.autograph.experimental.do_not_convert  # plain TF ops: no AutoGraph pass
    def gather(self, rows: tf.Tensor):
        """The examples at ``rows`` (a scalar gives one example, a vector a batch)."""
        return tf.nest.map_structure(lambda t: tf.gather(t, rows), self.tensors())

    def preprocessed(self, preprocess: Preprocess, limit: float) -> ArraySource | None:
        """Every example through ``preprocess``, in memory; None if that exceeds ``limit``.

        ``preprocess`` is pure, so its results are kept (per function) and reused by
        every epoch and every later pipeline over this source.
        """
        key = _function_key(preprocess)
        if key not in self._preprocessed:
            if limit <= 0:
                return None
            self._preprocessed[key] = self._read_preprocessed(preprocess, limit)
        return self._preprocessed[key]

    def _read_preprocessed(self, preprocess: Preprocess, limit: float) -> ArraySource | None:
        """Every example preprocessed, read into memory; None past ``limit`` or of strings.

        Examples that vary in length are read ragged, up to ``limit`` bytes.
        """
        one = tf.data.Dataset.from_tensor_slices(self.arrays).map(preprocess)
        specs = tf.nest.flatten(one.element_spec)
        if any(not isinstance(s, tf.TensorSpec) or s.dtype == tf.string for s in specs):
            return None
        size = _decoded_bytes(one)
        if size is not None and size > limit:
            return None
        arrays = _read_all(one, self.name, limit=limit)
        if arrays is None:
            return None
        held = ArraySource(arrays, f"{self.name}, preprocessed")
        logging.info(
            "Holding %s preprocessed in memory (%d examples, %.1f MB)",
            self.name,
            len(self),
            held.nbytes / 2**20,
        )
        return held

    @staticmethod
    def concat(sources: Sequence[ArraySource]) -> ArraySource:
        """The sources laid end to end, as one."""
        if len(sources) == 1:
            return sources[0]
        arrays = tf.nest.map_structure(_concatenated, *[s.arrays for s in sources])
        return ArraySource(arrays, "+".join(s.name for s in sources))


class RandomAccess:
    """Serialized records readable by index: ``tfrecord.RecordSource``, TFDS's ArrayRecord.

    A subclass gives ``__len__`` and ``_read``; ``read`` runs it inside the graph.
    """

    def __len__(self) -> int:
        raise NotImplementedError

    def _read(self, rows: np.ndarray) -> tuple[np.ndarray, str]:
        """The records at ``rows`` (bytes objects), and "" or what is corrupt, where."""
        raise NotImplementedError

    @tf.autograph.experimental.do_not_convert
    def read(self, rows: tf.Tensor) -> tf.Tensor:
        """The serialized records at ``rows`` (a vector); corrupt data fails in one line."""
        records, problem = tf.numpy_function(
            self._read, [rows], (tf.string, tf.string), stateful=False
        )
        check = tf.debugging.Assert(tf.equal(problem, ""), ["input data is corrupt", problem])
        with tf.control_dependencies([check]):
            records = tf.identity(records)
        records.set_shape(rows.shape)
        return records


class RecordExamples:
    """Examples parsed one by one from records read by index: data larger than memory.

    ``build`` holds them in memory when they fit ``pipeline.memory_limit_mb``, like a
    ``tf.data`` source; otherwise training reads a batch of records per read, by
    index, and parses each in parallel.

    Args:
      records: the serialized examples, a ``RandomAccess``; or a table's rows
        (``datasets.tables.rows.Rows``), each record then a dict of its columns.
      parse: one record (a scalar string tensor, or a dict) to one example (a dict of
        tensors).
      name: names the source in messages.
      lengths: each parsed example's length, by row, when its examples vary in
        length and their lengths were kept when they were written (``prepare --text``
        keeps them): what ``lengths.group_batches`` sorts by and packing lays rows
        out by, without reading the records.
      whole: a batch of records (as ``records.read`` gives them) to its examples,
        parsed and preprocessed in one call: what training reads, faster than one
        by one (a text column tokenized at once); None: one by one.
    """

    def __init__(
        self,
        records: RandomAccess,
        parse: Callable[[tf.Tensor], dict],
        name: str,
        lengths: np.ndarray | None = None,
        whole: Callable[[tf.Tensor], tuple[dict, dict]] | None = None,
    ):
        self.records, self.parse, self.name, self.lengths = records, parse, name, lengths
        self.whole = whole

    def __len__(self) -> int:
        return len(self.records)

    @property
    def nbytes(self) -> int | None:
        """Bytes the records take, when their source knows (decided before reading)."""
        return getattr(self.records, "nbytes", None)

    @property
    def windows(self):
        """The blocks its records are decoded in (``order.Windows``), if any: Parquet's."""
        return getattr(self.records, "windows", None)  # a user's records may not say

    @staticmethod
    def joinable(parts: Sequence[RecordExamples]) -> bool:
        """Whether ``parts`` make their examples alike, from records that can join."""
        first = parts[0]
        alike = all(p.parse is first.parse and p.whole is first.whole for p in parts)
        kinds = {type(p.records) for p in parts}
        return alike and all(callable(getattr(kind, "joined", None)) for kind in kinds)

    @staticmethod
    def joined(parts: Sequence[RecordExamples], name: str) -> RecordExamples:
        """The records of ``parts`` laid end to end, as one source's.

        Row ``r`` of part ``i`` is row ``r + len(parts[0]) + ... + len(parts[i - 1])``
        of the whole.
        """
        first = parts[0]
        kept = [p.lengths for p in parts]
        lengths = None if any(k is None for k in kept) else np.concatenate(kept)
        records = type(first.records).joined([p.records for p in parts])
        return RecordExamples(records, first.parse, name, lengths, first.whole)

    def examples(self, rows: tf.data.Dataset) -> tf.data.Dataset:
        """The examples at ``rows`` (a dataset of row numbers), in their order."""
        records = rows.batch(256).map(self.records.read, num_parallel_calls=tf.data.AUTOTUNE)
        return records.unbatch().map(self.parse, num_parallel_calls=tf.data.AUTOTUNE)

    def dataset(self) -> tf.data.Dataset:
        """Every example, in order, of known length."""
        examples = self.examples(tf.data.Dataset.range(len(self)))
        return examples.apply(tf.data.experimental.assert_cardinality(len(self)))


class Reader:
    """A source as the training stream reads it by index: a batch of rows at a time.

    ``items(rows)``: what a batch's rows read at once (records on disk: their bytes, in
    one read; in memory: the rows themselves). ``example(item)``: one example,
    ``(features, labels)``. ``whole(items)``: the whole batch in one call, or None
    when its examples are made one by one.
    """

    def __init__(
        self,
        items: Callable[[tf.Tensor], tf.Tensor],
        example: Callable[[tf.Tensor], tuple[dict, dict]],
        whole: Callable[[tf.Tensor], tuple[dict, dict]] | None = None,
    ):
        self.items, self.example, self.whole = items, example, whole


def reader_of(data, examples: ArraySource | None, preprocess: Callable) -> Reader:
    """How ``data`` (an ``ArraySource`` or ``RecordExamples``) is read by index.

    ``examples``: its examples preprocessed and held in memory, or None: a batch is
    then one gather; else each example is preprocessed as it is read.
    """
    if examples is not None:
        return Reader(lambda rows: rows, examples.gather, examples.gather)
    if isinstance(data, RecordExamples):
        example = lambda record: preprocess(data.parse(record))  # noqa: E731
        return Reader(data.records.read, example, data.whole)
    return Reader(lambda rows: rows, lambda row: preprocess(data.gather(row)))


def in_memory(source, name: str, knobs: dict) -> ArraySource | RecordExamples | str:
    """The source in memory, or records read by index, or why it is read in sequence."""
    if isinstance(source, ArraySource):
        return source
    if isinstance(source, RecordExamples):  # in memory if it fits, else read by index
        size, limit = source.nbytes, memory_limit(knobs)
        if size is not None and size > limit and knobs["cache"] is not True:
            held = f"its records exceed pipeline.memory_limit_mb {limit / 2**20:.4g}"
        else:
            held = in_memory(source.dataset(), name, knobs)
        if not isinstance(held, str):
            held.windows = source.windows  # the same order in memory as on disk
            return held
        logging.info(
            "Reading %s by index from its records (%d examples; not in memory: %s)",
            name,
            len(source),
            held,
        )
        return source
    if not isinstance(source, tf.data.Dataset):
        raise UserError(
            f"{name}: a source must be a datasets.pipeline.ArraySource, RecordExamples "
            f"or a tf.data.Dataset, got {type(source).__name__}"
        )
    cache = knobs["cache"]
    if cache is False or (isinstance(cache, str) and cache != "auto"):
        return f"pipeline.cache is {cache!r}"
    if not fixed_shapes(source.element_spec) and not sequences(source.element_spec):
        if cache is True:
            raise UserError(
                f"{name}: pipeline.cache = True holds examples in memory as arrays, but its "
                "examples vary in shape: give them one shape in the source (resize or pad), "
                "or set pipeline.cache = 'auto' to read it in sequence"
            )
        return "its examples vary in shape"
    limit = memory_limit(knobs) if cache == "auto" else float("inf")
    over = f"its examples exceed pipeline.memory_limit_mb {limit / 2**20:.4g}"
    size = _decoded_bytes(source)  # None (length or string sizes unknown): read to see
    if size is not None and size > limit:
        return over
    arrays = _read_all(source, name, limit=limit)  # sequences held ragged, while they fit
    if arrays is None:
        return over
    held = ArraySource(arrays, name)
    logging.info(
        "Holding %s in memory (%d examples, %.1f MB); training reads it by index",
        name,
        len(held),
        held.nbytes / 2**20,
    )
    return held


def concat(held: list, name: str) -> ArraySource | RecordExamples:
    """Several sources as one: those in memory laid end to end, or records joined.

    Records join when each source's are made into examples alike (the same ``parse``
    and ``whole``) and their kind can join (a ``joined`` of their class: a table's rows).
    """
    if all(isinstance(h, ArraySource) for h in held):
        return ArraySource.concat(held)
    if len(held) == 1:
        return held[0]
    if all(isinstance(h, RecordExamples) for h in held) and RecordExamples.joinable(held):
        return RecordExamples.joined(held, name)
    raise UserError(
        f"{name}: several sources too large for memory cannot be mixed by index: give one "
        "source (e.g. one TFDS split 'train+validation'), or raise pipeline.memory_limit_mb"
    )


def fixed_shapes(element_spec) -> bool:
    """Whether every example has the same shapes (so examples stack into arrays)."""
    specs = tf.nest.flatten(element_spec)
    return all(isinstance(s, tf.TensorSpec) and s.shape.is_fully_defined() for s in specs)


def sequences(element_spec) -> bool:
    """Whether examples vary only in length: numbers, each part ``[length, fixed...]``.

    Such examples (token ids) are held in memory ragged; images of varying sizes are not.
    """
    specs = tf.nest.flatten(element_spec)
    return all(
        (isinstance(s, tf.TensorSpec) or getattr(s, "ragged_rank", None) == 0)  # one slice's
        and s.dtype != tf.string
        and (s.shape.is_fully_defined() or (s.shape.rank and s.shape[1:].is_fully_defined()))
        for s in specs
    )


def _decoded_bytes(dataset: tf.data.Dataset) -> int | None:
    """Bytes its examples take decoded; None when its length, shapes or strings vary."""
    specs = tf.nest.flatten(dataset.element_spec)
    count = int(dataset.cardinality())
    if count < 0 or not fixed_shapes(dataset.element_spec):
        return None
    if any(s.dtype == tf.string for s in specs):
        return None
    return count * sum(s.shape.num_elements() * s.dtype.size for s in specs)


def memory_limit(knobs: dict) -> float:
    """Bytes one source may take in memory: ``pipeline.memory_limit_mb``, or a quarter of RAM."""
    if knobs["memory_limit_mb"] is not None:
        return float(knobs["memory_limit_mb"]) * 2**20
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * 2**30
    return min(ram / 4, 16 * 2**30)


def _read_all(dataset: tf.data.Dataset, name: str, limit: float = float("inf")):
    """Every example of ``dataset`` as numpy arrays, read once in large batches.

    Examples that vary in length are read as ``tf.RaggedTensor`` parts. None if they
    take more than ``limit`` bytes (reading stops there).
    """
    if fixed_shapes(dataset.element_spec):
        batches = dataset.batch(4096, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    else:
        batches = dataset.ragged_batch(4096)
    parts, size = [], 0
    for batch in errors.guarded(batches.prefetch(2), f"reading {name}"):
        parts.append(tf.nest.map_structure(_held, batch))
        size += sum(_nbytes(a) for a in tf.nest.flatten(parts[-1]))
        if size > limit:
            return None
    if not parts:
        raise UserError(f"{name} is empty: it has no examples to read")
    return tf.nest.map_structure(_concatenated, *parts)


def _function_key(fn) -> tuple:
    """Identifies a function, seeing through ``functools.partial`` (made anew per call)."""
    if isinstance(fn, functools.partial):
        return (_function_key(fn.func), fn.args, tuple(sorted(fn.keywords.items())))
    return (fn,)


def _held(leaf) -> np.ndarray | tf.RaggedTensor:
    """A source's leaf as it is kept: an array, or a ragged tensor as it is."""
    return leaf if isinstance(leaf, tf.RaggedTensor) else np.asarray(leaf)


def _rows(leaf) -> int | None:
    """How many examples a leaf holds (None for a scalar)."""
    if isinstance(leaf, tf.RaggedTensor):
        return int(leaf.nrows())
    return leaf.shape[0] if leaf.ndim else None


def _constant(leaf) -> tf.Tensor | tf.RaggedTensor:
    return leaf if isinstance(leaf, tf.RaggedTensor) else tf.constant(leaf)


def _concatenated(*parts):
    if isinstance(parts[0], tf.RaggedTensor):
        return tf.concat(parts, axis=0)
    return np.concatenate(parts)


def _nbytes(array: np.ndarray | tf.RaggedTensor) -> int:
    """Memory an array takes, the bytes of its strings included."""
    if isinstance(array, tf.RaggedTensor):
        return sum(_nbytes(t.numpy()) for t in (array.flat_values, *array.nested_row_splits))
    if array.dtype == object:
        return array.nbytes + sum(len(x) for x in array.ravel())
    return array.nbytes
