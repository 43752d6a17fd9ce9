"""``python -m datasets.prepare --text``: a file of documents as token ids in shards,
read back by index (``datasets/text/``). The documents are real text no one here
wrote: functions of the Python standard library's own sources, labelled by package."""

import json
import logging
import os
import re
import subprocess
import sys
import sysconfig
from collections import Counter

import gin
import numpy as np
import pytest
import tensorflow as tf

from datasets import lengths, pipeline
from datasets.text import input_fns, preparation, tokenizers, windows
from trainer import InputParams, Mode, UserError

PACKAGES = ("json", "email", "http", "unittest")


def functions(count_per_package: int = 12) -> list[dict]:
    """``{'text': a function's first 300 characters, 'label': its package}`` rows."""
    stdlib = sysconfig.get_paths()["stdlib"]
    rows = []
    for package in PACKAGES:
        folder = os.path.join(stdlib, package)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py") and len(rows) < count_per_package * (
                1 + PACKAGES.index(package)
            ):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    for block in f.read().split("\ndef ")[1:3]:
                        rows.append({"text": "def " + block[:300], "label": package})
    return rows


def stream_of(texts: list[str]) -> list[int]:
    """Byte ids of the documents end to end, each followed by the end of a document."""
    return [i for t in texts for i in [*(b + 1 for b in t.encode()), 257]]


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.mark.slow
def test_prepare_text_as_a_user_types_it_then_read_by_index(tmp_path):
    rows = functions()
    write_jsonl(tmp_path / "functions.jsonl", rows)
    command = [sys.executable, "-m", "datasets.prepare", "--text", "functions.jsonl"]
    proc = subprocess.run(
        [*command, "--out", "data/functions"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    held_out = len(rows) // 10
    assert f"test: {held_out} examples in 4 shards" in proc.stdout
    data_dir = str(tmp_path / "data" / "functions")
    metadata = json.loads(open(os.path.join(data_dir, "dataset.json")).read())
    assert metadata["classes"] == sorted(PACKAGES) and metadata["vocab_size"] == 258
    # Evaluation reads the held-out tenth once, in order: bytes + 1, padded with 0.
    params = InputParams(4, 4, seed=0)
    evaluated = list(input_fns.input_fn(Mode.EVAL, params, data_dir=data_dir).as_numpy_iterator())
    read = [row for features, _ in evaluated for row in features["tokens"]]
    expected = [row for i, row in enumerate(rows) if i % 10 == 9]
    assert len(read) == len(expected) == held_out
    for ids, row in zip(read, expected, strict=True):
        assert bytes(int(i) - 1 for i in ids if i).decode() == row["text"]
    labels = np.concatenate([labels["label"] for _, labels in evaluated])
    assert labels.tolist() == [sorted(PACKAGES).index(row["label"]) for row in expected]
    # Training: each training document once an epoch, by index, and a resume is exact.
    trained = input_fns.input_fn(Mode.TRAIN, params, data_dir=data_dir)
    epoch = [f["tokens"] for f, _ in trained.take((len(rows) - held_out) // 4).as_numpy_iterator()]
    firsts = {tuple(row[:40]) for batch in epoch for row in batch}
    assert len(firsts) >= (len(rows) - held_out) - 4  # a few functions may begin alike
    resumed = input_fns.input_fn(
        Mode.TRAIN, InputParams(4, 4, seed=0, start_example=8), data_dir=data_dir
    )
    np.testing.assert_array_equal(next(resumed.as_numpy_iterator())[0]["tokens"], epoch[2])
    proc = subprocess.run(
        [*command, "--out", "data/bad", "--text_field", "body"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr == (
        "error: functions.jsonl:1: no text field 'body' (a string): name it with --text_field\n"
    )
    assert not os.path.exists(tmp_path / "data" / "bad")


def test_a_vocabulary_of_words_is_learned_from_the_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat\nthe dog sat on the mat\nthe cat ran\n")
    metadata = preparation.prepare(str(path), str(tmp_path / "out"), "words", vocab_size=7)
    vocabulary = (tmp_path / "out" / "vocab.txt").read_text().split()
    assert vocabulary == ["[PAD]", "[UNK]", "the", "cat", "sat", "dog"]
    assert metadata["vocab_size"] == 7 and metadata["end_of_document"] == 6  # every id
    assert metadata["num_classes"] == 0
    tokenizer = tokenizers.Tokenizer("words", vocabulary)
    assert tokenizer.ids("The cat ran!") == [2, 3, 1, 1]
    with pytest.raises(
        UserError,
        match=r"--tokenizer must be one of bytes, words, wordpiece, sentencepiece, got 'bpe'",
    ):
        tokenizers.Tokenizer("bpe")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("a.jsonl", '{"text": "one"}\n{"text": " "}\n', "{path}:2: the document is empty"),
        (
            "b.jsonl",
            '{"text": "one", "label": "x"}\n{"text": "two"}\n',
            "{path}:2: no 'label' where other rows have one: give every row a label, or none",
        ),
        ("c.jsonl", '{"text": "one"}\nnot json\n', "{path}:2: not a JSON object"),
        ("d.csv", "text,label\none,x\n,y\n", "{path}:3: the document is empty"),
        ("e.txt", "", "--text {path}: the file holds no documents"),
        (
            "f.txt",
            b"one\n" * 3000 + b"caf\xe9\n",
            "--text {path}:3001: not UTF-8 text (invalid continuation byte at byte 12,003 of "
            "the file)",
        ),
    ],
    ids=[
        "empty_document",
        "label_missing",
        "not_json",
        "empty_csv_cell",
        "empty_file",
        "latin1_past_the_first_read",
    ],
)
def test_a_bad_file_is_one_line_naming_the_row_and_nothing_is_written(
    tmp_path, name, content, message
):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "out"
    with pytest.raises(UserError) as raised:
        preparation.prepare(str(path), str(out))
    assert str(raised.value).startswith(message.format(path=path))
    assert "\n" not in str(raised.value) and not out.exists()
    assert os.listdir(tmp_path) == [name]  # no staging directory left either


def test_a_language_models_windows_cut_the_documents_end_to_end(tmp_path):
    """Windows of 16 bytes over the training documents, each ended by its own id (257),
    each target its input's next byte; every window once an epoch, read by index,
    resumed exactly."""
    rows = functions(3)
    preparation.prepare(write_jsonl(tmp_path / "f.jsonl", rows), str(tmp_path / "data"))
    training = stream_of([row["text"] for i, row in enumerate(rows) if i % 10 != 9])
    data_dir, params = str(tmp_path / "data"), InputParams(4, 4, seed=1)
    dataset = windows.windows_input_fn(Mode.TRAIN, params, data_dir=data_dir, length=16)
    count = (len(training) - 1) // 16
    batches = list(dataset.take(count // 4).as_numpy_iterator())
    expected = [tuple(training[k * 16 : k * 16 + 17]) for k in range(count)]  # inputs + next
    seen = []
    for features, labels in batches:
        for tokens, targets in zip(features["tokens"], labels["targets"], strict=True):
            np.testing.assert_array_equal(targets[:-1], tokens[1:])
            seen.append(tuple(tokens.tolist()) + (int(targets[-1]),))
    assert len(seen) == count // 4 * 4 and not Counter(seen) - Counter(expected)  # each once
    resumed = windows.windows_input_fn(
        Mode.TRAIN, InputParams(4, 4, seed=1, start_example=12), data_dir=data_dir, length=16
    )
    np.testing.assert_array_equal(
        next(resumed.as_numpy_iterator())[0]["tokens"], batches[3][0]["tokens"]
    )
    with pytest.raises(UserError, match=r"tokens make no window of 100000 \(and its next token\)"):
        windows.windows(input_fns.documents(data_dir, "test"), 100_000)


def test_windows_of_text_too_large_for_memory_are_read_from_its_token_stream_by_offset(
    tmp_path, caplog
):
    """Past pipeline.memory_limit_mb, each window is one read of the split's token
    stream on disk (2 bytes a token): the same batches as held in memory, in training
    from step 0 and from a resume, and in evaluation; a stream cut short is one line."""
    rows = functions(3)
    data_dir = str(tmp_path / "data")
    metadata = preparation.prepare(write_jsonl(tmp_path / "f.jsonl", rows), data_dir)
    training = stream_of([row["text"] for i, row in enumerate(rows) if i % 10 != 9])
    stream = np.fromfile(os.path.join(data_dir, "train-tokens.bin"), np.uint16)
    assert metadata["splits"]["train"]["stream"] == {
        "file": "train-tokens.bin",
        "dtype": "uint16",
        "tokens": len(training),
        "end": 257,
    }
    np.testing.assert_array_equal(stream, training)

    def batches(mode, memory_limit_mb=None, start=0, count=9):
        gin.bind_parameter("pipeline.memory_limit_mb", memory_limit_mb)
        params = InputParams(4, 4, seed=2, start_example=start)
        dataset = windows.windows_input_fn(mode, params, data_dir=data_dir, length=16)
        return [np.stack([f["tokens"], y["targets"]]) for f, y in dataset.take(count)]

    caplog.set_level(logging.INFO)
    read = {}
    for mode in (Mode.TRAIN, Mode.EVAL):
        read[mode] = batches(mode, memory_limit_mb=0)
        held = batches(mode)
        assert len(read[mode]) == len(held) and all(
            (a == b).all() for a, b in zip(read[mode], held, strict=True)
        ), mode
    said = [r.getMessage() for r in caplog.records]
    assert any(s.startswith("Reading windows-train-0 by index from its records") for s in said)
    resumed = batches(Mode.TRAIN, memory_limit_mb=0, start=4 * 5, count=3)
    assert all((a == b).all() for a, b in zip(resumed, read[Mode.TRAIN][5:8], strict=True))
    with open(os.path.join(data_dir, "train-tokens.bin"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError) as raised:
        windows.windows_input_fn(Mode.TRAIN, InputParams(4, 4, seed=2), data_dir=data_dir, length=8)
    assert str(raised.value).splitlines()[0] == (
        f"{data_dir}/train-tokens.bin should hold the {len(training):,} tokens dataset.json "
        "lists, as uint16; it is 100 bytes: re-copy it with the shards, or prepare the data again"
    )


def test_a_wordpiece_vocabulary_given_tokenizes_through_tensorflow_text(tmp_path):
    pytest.importorskip("tensorflow_text")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\ncat\n##s\nsat\n")
    path = tmp_path / "corpus.txt"
    path.write_text("The cats sat\nthe dog\n")
    metadata = preparation.prepare(str(path), str(tmp_path / "out"), "wordpiece", vocab=str(vocab))
    assert metadata["tokenizer"] == "wordpiece" and metadata["vocab_size"] == 8 + 1  # + end
    tokenizer = tokenizers.Tokenizer("wordpiece", tokenizers.read_vocabulary(str(vocab)))
    assert [ids.tolist() for ids in tokenizer.all_ids(["The cats sat", "the dog"])] == [
        [4, 5, 6, 7],
        [4, 1],
    ]
    for content, message in [
        ("the\n[PAD]\n[UNK]\n", "a WordPiece vocabulary has [PAD] on its first line"),
        ("[PAD]\n[UNK]\nthe\nthe\n", ":4: 'the' again (line 3)"),
        ("[PAD]\n\n[UNK]\n", ":2: an empty or spaced token; one per line"),
    ]:
        vocab.write_text(content)
        with pytest.raises(UserError) as raised:
            preparation.prepare(str(path), str(tmp_path / "bad"), "wordpiece", vocab=str(vocab))
        assert message in str(raised.value) and not (tmp_path / "bad").exists()
    vocab.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match=r"not UTF-8 text, so not a vocabulary"):
        tokenizers.read_vocabulary(str(vocab))


def test_a_token_id_past_the_vocabulary_is_one_line_and_nothing_is_written(tmp_path):
    """Ids up to 299 for an Embedding of 257 rows (the bytes tokenizer's): on a CPU
    TensorFlow fails the lookup deep in the step; the run says which id, which layer, and
    the fix, in one line, and leaves no model_dir behind."""
    import keras
    import tensorflow as tf

    import trainer

    x = np.random.default_rng(0).integers(1, 300, (64, 10))
    model = keras.Sequential(
        [keras.Input((10,), dtype="int64"), keras.layers.Embedding(257, 8), keras.layers.Dense(5)]
    )
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def input_fn(mode, params):
        return tf.data.Dataset.from_tensor_slices((x, x % 5)).repeat().batch(params.batch_size)

    model_dir = tmp_path / "run"
    estimator = trainer.Estimator(model, str(model_dir), global_batch_size=16, progress=False)
    with pytest.raises(UserError) as refused:
        estimator.train(input_fn, 3)
    assert re.fullmatch(
        r"training step 1 failed: id (2[5-9]\d) \(at \[\d+,\d+\] of the batch\) is not one of "
        r"the 257 rows \(0 to 256\) that layer embedding\w* looks up: size it to the data "
        r"\(an Embedding's input_dim to the tokenizer's vocab_size: @text.vocab_size\(\) in "
        r"gin\), or fix the ids",
        str(refused.value),
    )
    assert not model_dir.exists() or not any(model_dir.glob("ckpt-*"))


LOAD_WITHOUT_AND_WITH = """
import sys
import numpy as np
import tensorflow as tf
import trainer

sys.modules["tensorflow_text"] = None  # as where it is not installed
try:
    trainer.load_export(sys.argv[1])
except trainer.UserError as error:
    print("refused:", error)
del sys.modules["tensorflow_text"]
assert "tensorflow_text" not in sys.modules
loaded = trainer.load_export(sys.argv[1])  # imports it first
texts = tf.constant(["The cats sat", "the dog sat on the cat"])
(served,) = loaded.signatures["serving_default"](text=texts).values()
# As prepare does, each cut to the 4 tokens of the longest document prepared.
tokens = tf.constant([[4, 5, 6, 7], [4, 1, 7, 1]], tf.int64)
(features,) = loaded.signatures["serving_features"](tokens=tokens).values()
print("same:", np.abs(served.numpy() - features.numpy()).max())
"""


@pytest.mark.slow
def test_an_export_of_prepared_text_takes_strings_and_tokenizes_them_inside(tmp_path):
    """A compiled Keras classifier over WordPiece-prepared text, exported: serving_default
    takes strings, tokenized inside as prepare did; loading it where tensorflow_text
    cannot be imported is one line naming it, and trainer.load_export imports it."""
    pytest.importorskip("tensorflow_text")
    import keras

    import trainer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\ncat\n##s\nsat\n")
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(
        corpus, [{"text": t, "label": t.count("cat")} for t in ("The cats sat", "a cat")] * 8
    )
    data_dir = str(tmp_path / "data")
    preparation.prepare(str(corpus), data_dir, "wordpiece", vocab=str(vocab))
    tokens = keras.Input((None,), dtype="int64", name="tokens")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(8, 4)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(2)(pooled))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def input_fn(mode, params):
        return input_fns.input_fn(mode, params, data_dir=data_dir)

    estimator = trainer.Estimator(model, str(tmp_path / "run"), global_batch_size=4, progress=False)
    estimator.train(input_fn, 2)
    export = estimator.export(input_fn)
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_AND_WITH, export], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused, same = proc.stdout.splitlines()
    assert refused == (
        f"refused: {export} runs ops of tensorflow_text (its preprocessing: a tokenizer) and "
        "tensorflow_text cannot be imported here: install it (pip install tensorflow-text), "
        "then load it again"
    )
    assert float(same.split()[-1]) < 1e-6


def test_a_sentencepiece_model_given_tokenizes_through_tensorflow_text(tmp_path):
    """A SentencePiece model trained here on the standard library's json package: the
    prepared ids are the model's own plus one (0 pads), and kept beside the shards; a
    file that is not a model is one line."""
    pytest.importorskip("tensorflow_text")
    spm = pytest.importorskip("sentencepiece")
    rows = functions(4)
    model = tmp_path / "spm.model"
    with open(model, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(line for r in rows for line in r["text"].splitlines()),
            model_writer=f, vocab_size=120, minloglevel=2,
        )  # fmt: skip
    corpus = write_jsonl(tmp_path / "functions.jsonl", rows)
    out = tmp_path / "out"
    metadata = preparation.prepare(corpus, str(out), "sentencepiece", vocab=str(model))
    own = spm.SentencePieceProcessor(model_file=str(model))
    assert metadata["vocab_size"] == 122 and (out / "sentencepiece.model").exists()  # + end
    params = InputParams(4, 4, seed=0)
    read = input_fns.input_fn(Mode.EVAL, params, data_dir=str(out)).as_numpy_iterator()
    documents = [row[row > 0].tolist() for features, _ in read for row in features["tokens"]]
    expected = [r["text"] for i, r in enumerate(rows) if i % 10 == 9]
    assert documents == [[i + 1 for i in own.encode(t)] for t in expected]
    (tmp_path / "not.model").write_text("[PAD]\n[UNK]\n")
    with pytest.raises(UserError, match=r"not\.model: not a SentencePiece model \(the \.model"):
        preparation.prepare(
            corpus, str(tmp_path / "bad"), "sentencepiece", vocab=str(tmp_path / "not.model")
        )
    assert not (tmp_path / "bad").exists()


def test_prepared_text_too_large_for_memory_is_grouped_by_the_lengths_kept_beside_it(
    tmp_path, caplog
):
    """Read from disk, grouped and bucketed by the lengths prepare kept: the very batches
    the same text held in memory gives, from step 0 and from a resume; without kept
    lengths, grouping is refused in one line and buckets still pad."""
    rows = functions(8)
    data_dir = str(tmp_path / "functions")
    metadata = preparation.prepare(
        write_jsonl(tmp_path / "f.jsonl", rows), data_dir, eval_fraction=0
    )
    kept = np.load(os.path.join(data_dir, "train-lengths.npy"))
    assert kept.tolist() == [len(row["text"].encode()) for row in rows]  # bytes: one each
    gin.bind_parameter("lengths.group_batches", 3)
    gin.bind_parameter("lengths.buckets", [64, 128, 320])

    def batches(start=0, count=12, memory_limit_mb=None):
        gin.bind_parameter("pipeline.memory_limit_mb", memory_limit_mb)
        params = InputParams(4, 4, seed=3, start_example=start)
        dataset = input_fns.input_fn(Mode.TRAIN, params, data_dir=data_dir)
        return [f["tokens"] for f, _ in dataset.take(count).as_numpy_iterator()]

    caplog.set_level(logging.INFO)
    from_disk = batches(memory_limit_mb=0)
    said = [r.getMessage() for r in caplog.records]
    assert any(s.startswith("Reading text-train-0 by index from its records") for s in said)
    assert any(s.startswith("Grouping text-train by length") for s in said)
    in_memory = batches()
    assert [b.shape for b in from_disk] == [b.shape for b in in_memory]
    assert all((a == b).all() for a, b in zip(from_disk, in_memory, strict=True))
    assert {b.shape[1] for b in from_disk} <= {64, 128, 320}
    window = np.concatenate([(b > 0).sum(axis=1) for b in from_disk[:3]])
    assert window.tolist() == sorted(window, reverse=True)  # a window: longest first
    resumed = batches(start=4 * 5, count=7, memory_limit_mb=0)
    assert all((a == b).all() for a, b in zip(resumed, from_disk[5:], strict=True))

    entry = metadata["splits"]["train"]
    np.save(os.path.join(data_dir, "train-lengths.npy"), kept[:-1])
    with pytest.raises(UserError) as raised:
        batches(memory_limit_mb=0)
    assert str(raised.value).splitlines()[0] == (  # the line the command line prints
        f"{data_dir}/train-lengths.npy does not hold the lengths of the {entry['count']} "
        "documents dataset.json lists: re-copy it with the shards, or prepare the data again"
    )
    del metadata["splits"]["train"]["lengths"]  # as prepared before lengths were kept
    with open(os.path.join(data_dir, "dataset.json"), "w") as f:
        json.dump(metadata, f)
    with pytest.raises(UserError, match=r"^lengths.group_batches sorts text-train's exam"):
        batches(memory_limit_mb=0)
    gin.bind_parameter("lengths.group_batches", 0)
    assert {b.shape[1] for b in batches(memory_limit_mb=0)} <= {64, 128, 320}


def test_a_file_longer_than_a_chunk_is_written_as_it_is_read(tmp_path):
    """2,345 documents, read and written a thousand at a time: each split's shards,
    lengths and token stream hold its documents in the file's order, dealt to the
    shards as np.array_split deals them."""
    rng = np.random.default_rng(4)
    lines = ["".join(rng.choice(list("abc de"), rng.integers(1, 30))) + "x" for _ in range(2345)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    data_dir = str(tmp_path / "data")
    metadata = preparation.prepare(str(tmp_path / "lines.txt"), data_dir, num_shards=3)
    for split, chosen in (("train", False), ("test", True)):
        expected = [line for i, line in enumerate(lines) if (i % 10 == 9) == chosen]
        entry = metadata["splits"][split]
        sizes = [len(b) for b in np.array_split(np.arange(len(expected)), 3)]
        assert [shard["count"] for shard in entry["shards"]] == sizes
        read = [bytes((ids - 1).tolist()).decode() for ids in input_fns.documents(data_dir, split)]
        assert read == expected, split
        lengths = np.load(os.path.join(data_dir, entry["lengths"]))
        assert lengths.tolist() == [len(line) for line in expected]
        stream = np.fromfile(os.path.join(data_dir, entry["stream"]["file"]), np.uint16)
        assert stream.tolist() == stream_of(expected)


def test_documents_too_large_for_memory_are_packed_from_the_lengths_kept(tmp_path):
    """A language model of whole documents, packed in rows of 640 from disk: the rows
    (tokens, targets, segments, positions) equal those of the same documents held in
    memory, in training from step 0 and from a resume, and in evaluation; a row too
    short for the longest is refused, counted, before anything is read."""
    rows = functions(6)
    data_dir = str(tmp_path / "data")
    preparation.prepare(write_jsonl(tmp_path / "f.jsonl", rows), data_dir)
    gin.bind_parameter("packing.length", 640)

    def batches(mode, memory_limit_mb=None, start=0, count=6):
        gin.bind_parameter("pipeline.memory_limit_mb", memory_limit_mb)
        params = InputParams(8, 8, seed=2, start_example=start)
        dataset = input_fns.documents_input_fn(mode, params, data_dir=data_dir)
        return [
            [f["tokens"], y["targets"], f["segment_ids"], f["positions"]]
            for f, y in dataset.take(count).as_numpy_iterator()
        ]

    def same(found, expected):
        return len(found) == len(expected) and all(
            all((a == b).all() for a, b in zip(x, y, strict=True))
            for x, y in zip(found, expected, strict=True)
        )

    packed = batches(Mode.TRAIN, memory_limit_mb=0)
    assert same(packed, batches(Mode.TRAIN))
    tokens, targets, segments, positions = packed[0]
    assert tokens.shape[1] == 640 and segments.max() > 1  # several documents a row
    within = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    np.testing.assert_array_equal(targets[:, :-1][within], tokens[:, 1:][within])
    assert (positions[:, 1:][within] == positions[:, :-1][within] + 1).all()
    assert same(batches(Mode.TRAIN, memory_limit_mb=0, start=8 * 2, count=2), packed[2:4])
    assert same(batches(Mode.EVAL, memory_limit_mb=0), batches(Mode.EVAL))
    gin.bind_parameter("packing.length", 100)
    kept = np.load(os.path.join(data_dir, "train-lengths.npy")) - 1  # the shift
    with pytest.raises(UserError) as raised:
        batches(Mode.TRAIN, memory_limit_mb=0)
    assert str(raised.value).splitlines()[0] == (
        f"{(kept > 100).sum()} examples of documents-train are longer than a row of "
        f"packing.length = 100 (the longest has {kept.max()}): raise it, or cut them in "
        "preprocess"
    )
    # A preprocess that changes lengths cannot be packed from lengths kept: said, not cut.
    gin.bind_parameter("packing.length", 640)
    source, _ = input_fns._documents_of(data_dir, "train", input_fns.next_of_document, shift=1)

    def cropped(example):
        return {"tokens": example["tokens"][1:]}, {"targets": example["targets"][1:]}

    dataset = pipeline.build(source, Mode.TRAIN, InputParams(8, 8, seed=2), cropped)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not the one kept beside its rec"):
        next(iter(dataset))


def test_records_on_disk_too_long_for_every_bucket_are_refused_before_training(
    tmp_path, monkeypatch, caplog
):
    """Only the records whose kept length passes the last bucket are read, through
    preprocess: still too long, they are counted in one line before any batch; cut by
    preprocess, they train. Past ``PROBED``, the count says "at least"."""
    rows = functions(4)
    data_dir = str(tmp_path / "functions")
    preparation.prepare(write_jsonl(tmp_path / "f.jsonl", rows), data_dir, eval_fraction=0)
    sizes = np.array([len(row["text"].encode()) for row in rows])
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    gin.bind_parameter("lengths.buckets", [64, 128])
    params = InputParams(4, 4, seed=0)
    with pytest.raises(UserError) as raised:
        input_fns.input_fn(Mode.TRAIN, params, data_dir=data_dir)
    assert str(raised.value).splitlines()[0] == (  # the line the command line prints
        f"{(sizes > 128).sum()} examples of text-train are longer than the last of "
        f"lengths.buckets (128; the longest has {sizes.max()}): add a bucket of at least "
        "that length, or cut them in preprocess"
    )
    monkeypatch.setattr(lengths, "PROBED", 2)
    with pytest.raises(UserError, match=r"^at least 2 examples of text-train are longer"):
        input_fns.input_fn(Mode.EVAL, params, data_dir=data_dir, eval_split="train")

    def cut(example):  # a preprocess that keeps a document's first 100 tokens
        features, labels = input_fns.features_and_label(example)
        return {"tokens": features["tokens"][:100]}, labels

    source, _ = input_fns._documents_of(data_dir, "train")
    caplog.set_level(logging.INFO)
    dataset = pipeline.build(source, Mode.TRAIN, params, cut, name="cut")
    assert "the 2 records kept longer than lengths.buckets' last (128) that were read fit it " \
        f"once preprocessed; {(sizes > 128).sum() - 2} more are checked as their batch is " \
        "padded" in caplog.text  # fmt: skip
    shapes = {f["tokens"].shape for f, _ in dataset.take(4).as_numpy_iterator()}
    assert shapes <= {(4, 64), (4, 128)}


def test_text_on_disk_in_batches_by_a_token_budget_is_the_text_held_in_memory(tmp_path):
    """Sized by the lengths prepare kept, records read from disk make the very batches
    that the same text held in memory makes, from step 0 and from a resume; a
    preprocess that lengthens them fails its batch rather than cut it."""
    rows = [{**row, "text": row["text"][: 20 + i * 37 % 280]} for i, row in enumerate(functions(8))]
    data_dir = str(tmp_path / "functions")
    preparation.prepare(write_jsonl(tmp_path / "f.jsonl", rows), data_dir, eval_fraction=0)
    gin.bind_parameter("lengths.group_batches", 3)
    gin.bind_parameter("lengths.buckets", [64, 128, 320])
    gin.bind_parameter("lengths.token_budget", 1280)  # 16 (the most), 10 and 4 a batch

    def batches(start=0, count=10, memory_limit_mb=None):
        gin.bind_parameter("pipeline.memory_limit_mb", memory_limit_mb)
        params = InputParams(16, 16, seed=3, start_example=start)
        dataset = input_fns.input_fn(Mode.TRAIN, params, data_dir=data_dir)
        return [f["tokens"] for f, _ in dataset.take(count).as_numpy_iterator()]

    from_disk, in_memory = batches(memory_limit_mb=0), batches()
    assert [b.shape for b in from_disk] == [b.shape for b in in_memory]
    assert 1 < len({b.shape for b in from_disk}) and {b.shape for b in from_disk} <= {
        (16, 64),
        (10, 128),
        (4, 320),
    }
    assert all((a == b).all() for a, b in zip(from_disk, in_memory, strict=True))
    start = sum(len(b) for b in from_disk[:4])
    resumed = batches(start=start, count=6, memory_limit_mb=0)
    assert all((a == b).all() for a, b in zip(resumed, from_disk[4:], strict=True))

    def lengthened(example):  # a preprocess that adds a token: the kept lengths fall short
        features, labels = input_fns.features_and_label(example)
        return {"tokens": tf.concat([[1], features["tokens"]], 0)}, labels

    gin.bind_parameter("lengths.buckets", [])  # each batch to the longest it was sized by
    source, _ = input_fns._documents_of(data_dir, "train")
    params = InputParams(16, 16, seed=3)
    dataset = pipeline.build(source, Mode.TRAIN, params, lengthened, name="lengthened")
    with pytest.raises(tf.errors.InvalidArgumentError, match="an example is longer than its"):
        list(dataset.take(3).as_numpy_iterator())  # failed, not cut


@pytest.mark.slow
def test_an_exported_classifier_keeps_of_a_text_the_longest_that_training_read(tmp_path, caplog):
    """One megabyte sent to an exported text classifier costs what its longest training
    document costs: the export keeps that many tokens of each text, its first."""
    import trainer
    from models.transformer import TextClassifier, Transformer

    rows = functions(3)
    data_dir = str(tmp_path / "data")
    preparation.prepare(write_jsonl(tmp_path / "f.jsonl", rows), data_dir)
    longest = input_fns.longest_prepared(data_dir)  # of every split, in bytes
    assert longest == max(len(row["text"].encode()) for row in rows) < 400

    def input_fn(mode, params):
        return input_fns.input_fn(mode, params, data_dir=data_dir)

    model = TextClassifier(257, 4, Transformer(width=16, depth=1, heads=2))
    estimator = trainer.Estimator(model, str(tmp_path / "run"), global_batch_size=4, progress=False)
    estimator.train(input_fn, 2)
    caplog.set_level(logging.INFO)
    serve = tf.saved_model.load(estimator.export(input_fn)).signatures["serving_default"]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Exported")]
    assert f"(text string [?]) (each text cut to its first {longest} tokens)" in said[0]
    huge = "def f():\n" + "    x = 1\n" * 100_000  # 1 MB
    served = serve(text=tf.constant([huge, "def g(): pass"]))
    cut = serve(text=tf.constant([huge[:longest], "def g(): pass"]))
    assert served["probabilities"].shape == (2, 4)
    # An export is written only where exports are: never over the data, say.
    with pytest.raises(UserError) as refused:
        estimator.export(input_fn, data_dir)
    assert str(refused.value) == (
        f"export_dir {data_dir} holds files an export did not write (dataset.json, "
        "test-00000-of-00001.tfrecord, test-00000-of-00001.tfrecord.index and 12 more): name "
        "a new or empty folder; nothing was written"
    )
    again = str(tmp_path / "again")
    estimator.export(input_fn, again)
    (tmp_path / "again" / "NOTES.md").write_text("served since Monday\n")
    estimator.export(input_fn, again)
    assert "NOTES.md" in os.listdir(again) and "saved_model.pb" in os.listdir(again)
    for name, values in served.items():
        np.testing.assert_allclose(values.numpy(), cut[name].numpy(), atol=1e-6)
