"""A keras-hub GPT2CausalLM fine-tuned on chats as it is: its tokenizer, a template, a masked loss.

The chats of ``tests/support/chats.py`` (non-ASCII among them) are rendered by ChatML
and tokenized by the model's own byte-pair tokenizer (``prepare --chat --preset``),
a real one: trained on them with Hugging Face's ``tokenizers``, as GPT-2's was, and
saved with a tiny GPT-2 by keras-hub's ``save_to_preset``. The model is loaded from
that preset without its preprocessor and compiled with a loss that is the mean over
the assistant's tokens (``reduction='mean_with_sample_weight'``); the Estimator's
three steps equal keras-hub's own ``fit`` of the same batches within 2e-5. A tiny
Gemma's SentencePiece tokenizer marks its chats too; pairs prepared so are refused by
the preference model, which reads bytes; a WordPiece preset and packing are refused.
"""

import functools
import io
import json
import os

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
import tokenizers

import trainer
from datasets.chat import input_fns, preparation, templates
from datasets.records import shards
from tests.support import chats, guides
from tests.support.as_typed import ok, sh
from tests.support.parity import AdamOfDenseGradients
from trainer import InputParams, Mode
from trainer.errors import first_line

BATCH, STEPS, RATE = 4, 3, 1e-3


def byte_pairs(texts: list[str]) -> tuple[dict, list[str]]:
    """A byte-level BPE learned from ``texts``: GPT-2's 256-character alphabet, merges, an end."""
    learner = tokenizers.ByteLevelBPETokenizer()
    learner.train_from_iterator(
        texts, vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False
    )
    model = json.loads(learner._tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return model["vocab"], merges


def preset_and_chats(root: str, preset: str = "gpt2_tiny", jsonl: str = "chats.jsonl"):
    """A tiny GPT-2 saved as a preset with a tokenizer learned from the chats, and the chats.

    ``preset`` and ``jsonl``: where under ``root``; returns their paths.
    """
    rows = chats.rows(40)
    os.makedirs(os.path.dirname(os.path.join(root, jsonl)), exist_ok=True)
    jsonl = chats.write(os.path.join(root, jsonl), rows)
    template = templates.template_of("chatml")
    vocabulary, merges = byte_pairs([template.render(r["messages"]).text for r in rows])
    keras.utils.set_random_seed(0)
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=256,
        dropout=0.0,
    )
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=256)
    preset = os.path.join(root, preset)
    keras_hub.models.GPT2CausalLM(backbone, preprocessor).save_to_preset(preset)
    return preset, jsonl


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hub_sft"))
    preset, jsonl = preset_and_chats(root)
    out = os.path.join(root, "chats")
    preparation.prepare(jsonl, out, eval_fraction=0.25, preset=preset)
    return preset, jsonl, out


def gemma_preset(root: str, texts: list[str]) -> str:
    """A tiny Gemma saved as a preset, its SentencePiece model trained on ``texts`` as
    Gemma's was: byte fallback, no normalization, spaces kept, the template's markers
    whole."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=360, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, minloglevel=2,
    )  # fmt: skip
    keras.utils.set_random_seed(0)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=model.getvalue())
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
    )
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=256)
    preset = os.path.join(root, "gemma_tiny")
    keras_hub.models.GemmaCausalLM(backbone, preprocessor).save_to_preset(preset)
    return preset


def causal_lm(preset: str, optimizer) -> keras_hub.models.GPT2CausalLM:
    """The preset's model without its preprocessor, its loss the assistant tokens' mean."""
    model = keras_hub.models.GPT2CausalLM.from_preset(preset, preprocessor=None)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def records(data_dir: str, split: str) -> list[dict]:
    metadata, paths = shards.check_shards(data_dir, split)
    dataset = tf.data.TFRecordDataset(paths).map(input_fns.parse)
    return list(dataset.as_numpy_iterator())


def test_chats_are_the_models_own_tokens_and_the_mask_spells_the_answers(prepared):
    """Each chat's ids are its tokenizer's of the whole rendered text, then its end token;
    the tokens marked detokenize to each answer and its end, and nothing else, and are
    those Hugging Face's offsets mark."""
    preset, jsonl, data_dir = prepared
    tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(preset)
    metadata = shards.read_metadata(data_dir)
    assert metadata["tokenizer"] == "GPT2Tokenizer" and metadata["preset"] == preset
    assert metadata["vocab_size"] == tokenizer.vocabulary_size()
    assert metadata["end_of_document"] == tokenizer.end_token_id
    template = templates.template_of("chatml")
    with open(jsonl) as f:
        rows = [json.loads(line)["messages"] for line in f]
    found = records(data_dir, "train") + records(data_dir, "test")
    by_ids = {tuple(tokenizer(template.render(m).text)): m for m in rows}
    assert len(found) == len(rows) == len(by_ids)
    for record in found:
        messages = by_ids[tuple(record["tokens"][:-1])]  # the whole text's tokens
        assert record["tokens"][-1] == tokenizer.end_token_id and record["mask"][-1] == 1
        marked = record["tokens"][:-1][record["mask"][:-1] == 1]
        answers = "".join(
            m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"
        )
        assert tokenizer.detokenize(marked) == answers
        # Hugging Face's mask of the same tokens: those holding a span's character, by the
        # character offsets its tokenizers library gives (keras-hub's own Python path).
        rendered = template.render(messages)
        offsets = tokenizer._tokenizer.encode(rendered.text).offsets
        spans = rendered.spans
        theirs = [any(a < end and b > start for start, end in spans) for a, b in offsets]
        np.testing.assert_array_equal(record["mask"][:-1], theirs)
    assert any(ord(c) > 127 for m in rows for t in m for c in t["content"])  # «é» among them


def test_a_sentencepiece_models_chats_are_its_tokens_and_the_mask_holds_each_answer(tmp_path):
    """Gemma's kind of tokenizer (SentencePiece): the ids are its own of the whole text, and
    each run of marked tokens is an answer and its end marker, with at most the newline
    before it, which SentencePiece starts the answer's first piece with."""
    rows = chats.rows(40)
    template = templates.template_of("chatml")
    preset = gemma_preset(str(tmp_path), [template.render(r["messages"]).text for r in rows])
    jsonl = chats.write(str(tmp_path / "chats.jsonl"), rows)
    metadata = preparation.prepare(jsonl, str(tmp_path / "chats"), preset=preset)
    tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(preset)
    assert metadata["tokenizer"] == "GemmaTokenizer" and metadata["end_of_document"] == 1
    by_ids = {tuple(tokenizer(template.render(m["messages"]).text)): m["messages"] for m in rows}
    found = records(str(tmp_path / "chats"), "train") + records(str(tmp_path / "chats"), "test")
    assert len(found) == len(rows) == len(by_ids)
    for record in found:
        messages = by_ids[tuple(record["tokens"][:-1])]
        ids, mask = record["tokens"][:-1], record["mask"][:-1]
        answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))  # each run's ends
        said = [
            tokenizer.detokenize(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)
        ]
        assert [text.removeprefix("\n") for text in said] == answers


def test_pairs_prepared_by_the_models_tokenizer_mark_each_answer(prepared, tmp_path):
    """``prepare --pairs --preset``: each answer's marked tokens detokenize to it and its
    end marker, after the same prompt's tokens."""
    from datasets.chat import pairs

    preset = prepared[0]
    rows = chats.pair_rows(12)
    source = str(tmp_path / "pairs.jsonl")
    with open(source, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    pairs.prepare(source, str(tmp_path / "pairs"), eval_fraction=0.25, preset=preset)
    tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(preset)
    found = chats.pair_records(str(tmp_path / "pairs"), "train")
    found += chats.pair_records(str(tmp_path / "pairs"), "test")
    by_chosen = {r["chosen"]: r for r in rows}
    assert len(found) == len(rows)
    for record in found:
        said = {}
        for answer in ("chosen", "rejected"):
            ids, mask = record[answer], record[f"{answer}_mask"]
            assert ids[-1] == tokenizer.end_token_id and mask[-1] == 1
            said[answer] = tokenizer.detokenize(ids[:-1][mask[:-1] == 1])
            start = int(np.argmax(mask))
            said[f"{answer}_prompt"] = tuple(ids[:start])
        assert said["chosen_prompt"] == said["rejected_prompt"]
        row = by_chosen[said["chosen"].removesuffix("<|im_end|>\n")]
        assert said["rejected"] == row["rejected"] + "<|im_end|>\n"


def test_pairs_for_a_keras_hub_model_given_to_a_preference_model_are_one_line(prepared, tmp_path):
    """PreferenceModel reads bytes, 0 its padding (GPT-2's "!"): pairs prepared with a
    preset are refused where they are read, naming how to prepare them."""
    from datasets.chat import pairs

    source = str(tmp_path / "pairs.jsonl")
    with open(source, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in chats.pair_rows(4))
    out = str(tmp_path / "pairs")
    pairs.prepare(source, out, eval_fraction=0.25, preset=prepared[0])
    with pytest.raises(trainer.UserError) as caught:
        input_fns.pairs_input_fn(Mode.TRAIN, InputParams(BATCH, BATCH), data_dir=out)
    assert first_line(caught.value) == (
        f"{out} holds pairs tokenized by GPT2Tokenizer for a keras-hub model (prepare "
        "--preset), and PreferenceModel reads bytes: prepare the pairs again without --preset"
    )


@pytest.mark.slow
def test_three_steps_equal_keras_hub_fit_with_a_masked_loss_and_evaluate_alike(prepared, tmp_path):
    """The Estimator trains the model as it is, on the input_fn's (x, y, sample_weight)
    batches, whole or in two micro-batches; keras-hub's fit of the same batches, with the
    same loss, ends within 2e-5 of each."""
    preset, _, data_dir = prepared
    input_fn = functools.partial(input_fns.input_fn, data_dir=data_dir)
    params = InputParams(BATCH, BATCH, seed=0)
    batches = input_fn(Mode.TRAIN, params).take(STEPS)
    x, y, w = next(iter(batches))
    assert set(x) == {"token_ids", "padding_mask"} and y.shape == w.shape == x["token_ids"].shape
    np.testing.assert_array_equal(tf.reduce_sum(x["padding_mask"], 1) > 0, True)

    theirs = causal_lm(preset, AdamOfDenseGradients(learning_rate=RATE))
    theirs.fit(batches, shuffle=False, verbose=0)
    start = causal_lm(preset, "adam")
    # Whole, and cut in two slices of unequal assistant tokens: the loss is the mean
    # over the whole batch's, however the step is cut.
    for name, cut in (("whole", 1), ("sliced", 2)):
        ours = causal_lm(preset, keras.optimizers.Adam(learning_rate=RATE))
        est = trainer.Estimator(
            ours,
            str(tmp_path / name),
            global_batch_size=BATCH,
            steps_per_loop=1,
            seed=0,
            progress=False,
            optimization=trainer.Optimization(microbatches=cut),
        )
        est.train(input_fn, max_steps=STEPS)
        moved = 0.0
        for v, mine, keras_weights, before in zip(
            ours.weights, ours.get_weights(), theirs.get_weights(), start.get_weights(), strict=True
        ):
            np.testing.assert_allclose(mine, keras_weights, rtol=0, atol=2e-5, err_msg=v.path)
            moved = max(moved, float(np.abs(keras_weights - before).max()))
        assert moved > 1e-3  # three steps of 1e-3 moved the weights well past the tolerance

    # Evaluated in batches of 4, the loss and accuracy are over every assistant token of
    # the held-out chats: Keras's of them all in one batch. (Keras's evaluate of batches
    # of 4 means the batches' means, and weighs each batch's accuracy by one over its
    # padded length: Mean's per-example reduction of per-token weights.)
    whole = input_fn(Mode.EVAL, InputParams(64, 64))
    expected = theirs.evaluate(whole, return_dict=True, verbose=0)
    evaluated = est.evaluate(input_fn)
    assert evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    accuracy = evaluated["sparse_categorical_accuracy"]
    assert accuracy == pytest.approx(expected["sparse_categorical_accuracy"], abs=1e-6)


def test_packing_chats_for_a_keras_hub_model_is_one_line(prepared):
    preset, _, data_dir = prepared
    import gin

    with gin.unlock_config():
        gin.bind_parameter("packing.length", 64)
    try:
        with pytest.raises(trainer.UserError) as caught:
            input_fns.input_fn(Mode.TRAIN, InputParams(BATCH, BATCH), data_dir=data_dir)
    finally:
        gin.clear_config()
    assert first_line(caught.value).startswith(
        f"packing.length: {data_dir} holds chats for a keras-hub model, whose backbone takes "
        "no segment ids"
    )


@pytest.mark.slow
def test_the_guides_command_and_gin_file_fine_tune_as_keras_hub_fit_does(tmp_path):
    """docs/guide/data.md's prepare command and gin file, run as a user types them in a
    folder holding their preset and chats: the evaluation after three steps is Keras's
    of the model keras-hub's fit trained on the same batches."""
    preset, _ = preset_and_chats(str(tmp_path), "presets/gpt2_chat", "data/chats.jsonl")
    command = next(
        line
        for line in guides.lines()
        if line.startswith("python3 -m datasets.prepare --chat") and "--preset" in line
    )
    ok(sh(command, tmp_path))
    gin_file = next(b for b in guides.code_blocks("gin") if "hub_task.preprocessor = None" in b)
    (tmp_path / "sft_gpt2.gin").write_text(gin_file)
    steps = ["experiment.max_steps = 3", "experiment.seed = 0", "Estimator.global_batch_size = 4"]
    bindings = " ".join(
        f"--gin_param '{b}'" for b in [*steps, "optimizers.Adam.learning_rate = 1e-3"]
    )
    ok(
        sh(
            f"python3 -m trainer --gin_file sft_gpt2.gin {bindings} --results results.json",
            tmp_path,
        )
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["global_step"] == STEPS
    evaluated = results["metrics"]["eval"]

    data_dir = str(tmp_path / "data" / "gpt2_chats")
    input_fn = functools.partial(input_fns.input_fn, data_dir=data_dir)
    theirs = causal_lm(preset, AdamOfDenseGradients(learning_rate=RATE))
    theirs.fit(
        input_fn(Mode.TRAIN, InputParams(BATCH, BATCH, seed=0)).take(STEPS),
        shuffle=False,
        verbose=0,
    )
    whole = input_fn(Mode.EVAL, InputParams(64, 64))
    expected = theirs.evaluate(whole, return_dict=True, verbose=0)
    assert evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    accuracy = evaluated["sparse_categorical_accuracy"]
    assert accuracy == pytest.approx(expected["sparse_categorical_accuracy"], abs=1e-6)


def test_a_wordpiece_preset_is_one_line(tmp_path):
    """A BERT preset's WordPiece tokenizer drops the spaces, so no token's place in the
    text is known: refused in one line, and nothing is written."""
    from tests.support.hub_tasks import classifier

    classifier().save_to_preset(str(tmp_path / "presets" / "bert"))
    jsonl = chats.write(str(tmp_path / "chats.jsonl"), chats.rows(4))
    with pytest.raises(trainer.UserError) as caught:
        preparation.prepare(jsonl, str(tmp_path / "out"), preset=str(tmp_path / "presets/bert"))
    assert first_line(caught.value) == (
        f"--preset {tmp_path}/presets/bert: its tokenizer is a BertTokenizer, which gives no "
        "token's place in the text, so the assistant's tokens cannot be found; chats are "
        "prepared with byte-pair (GPT-2's, Llama 3's, Qwen's) or SentencePiece (Gemma's, "
        "Llama 2's, Mistral's) tokenizers, or bytes (leave --preset out)"
    )
    assert not (tmp_path / "out").exists()
