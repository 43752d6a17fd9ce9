"""Data prepared once as TFRecord shards, then read by index.

* ``tfrecord``: the ``input_fn`` of a prepared directory (``tfrecord.input_fn``,
  ``tfrecord.num_classes`` in gin), its parsing and augmentation;
* ``indexed``: a record fetched by its byte offset, with one ``pread``, and the
  checksummed index of offsets kept beside each shard;
* ``shards``: a prepared directory's names and ``dataset.json``, checked before the
  first step, and fixed-shape images written as shards;
* ``writing``: encoded images written as shards, streamed, on every core, resumable.

Text shards are written and read by ``datasets/text``, through ``shards`` and
``indexed``.
"""
