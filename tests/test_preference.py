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
from tests.support import chats
from trainer import UserError

PAIRS = [
    {"prompt": f"Write f{i}.", "chosen": f"def f{i}():\n    return {i}", "rejected": f"def f{i}(:"}
    for i in range(8)
]


def _text(ids) -> str:
    return (np.asarray(ids) - 1).astype(np.uint8).tobytes().decode()


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
    records = chats.pair_records(str(tmp_path / "out"), "train")
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


@pytest.mark.parametrize("loss", ["dpo", "simpo"])
def test_the_pair_loss_is_the_published_formula_on_each_answer_scored_alone(loss, tmp_path):
    """DPO's -log sigmoid(beta ((log pi - log ref)_chosen - (...)_rejected)) and SimPO's
    -log sigmoid(beta (mean log pi_chosen - mean log pi_rejected) - gamma), written here
    in TF from each answer scored alone, unpadded, equal the model's on the padded
    batch; and so do its rewards' metrics."""
    import keras

    from models.preference import PreferenceModel
    from models.transformer import Transformer
    from trainer import Mode

    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    pairs.prepare(str(source), str(tmp_path / "out"), eval_fraction=0.0)
    records = chats.pair_records(str(tmp_path / "out"), "train")
    features, labels = chats.pair_batch(records)
    rng = np.random.default_rng(0)
    references = rng.normal(-60.0, 5.0, size=(2, len(records))).astype("float32")
    labels["reference_chosen"], labels["reference_rejected"] = map(tf.constant, references)
    keras.utils.set_random_seed(0)
    beta, gamma = (0.1, 0.0) if loss == "dpo" else (2.0, 0.5)
    model = PreferenceModel(
        258, Transformer(width=16, depth=1, heads=2), loss=loss, beta=beta, gamma=gamma
    )
    spec = model(features, labels, Mode.EVAL)

    def alone(ids, mask):  # one answer, no padding: its summed and mean log-probability
        tokens = tf.constant(ids[None, :-1])
        ones = tf.ones_like(tokens, tf.int32)
        logits = model.logits(tokens, ones, tf.range(tokens.shape[1])[None])
        logps = tf.gather(tf.nn.log_softmax(logits[0]), ids[1:], batch_dims=1)
        marked = tf.cast(mask[1:], tf.float32)
        return tf.reduce_sum(logps * marked), tf.reduce_sum(logps * marked) / tf.reduce_sum(marked)

    expected, margins = [], []
    for i, record in enumerate(records):
        (chosen, chosen_mean), (rejected, rejected_mean) = (
            alone(record[n], record[f"{n}_mask"]) for n in ("chosen", "rejected")
        )
        if loss == "dpo":
            margin = beta * ((chosen - references[0, i]) - (rejected - references[1, i]))
        else:
            margin = beta * (chosen_mean - rejected_mean) - gamma
        expected.append(-tf.math.log_sigmoid(margin))
        margins.append(float(margin + gamma))
    assert float(spec.loss) == pytest.approx(float(tf.reduce_mean(expected)), abs=1e-5)
    assert np.allclose(spec.metrics["reward_margin"], margins, atol=1e-4)
    assert spec.metrics["reward_accuracy"].numpy().tolist() == [float(m > 0) for m in margins]


def test_preference_settings_that_mean_nothing_are_one_line():
    from models.preference import PreferenceModel
    from trainer import Mode

    with pytest.raises(UserError, match=r"^PreferenceModel.loss = 'ipo': the losses are 'dpo'"):
        PreferenceModel(258, loss="ipo")
    with pytest.raises(UserError, match=r"^PreferenceModel.beta = 0 makes every reward 0"):
        PreferenceModel(258, beta=0.0)
    with pytest.raises(UserError, match=r"^PreferenceModel.gamma = 0.5 is SimPO's margin"):
        PreferenceModel(258, gamma=0.5)
    features = {"chosen": tf.ones([2, 3], tf.int64), "rejected": tf.ones([2, 4], tf.int64)}
    labels = {f"{a}_{k}": tf.ones_like(features[a]) for a in features for k in ("targets", "mask")}
    with pytest.raises(UserError, match=r"^PreferenceModel.loss = 'dpo' scores each answer "):
        PreferenceModel(258)(features, labels, Mode.TRAIN)


def test_pairs_read_back_as_batches_of_both_chats_with_their_targets_and_masks():
    from datasets.chat import input_fns
    from trainer import InputParams, Mode

    data_dir = chats.prepared_pairs()
    records = {tuple(r["chosen"][:-1]): r for r in chats.pair_records(data_dir, "test")}
    params = InputParams(batch_size=16, global_batch_size=16, seed=0)
    ((features, labels),) = input_fns.pairs_input_fn(Mode.EVAL, params, data_dir).take(1)
    assert set(features) == {"chosen", "rejected"} and len(features["chosen"]) == 16
    for i, chosen in enumerate(features["chosen"].numpy()):
        record = records[tuple(chosen[chosen > 0])]
        for name in ("chosen", "rejected"):
            n = len(record[name]) - 1
            assert (features[name].numpy()[i][:n] == record[name][:-1]).all()
            assert (labels[f"{name}_targets"].numpy()[i][:n] == record[name][1:]).all()
            assert (labels[f"{name}_mask"].numpy()[i][:n] == record[f"{name}_mask"][1:]).all()
            assert not labels[f"{name}_mask"].numpy()[i][n:].any()
    ((prompts, _),) = input_fns.pairs_input_fn(Mode.PREDICT, params, data_dir).take(1)
    first = chats.pair_rows(64)[3]  # the first pair held out
    text = _text(prompts["tokens"].numpy()[0][prompts["tokens"].numpy()[0] > 0])
    assert text == f"<|im_start|>user\n{first['prompt']}<|im_end|>\n<|im_start|>assistant\n"


def test_a_pair_loss_cut_in_micro_batches_trains_what_one_device_trains(tmp_path):
    """SimPO on pairs of unequal lengths, 5 steps: the per-pair loss is a mean over
    the step's pairs, so 4 micro-batches leave every weight within 2e-5 of the whole
    batch's (and the weights move)."""

    whole = chats.tuned(str(tmp_path / "whole"), 5)
    cut = chats.tuned(str(tmp_path / "cut"), 5, microbatches=4)
    first = chats.tuned(str(tmp_path / "first"), 1)
    assert max(float(np.abs(whole[k] - cut[k]).max()) for k in whole) <= 2e-5
    assert max(float(np.abs(whole[k] - first[k]).max()) for k in whole) > 1e-2
