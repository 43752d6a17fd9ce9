"""Tables read where they lie, by index: Parquet, ``save_to_disk`` folders, JSONL, CSV.

* ``input_fns``: ``tables.input_fn`` (a text classifier's documents) and
  ``tables.vocab_size``, for gin;
* ``parquet``: Parquet files' rows, a row group decoded at a time;
* ``arrow``: the Arrow files of Hugging Face ``datasets``' ``save_to_disk``, memory-mapped;
* ``lines``: JSON lines and CSV files, each row by its byte offsets (indexed once);
* ``rows``: what all three are to the pipeline, a column's values at a batch of rows;
* ``columns``: the columns read, by name and kind, checked against each file's schema;
* ``files``: the files a source names (a file, a folder, a glob).

A gin file imports ``datasets.tables.input_fns`` (this package imports nothing, so that
``prepare`` reads tables through ``parquet`` and ``arrow`` alone).
"""
