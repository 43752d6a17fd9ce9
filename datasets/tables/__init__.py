"""Tables read where they lie, by index: Parquet, ``save_to_disk`` folders, JSONL, CSV.

* ``input_fns``: for gin, ``tables.input_fn`` (a text classifier's documents),
  ``tables.documents_input_fn`` (a language model's), ``tables.images_input_fn``
  (encoded images) and the vocabulary sizes;
* ``source``: one source of theirs, its rows and what is learned from them;
* ``parquet``: Parquet files' rows, a row group decoded at a time;
* ``arrow``: the Arrow files of Hugging Face ``datasets``' ``save_to_disk``, memory-mapped;
* ``lines``: JSON lines and CSV files, each row by its byte offsets (indexed once);
* ``rows``: what all three are to the pipeline, a column's values at a batch of rows;
* ``columns``: the columns read, by name and kind, checked against each file's schema;
* ``files``: the files a source names (a file, a folder, a glob).

A gin file imports ``datasets.tables.input_fns`` (this package imports nothing, so that
``prepare`` reads tables through ``parquet`` and ``arrow`` alone).
"""
