"""Supervised fine-tuning on chats: ``prepare --chat`` (datasets/chat/preparation.py),
``chat.input_fn`` and a language model's loss over the assistant's tokens alone.

The records hold each chat as its template renders it, byte for byte, with the
assistant's mask; batches keep each chat's mask with its tokens, padded or packed; the
loss is the mean over the whole batch's assistant tokens, the same packed as padded.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets.chat import input_fns, preparation, templates
from datasets.records import shards
from models import judging
from tests.support import chats
from tests.support.chats import ZEPHYR_MARKED
from trainer import InputParams, Mode, UserError

CHATS = chats.rows(12)


def _text(ids) -> str:
    """The text of byte ids (byte + 1)."""
    return (np.asarray(ids) - 1).astype(np.uint8).tobytes().decode()


def _records(data_dir, split):
    _, paths = shards.check_shards(data_dir, split)
    return [input_fns.parse(r) for r in tf.data.TFRecordDataset(paths)]


def test_each_chat_is_its_rendered_bytes_and_the_answers_mask_then_the_end(tmp_path):
    source = chats.write(str(tmp_path / "chats.jsonl"), CHATS)
    metadata = preparation.prepare(source, str(tmp_path / "out"), eval_fraction=0.25)
    assert metadata["kind"] == "chat" and metadata["vocab_size"] == 258
    assert [metadata["splits"][s]["count"] for s in ("train", "test")] == [9, 3]
    chatml = templates.template_of("chatml")
    held = [i for i in range(12) if (i + 1) // 4 > i // 4]  # every fourth chat
    kept = [i for i in range(12) if i not in held]
    for split, rows in (("train", kept), ("test", held)):
        records = _records(str(tmp_path / "out"), split)
        starts = np.load(tmp_path / "out" / f"{split}-answers.npy")
        for record, row, start in zip(records, rows, starts, strict=True):
            rendered = chatml.render(CHATS[row]["messages"])
            ids, mask = record["tokens"].numpy(), record["mask"].numpy()
            assert _text(ids[:-1]) == rendered.text and ids[-1] == 257
            answers = _text(ids[mask == 1][:-1])
            assert answers == "".join(rendered.assistant()) and mask[-1] == 1
            assert start == np.argmax(mask) and mask[:start].sum() == 0
    template = (tmp_path / "out" / "chat_template.jinja").read_text()
    assert template == templates.CHATML
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "out"]  # no index


def test_a_model_directorys_template_and_a_chat_ending_with_a_question(tmp_path):
    """Zephyr's template (marked) from a model directory, its eos token inside the
    answer; a chat whose last turn is the user's ends with the end id unmarked."""
    model = tmp_path / "model"
    model.mkdir()
    config = {"chat_template": ZEPHYR_MARKED, "eos_token": "</s>"}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    asked = [*CHATS[2]["messages"], {"role": "user", "content": "and then?"}]
    source = chats.write(str(tmp_path / "c.jsonl"), [CHATS[2], {"messages": asked}])
    out = str(tmp_path / "out")
    preparation.prepare(source, out, template=str(model), eval_fraction=0.0)
    first, second = _records(out, "train")
    answer = CHATS[2]["messages"][1]["content"]  # one exchange, no system turn
    marked = _text(first["tokens"].numpy()[first["mask"].numpy() == 1][:-1])
    assert marked == f"{answer}</s>" and first["tokens"].numpy()[-1] == 257
    ids, mask = second["tokens"].numpy(), second["mask"].numpy()
    assert ids[-1] == 257 and mask[-1] == 0  # the end, not learned after a question
    assert _text(ids[:-1]).endswith("<|user|>\nand then?</s>\n")
    assert _text(ids[mask == 1]) == f"{answer}</s>"


def _batches(data_dir, mode, batch=4, count=1):
    params = InputParams(batch_size=batch, global_batch_size=batch, seed=0)
    dataset = input_fns.input_fn(mode, params, data_dir=data_dir)
    return list(dataset.take(count))


def test_batches_padded_and_packed_keep_each_chats_mask_with_its_tokens():
    """Padded: a chat's tokens but the last, their next tokens and those tokens' mask.
    Packed: each segment of a row is one of the same chats, its mask where its tokens
    are; no answer's mark lies in another chat or in padding."""
    import gin

    data_dir = chats.prepared()
    records = _records(data_dir, "train")
    ((features, labels),) = _batches(data_dir, Mode.EVAL, batch=8)
    assert set(labels) == {"targets", "mask"}
    by_tokens = {tuple(r["tokens"].numpy()[:-1]): r for r in _records(data_dir, "test")}
    for tokens, targets, mask in zip(
        features["tokens"].numpy(), labels["targets"].numpy(), labels["mask"].numpy(), strict=True
    ):
        real = tokens[tokens > 0]
        record = by_tokens[tuple(real)]
        assert (targets[: len(real)] == record["tokens"].numpy()[1:]).all()
        assert (mask[: len(real)] == record["mask"].numpy()[1:]).all()
        assert not mask[len(real) :].any()
    gin.bind_parameter("packing.length", 320)
    try:
        batches = _batches(data_dir, Mode.TRAIN, batch=8, count=3)
    finally:
        gin.clear_config()
    by_tokens = {tuple(r["tokens"].numpy()[:-1]): r for r in records}
    seen = 0
    for features, labels in batches:
        segments = features["segment_ids"].numpy()
        for row in range(segments.shape[0]):
            assert not labels["mask"].numpy()[row][segments[row] == 0].any()
            for segment in set(segments[row].tolist()) - {0}:
                at = segments[row] == segment
                record = by_tokens[tuple(features["tokens"].numpy()[row][at])]
                assert (labels["mask"].numpy()[row][at] == record["mask"].numpy()[1:]).all()
                seen += 1
    assert seen == 24


def test_a_length_that_cuts_off_whole_answers_is_refused_before_training():
    data_dir = chats.prepared()
    starts = np.load(f"{data_dir}/train-answers.npy")
    short = int(np.sort(starts)[-3]) - 1  # cuts the answers of the three latest-starting
    cut = int((starts > short).sum())
    with pytest.raises(UserError) as refused:
        input_fns.input_fn(
            Mode.TRAIN, InputParams(batch_size=4, global_batch_size=4), data_dir, length=short
        )
    first = int(np.flatnonzero(starts > short)[0]) + 1
    assert str(refused.value).splitlines()[0] == (
        f"chat.input_fn.length = {short} cuts off the whole answer of {cut} chats of "
        f"{data_dir}'s train split (the first: chat {first} of the split, its answer starts "
        f"at token {starts[first - 1]}): raise the length to {starts.max()}, or shorten "
        "their prompts"
    )
    enough = int(starts.max())
    params = InputParams(batch_size=48, global_batch_size=48, seed=0)
    ((_, labels),) = input_fns.input_fn(Mode.TRAIN, params, data_dir, length=enough).take(1)
    assert labels["mask"].shape[1] <= enough and labels["mask"].numpy().sum(axis=1).min() > 0


def test_prompts_are_each_chat_up_to_its_first_answer():
    data_dir = chats.prepared()
    ((features, labels),) = _batches(data_dir, Mode.PREDICT, batch=16)
    assert labels == {}
    chatml = templates.template_of("chatml")
    for tokens, row in zip(features["tokens"].numpy(), [3, 7, 11, 15], strict=False):
        prompt = _text(tokens[tokens > 0])
        first = chats.rows(64)[row]["messages"]
        system = 1 if first[0]["role"] == "system" else 0
        expected = chatml.render(first[: system + 1], add_generation_prompt=True).text
        assert prompt == expected


def test_the_language_models_loss_is_the_mean_over_the_assistants_tokens():
    """LanguageModel with a mask: the loss and token accuracy are over the marked
    tokens alone, as a token mean weighted by the mask written out."""
    from models.transformer import LanguageModel, Transformer
    from trainer.tokens import reported

    keras.utils.set_random_seed(0)
    model = LanguageModel(vocab_size=258, stack=Transformer(width=16, depth=1, heads=2))
    data_dir = chats.prepared()
    ((features, labels),) = _batches(data_dir, Mode.EVAL, batch=8)
    spec = model(features, labels, Mode.EVAL)
    logits = spec.predictions["logits"]
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels["targets"], logits)
    mask = tf.cast(labels["mask"], tf.float32)
    expected = float(tf.reduce_sum(losses * mask) / tf.reduce_sum(mask))
    means, tokens = reported(spec.loss)
    found = float(tf.reduce_sum(means * tokens) / tf.reduce_sum(tokens))
    assert found == pytest.approx(expected, rel=1e-6)
    assert float(tf.reduce_sum(tokens)) == float(tf.reduce_sum(mask))


@pytest.mark.parametrize("settings", [{}, {"microbatches": 2}, {"microbatches": 4}])
def test_sft_packed_and_cut_in_micro_batches_trains_what_one_device_trains_padded(
    settings, tmp_path
):
    """The parity row sft_packed in the columns of one process: packed in rows of 320,
    whole or in micro-batches, 5 steps leave every weight within 2e-5 of one device's
    on the same chats padded (the two-device and worker columns: tests/test_parity.py)."""
    from tests.support import parity

    found = parity.recipe_cell("sft_packed", "one_device", str(tmp_path))
    if settings:
        found = {"weights": parity.RECIPES["sft_packed"](settings, str(tmp_path / "cut"))}
        found["weights"] = {k: v.tolist() for k, v in found["weights"].items()}
    result = parity.recipe_result("sft_packed", found)
    assert result["worst"][1] <= 2e-5, result


class OddJudge(judging.Judge):
    """A judge whose scores vary from text to text: 1 for a text whose bytes' sum is odd."""

    name = "odd_share"

    def score(self, texts):
        return np.asarray([sum(t) % 2 for t in texts.reshape(-1)], np.float32)


def test_a_judged_share_of_generations_is_the_same_packed_padded_and_as_predicted(tmp_path):
    """LanguageModel.judge in EVAL: each held-out chat's prompt continued and judged,
    packed or padded, is the mean of the judge over what PREDICT generates from the
    same prompts (greedy, so the same texts)."""
    import gin

    import trainer
    from models.transformer import LanguageModel, Transformer

    data_dir = chats.prepared()

    def input_fn(mode, params):
        return input_fns.input_fn(mode, params, data_dir=data_dir)

    keras.utils.set_random_seed(5)
    stack = Transformer(width=16, depth=1, heads=2)
    model = LanguageModel(258, stack, generate=12, bytes=True, judge=OddJudge())
    estimator = trainer.Estimator(
        model,
        str(tmp_path),
        optimizer=keras.optimizers.SGD(0.0),
        global_batch_size=8,
        progress=False,
    )
    estimator.train(input_fn, 1)  # a checkpoint of the initial weights
    padded = estimator.evaluate(input_fn)
    gin.bind_parameter("packing.length", 320)
    try:
        packed = estimator.evaluate(input_fn)
    finally:
        gin.clear_config()
    texts = [p["text"] for p in estimator.predict(input_fn)]
    assert len(texts) == 16
    expected = float(OddJudge().score(np.asarray(texts, object)).mean())
    assert 0 < expected < 1
    assert padded["odd_share"] == pytest.approx(expected, abs=1e-6)
    assert packed["odd_share"] == pytest.approx(expected, abs=1e-6)


def test_python_parses_counts_an_answer_of_statements_up_to_the_templates_end():
    judge = judging.PythonParses()
    texts = [
        b"def f(x):\n    return x<|im_end|>\nrest that is not Python",
        b"def f(x:\n",
        b"# a comment alone\n",
        b"   ",
        b"x = '\xc3\xa9'",
        b"\x00",
    ]
    assert judge.score(np.asarray(texts, object)).tolist() == [1, 0, 0, 0, 1, 0]


def test_sft_stopped_and_resumed_trains_what_a_straight_run_trains(tmp_path):
    """Packed chats, 2 steps, then a new Estimator (its model made from other weights)
    resumes to step 5: every weight as a straight run of 5 steps leaves it (the
    checkpoint holds the weights and the training stream's place)."""
    from tests.support.helpers import checkpoint_steps

    straight = chats.trained(str(tmp_path / "straight"), 5)
    chats.trained(str(tmp_path / "resumed"), 2)
    assert checkpoint_steps(tmp_path / "resumed") == [2]
    resumed = chats.trained(str(tmp_path / "resumed"), 5, init=4)
    assert max(float(np.abs(straight[k] - resumed[k]).max()) for k in straight) == 0.0
