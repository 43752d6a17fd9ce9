"""Preference pairs prepared for preference tuning (datasets/chat/pairs.py): each answer
rendered after its prompt, byte for byte as the template renders the chat, its mask
over the answer alone; strings and chats alike; a pair that prefers nothing refused."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from datasets.chat import pairs, templates
from datasets.records import shards
from trainer import UserError

PAIRS = [
    {"prompt": f"Write f{i}.", "chosen": f"def f{i}():\n    return {i}", "rejected": f"def f{i}(:"}
    for i in range(8)
]


def _text(ids) -> str:
    return (np.asarray(ids) - 1).astype(np.uint8).tobytes().decode()


def _records(data_dir, split):
    _, paths = shards.check_shards(data_dir, split)
    spec = {k: tf.io.VarLenFeature(tf.int64) for k in ("chosen", "rejected")}
    spec |= {f"{k}_mask": tf.io.VarLenFeature(tf.int64) for k in ("chosen", "rejected")}
    return [
        {k: tf.sparse.to_dense(v).numpy() for k, v in tf.io.parse_single_example(r, spec).items()}
        for r in tf.data.TFRecordDataset(paths)
    ]


def _chats(pair):
    """A pair as chats, as TRL's conversational preference datasets keep it."""
    return {
        "prompt": [{"role": "user", "content": pair["prompt"]}],
        "chosen": [{"role": "assistant", "content": pair["chosen"]}],
        "rejected": [{"role": "assistant", "content": pair["rejected"]}],
    }


@pytest.mark.parametrize("form", ["strings in JSON lines", "chats in Parquet"])
def test_each_answer_follows_its_prompt_as_the_template_renders_the_chat(form, tmp_path):
    if form == "chats in Parquet":
        source = str(tmp_path / "pairs.parquet")
        pq.write_table(pa.Table.from_pylist([_chats(p) for p in PAIRS]), source)
    else:
        source = tmp_path / "pairs.jsonl"
        source.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
        source = str(source)
    metadata = pairs.prepare(source, str(tmp_path / "out"), eval_fraction=0.25)
    assert metadata["kind"] == "pairs" and metadata["splits"]["test"]["count"] == 2
    chatml = templates.template_of("chatml")
    records = _records(str(tmp_path / "out"), "train")
    lengths = np.load(tmp_path / "out" / "train-lengths.npy")
    for record, pair, length in zip(
        records, [p for i, p in enumerate(PAIRS) if i % 4 != 3], lengths, strict=True
    ):
        for name in ("chosen", "rejected"):
            chat = _chats(pair)
            rendered = chatml.render(chat["prompt"] + chat[name])
            ids, mask = record[name], record[f"{name}_mask"]
            assert _text(ids[:-1]) == rendered.text and ids[-1] == 257 and mask[-1] == 1
            assert _text(ids[mask == 1][:-1]) == pair[name] + "<|im_end|>\n"
        assert length == max(len(record["chosen"]), len(record["rejected"]))
    assert "index" not in " ".join(p.name for p in tmp_path.iterdir())


def test_a_pair_whose_answers_are_the_same_is_one_line_and_nothing_is_written(tmp_path):
    same = [*PAIRS[:3], {**PAIRS[3], "rejected": PAIRS[3]["chosen"]}]
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in same))
    with pytest.raises(UserError) as refused:
        pairs.prepare(str(source), str(tmp_path / "out"))
    assert str(refused.value) == (
        f"{source}, pair 4: the chosen and rejected answers are the same, so the pair "
        "prefers nothing: drop it, or give the answer it is preferred to"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]
