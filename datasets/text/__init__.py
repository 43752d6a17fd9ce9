"""Text prepared once as token ids in TFRecord shards, then read by index.

    python3 -m datasets.prepare --text reviews.jsonl --out data/reviews
    python3 -m datasets.prepare --text corpus.txt --tokenizer words --vocab_size 8000
        --out data/corpus                                              (one line)

The file is JSON lines (``--text_field``, ``--label_field``), CSV with a header row
(the same fields), or plain text, one document per line. Labels, when the rows have
them, are class names (or numbers), made class ids in sorted order. Tokenizers:

* ``bytes``: each UTF-8 byte is a token, ids 1 to 256 (0 pads): no vocabulary to
  learn, nothing unknown, and a loss per token is a loss per byte;
* ``words``: a vocabulary learned from the file: its ``vocab_size - 3`` most frequent
  words (lower-cased runs of letters and digits, or single other characters), id 1
  for any other word, 0 for padding; saved as ``vocab.txt`` beside the shards;
* ``wordpiece``: a WordPiece vocabulary you give (``--vocab``, one token per line,
  ``[PAD]`` first and an ``[UNK]``, as BERT's), through tensorflow-text's
  ``BertTokenizer`` (lower-cased), which the ``text`` extra installs;
* ``sentencepiece``: a SentencePiece model you give (``--vocab spm.model``), through
  tensorflow-text's ``SentencepieceTokenizer``; ids are the model's plus one, so
  that 0 pads whatever the model's own padding is.

The vocabulary is kept beside the shards (``vocab.txt``, ``sentencepiece.model``):
an export tokenizes strings with it, in the same ops (``served``). One id more than
the tokenizer gives ends each document in the token stream (``end_of_document`` in
``dataset.json``: 257 for bytes, so ``vocab_size`` is 258): a language model's
windows see where one document ends and the next begins, and learn to end one.

A tenth of the documents (``--eval_fraction``, exactly, spread evenly: the 10th,
20th, ..., so the split is the same on every run) is held out as ``test``. Each
document is one record, its token ids a variable-length ``tokens`` feature (and
``label``), in uncompressed shards with their offsets indexed, each split's lengths
in tokens (``train-lengths.npy``, 4 bytes a document), and its documents end to end,
each followed by the end-of-document id (``train-tokens.bin``, 2 bytes a token, for a
language model's windows);
``dataset.json`` says how they were made. ``input_fn`` reads them: held in memory as
a ``tf.RaggedTensor`` when they fit (``pipeline.memory_limit_mb``), else by offset
from the files, and batched by length as ``datasets/lengths.py`` says (from the kept
lengths alone when they are on disk).

Nothing is written until the whole file has been read and checked: an empty
document, a row without the text field, or a label missing from some rows is one
line naming the file and row, and exit 2. Then it is read again and written a
thousand documents at a time (``datasets/text/writing.py``): memory does not grow
with the file (a file of 50 MB and one of 100 MB took 30 MB and 38 MB above the
imports; held whole, as before, 583 MB and 1,144 MB).
"""

from datasets.text import input_fns, windows  # noqa: F401 - registers text.input_fn and the rest in gin
