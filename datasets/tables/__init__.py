"""Tables read where they lie, by index: Parquet files and ``save_to_disk`` folders.

* ``input_fns``: ``tables.input_fn`` (a text classifier's documents) and
  ``tables.vocab_size``, for gin;
* ``parquet``: Parquet files' rows, a row group decoded at a time;
* ``arrow``: the Arrow files of Hugging Face ``datasets``' ``save_to_disk``, memory-mapped;
* ``rows``: what both are to the pipeline, a column's values at a batch of rows;
* ``columns``: the columns read, by name and kind, checked against each file's schema;
* ``files``: the files a source names (a file, a folder, a glob).

A gin file imports ``datasets.tables.input_fns`` (this package imports nothing, so that
``prepare`` reads tables through ``parquet`` and ``arrow`` alone).
"""
