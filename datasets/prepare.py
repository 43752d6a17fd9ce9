"""Writes a dataset as sharded TFRecord files, or verifies a written directory.

    python3 -m datasets.prepare --images ~/photos --out data/photos
    python3 -m datasets.prepare --tfrecords '/imagenet/train-*' --split train
        --label_offset -1 --out data/imagenet                          (one line)
    python3 -m datasets.prepare --dataset digits --out data/digits --shards 4
    python3 -m datasets.prepare --dataset mnist --data_dir ~/tensorflow_datasets
        --out data/mnist --shards 16 --format raw --compression GZIP   (one line)
    python3 -m datasets.prepare --text reviews.jsonl --out data/reviews
    python3 -m datasets.prepare --chat chats.jsonl --out data/chats
    python3 -m datasets.prepare --verify data/digits

``--tfrecords`` indexes shards other tools wrote, where they lie
(``datasets/foreign.py``). ``--images`` is a folder of image files, one subfolder per class (see
``datasets/folders.py``); their encoded bytes are kept. ``--dataset`` is 'digits'
(built offline from scikit-learn) or any TFDS image dataset already present in
``--data_dir`` (nothing downloads here); one whose images vary in size (imagenet2012)
is written encoded, as image folders are. Train with
``tfrecord.input_fn.data_dir = 'data/digits'``. ``--text`` is a file of documents
(JSON lines, CSV, Parquet, a save_to_disk folder, or one per line), tokenized once
(``datasets/text/``); train with ``text.input_fn.data_dir = 'data/reviews'``.
``--chat`` is a file of chats (a ``messages`` column of ``{role, content}`` turns:
JSON lines, Parquet, a save_to_disk folder) rendered by ``--chat_template``
(``datasets/chat/``); train with ``chat.input_fn.data_dir = 'data/chats'``. Its
ids are bytes, or with ``--preset DIR`` the tokens of that keras-hub model's own
tokenizer (byte-pair or SentencePiece), for that model (a ``GPT2CausalLM``).
``--pairs`` is a file of preference pairs (``prompt``, ``chosen``, ``rejected``),
each answer rendered after its prompt by the same template.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # the command starts quietly, as python -m trainer does
    from trainer import console

    console.quiet_start(command_line=True)

import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
from absl import app, flags  # noqa: E402

from datasets.records import shards  # noqa: E402
from datasets.text import writing  # noqa: E402
from trainer import UserError, errors, logs, owned_dirs  # noqa: E402

flags.DEFINE_string("images", None, "A folder of images, one subfolder per class.")
flags.DEFINE_string("tfrecords", None, "A glob of TFRecord shards to index where they lie.")
flags.DEFINE_string("split", "train", "--tfrecords: the split the shards hold.")
flags.DEFINE_string("image_key", "image/encoded", "--tfrecords: the encoded image's feature.")
flags.DEFINE_string("label_key", "image/class/label", "--tfrecords: the class id's feature.")
flags.DEFINE_integer("label_offset", 0, "--tfrecords: added to each label (-1: from 1).")
flags.DEFINE_string("dataset", None, "'digits', or a TFDS image dataset present in --data_dir.")
flags.DEFINE_string(
    "text",
    None,
    "A file of documents: JSON lines, CSV, Parquet, a folder of datasets' save_to_disk, or "
    "plain text, one per line.",
)
flags.DEFINE_string(
    "chat",
    None,
    "A file of chats, a list of {role, content} turns a row: JSON lines, Parquet, or a folder "
    "of datasets' save_to_disk.",
)
flags.DEFINE_string(
    "pairs",
    None,
    "A file of preference pairs, a prompt, a chosen and a rejected answer a row (strings, or "
    "lists of {role, content} turns): JSON lines, Parquet, or a save_to_disk folder.",
)
flags.DEFINE_string(
    "chat_template",
    "chatml",
    "--chat, --pairs: 'chatml', a Hugging Face-layout model directory, or a Jinja file; it "
    "marks the assistant's part with {% generation %}.",
)
flags.DEFINE_string("messages_field", "messages", "--chat: the column holding each chat.")
flags.DEFINE_string(
    "preset",
    None,
    "--chat, --pairs: tokenize with this keras-hub model's own tokenizer (a directory written by "
    "save_to_preset, or in Hugging Face's layout), for that model; default: bytes.",
)
flags.DEFINE_string(
    "text_field", "text", "--text: the field of JSON lines or CSV holding the text."
)
flags.DEFINE_string("label_field", "label", "--text: the field holding a label, if rows have one.")
flags.DEFINE_enum(
    "tokenizer",
    "bytes",
    ["bytes", "words", "wordpiece", "sentencepiece"],
    "--text: bytes, words learned from the file, WordPiece or SentencePiece.",
)
flags.DEFINE_string(
    "vocab", None, "--tokenizer wordpiece: its vocabulary, [PAD] first; sentencepiece: its .model."
)
flags.DEFINE_integer("vocab_size", 8000, "--tokenizer words: the vocabulary's size.")
flags.DEFINE_string("out", None, "Directory to write the shards and dataset.json to.")
flags.DEFINE_integer("shards", None, "Shards per split (default 4; --images: 1 per 1,000 files).")
flags.DEFINE_float("eval_fraction", 0.1, "--images without train/: held out per class.")
flags.DEFINE_integer("max_side", None, "--images: resize larger images to this longer side.")
flags.DEFINE_enum("format", "png", ["png", "raw"], "How fixed-size images are stored.")
flags.DEFINE_enum("compression", "none", ["none", "GZIP"], "Record compression.")
flags.DEFINE_list("splits", ["train", "test"], "Splits of --dataset to write.")
flags.DEFINE_string("data_dir", None, "TFDS data_dir of the source dataset.")
flags.DEFINE_string("verify", None, "Instead of writing, read every record under this dir.")
FLAGS = flags.FLAGS


def examples(dataset: str, split: str, data_dir: str | None):
    """``(iterable of {'image', 'label'} numpy examples, their count, num_classes)``."""
    if dataset == "digits":
        from datasets import digits

        source, num_classes = digits.load(split, data_dir), digits.NUM_CLASSES
    else:
        from datasets import tfds_images

        source = tfds_images.load(dataset, split, data_dir, download=False)
        num_classes = tfds.builder(dataset, data_dir=data_dir).info.features["label"].num_classes
    if not isinstance(source, tf.data.Dataset):
        source = source.dataset()  # an ArrayRecord source, read in order
    return tfds.as_numpy(source), int(source.cardinality()), num_classes


def main(argv: list[str]) -> None:
    """Writes or verifies; one line and exit 2 on bad input."""
    del argv
    logs.use_console()  # its own lines, plainly; TFDS's INFO lines stay off
    try:
        if FLAGS.verify:
            sys.exit(verify(FLAGS.verify))
        given = (FLAGS.images, FLAGS.dataset, FLAGS.tfrecords, FLAGS.text, FLAGS.chat, FLAGS.pairs)
        if not FLAGS.out or len([f for f in given if f]) != 1:
            raise UserError(
                "give --out and one of --images, --dataset, --tfrecords, --text, --chat or "
                "--pairs (or --verify DIR)"
            )
        check_flags()
        owned_dirs.check(FLAGS.out, shards.OWNER)
        if FLAGS.pairs:
            from datasets.chat import pairs

            metadata = pairs.prepare(
                FLAGS.pairs,
                FLAGS.out,
                FLAGS.chat_template,
                FLAGS.eval_fraction,
                FLAGS.shards or 4,
                FLAGS.preset,
            )
        elif FLAGS.chat:
            from datasets.chat import preparation as chats

            metadata = chats.prepare(
                FLAGS.chat,
                FLAGS.out,
                FLAGS.chat_template,
                FLAGS.messages_field,
                FLAGS.eval_fraction,
                FLAGS.shards or 4,
                FLAGS.preset,
            )
        elif FLAGS.text:
            from datasets.text import preparation

            metadata = preparation.prepare(
                FLAGS.text,
                FLAGS.out,
                FLAGS.tokenizer,
                FLAGS.vocab_size,
                FLAGS.text_field,
                FLAGS.label_field if FLAGS["label_field"].present else None,
                FLAGS.eval_fraction,
                FLAGS.shards or 4,
                FLAGS.vocab,
            )
        elif FLAGS.tfrecords:
            from datasets import foreign

            metadata = foreign.index(
                FLAGS.tfrecords,
                FLAGS.split,
                FLAGS.out,
                FLAGS.image_key,
                FLAGS.label_key,
                FLAGS.label_offset,
            )
        elif FLAGS.images:
            from datasets import folders

            metadata = folders.prepare(
                FLAGS.images, FLAGS.out, FLAGS.shards, FLAGS.eval_fraction, FLAGS.max_side
            )
        else:
            metadata = write_dataset()
        for split, entry in metadata["splits"].items():
            skipped = f", {entry['skipped']} files skipped" if entry.get("skipped") else ""
            print(f"{split}: {entry['count']} examples in {len(entry['shards'])} shards{skipped}")
        print(f"wrote {FLAGS.out}")
    except UserError as error:
        print(f"error: {errors.first_line(error)}", file=sys.stderr)
        sys.exit(2)


def check_flags() -> None:
    """Refuses numbers out of range, and options that the chosen kind of data ignores."""
    for name in ("shards", "max_side"):
        if FLAGS[name].value is not None:
            errors.check_count(f"--{name}", FLAGS[name].value)
    writing.check_fraction(FLAGS.eval_fraction)
    text_only = ("tokenizer", "vocab", "vocab_size", "text_field", "label_field")
    given = [name for name in text_only if FLAGS[name].present]
    if given and not FLAGS.text:
        raise UserError(f"--{given[0]} applies to --text only: drop it")
    if FLAGS["messages_field"].present and not FLAGS.chat:
        raise UserError("--messages_field applies to --chat only: drop it")
    for name in ("chat_template", "preset"):
        if FLAGS[name].present and not (FLAGS.chat or FLAGS.pairs):
            raise UserError(f"--{name} applies to --chat and --pairs only: drop it")
    tokenizer = FLAGS.tokenizer
    if FLAGS.vocab and tokenizer not in ("wordpiece", "sentencepiece"):
        raise UserError(
            f"--vocab is read by --tokenizer wordpiece (a vocab.txt) or sentencepiece (a .model), "
            f"not {tokenizer}: add --tokenizer wordpiece or --tokenizer sentencepiece"
        )
    if FLAGS["vocab_size"].present and tokenizer != "words":
        raise UserError(
            f"--vocab_size applies to --tokenizer words (a vocabulary learned from the file); "
            f"{tokenizer}'s is fixed: drop it, or add --tokenizer words"
        )


def write_dataset() -> dict:
    """Writes ``--dataset``'s splits; returns the ``dataset.json`` written."""
    from datasets import tfds_images

    encoded = FLAGS.dataset != "digits" and tfds_images.varies_in_size(
        FLAGS.dataset, FLAGS.data_dir
    )
    if encoded:
        return tfds_images.prepare_encoded(
            FLAGS.dataset, FLAGS.data_dir, FLAGS.out, FLAGS.splits, FLAGS.shards or 4
        )
    compression = None if FLAGS.compression == "none" else FLAGS.compression
    for split in FLAGS.splits:
        rows, count, num_classes = examples(FLAGS.dataset, split, FLAGS.data_dir)
        shards.write(
            rows, FLAGS.out, split, FLAGS.shards or 4, FLAGS.format, compression, num_classes, count
        )
    return shards.read_metadata(FLAGS.out)


def verify(data_dir: str) -> int:
    """Reads every record; prints what is damaged; 1 if anything is, else 0."""
    metadata = shards.read_metadata(data_dir)
    problems = [p for split in metadata["splits"] for p in shards.verify(data_dir, split)]
    for problem in problems:
        print(problem)
    print(f"{data_dir}: {'damaged' if problems else 'all records readable'}")
    return 1 if problems else 0


if __name__ == "__main__":
    app.run(main)
