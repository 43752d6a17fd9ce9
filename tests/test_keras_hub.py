"""keras-hub task models given to the Estimator as they are, with raw strings as fit takes them.

A tiny ``BertTextClassifier`` (2 layers, width 32, this file's vocabulary) trains as
keras-hub's own ``fit`` trains it, resumes at its exact batch, loads from a preset and
from a Hugging Face-layout directory this file writes, exports a model that takes
strings, and trains only its LoRA adapters when they are enabled.
"""

import json
import logging
import os

import gin
import keras
import keras_hub
import numpy as np
import pytest
import safetensors.numpy
import tensorflow as tf

import trainer
from models.hub import hub_task
from tests.support import guides
from tests.support.helpers import on_two_cpus
from tests.support.hub_tasks import (
    BATCH,
    LENGTH,
    STEPS,
    VOCAB,
    WIDTH,
    classifier,
    estimator,
    fitted,
    input_fn_of,
    sentences,
)
from tests.support.parity import AdamOfDenseGradients
from trainer.errors import first_line


def assert_same_weights(ours, theirs, atol, skip=()):
    for v, mine, keras_weights in zip(
        ours.weights, ours.get_weights(), theirs.get_weights(), strict=True
    ):
        if v.path not in skip:
            np.testing.assert_allclose(mine, keras_weights, rtol=0, atol=atol, err_msg=v.path)


GATHERED = ("token_embedding/embeddings", "segment_embedding/embeddings")


@pytest.mark.slow
def test_a_bert_classifier_trains_as_keras_hub_fit_and_resumes_at_its_batch(tmp_path):
    """Raw strings, the same batches from the same weights: keras-hub's fit within 2e-5.

    Every weight but the gathered embedding tables is within 2e-5 of fit as it is; the
    tables too of fit with Adam of the dense gradient (``AdamOfDenseGradients``).
    Steps 4-6 read the second dozen sentences, so a resume that restarted the stream
    (or lost the optimizer's moments) would end elsewhere.
    """
    x, y = sentences(2 * STEPS * BATCH, seed=1)
    stock, _ = fitted(x, y)
    dense, (after_three, _) = fitted(x, y, AdamOfDenseGradients(learning_rate=5e-5))

    ours = classifier()
    estimator(ours, tmp_path).train(input_fn_of(x, y), max_steps=STEPS)
    for mine, keras_weights in zip(ours.get_weights(), after_three, strict=True):
        np.testing.assert_allclose(mine, keras_weights, rtol=0, atol=2e-5)

    resumed = classifier()  # a new process's model: the checkpoint's weights replace its own
    est = estimator(resumed, tmp_path)
    est.train(input_fn_of(x, y), max_steps=2 * STEPS)
    assert_same_weights(resumed, dense, atol=2e-5)
    assert_same_weights(resumed, stock, atol=2e-5, skip=GATHERED)
    expected = dense.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    evaluated = est.evaluate(input_fn_of(x, y))
    assert sorted(expected) == ["loss", "sparse_categorical_accuracy"]
    for name, value in expected.items():
        assert evaluated[name] == pytest.approx(value, rel=1e-4), name


@pytest.mark.slow
def test_a_task_trains_on_two_devices_what_one_trains(tmp_path):
    """Mirrored replicas, each half the batch: keras-hub's fit on one device."""
    apart = on_two_cpus("tests.support.hub_tasks", "mirrored_apart", str(tmp_path))
    assert apart < 2e-5, apart


@pytest.mark.slow
def test_the_guides_snippet_trains_a_preset_that_reloads_and_exports_taking_strings(
    tmp_path, monkeypatch
):
    """docs/guide/keras.md's snippet as written, from a working directory, its preset name
    (which needs internet) given as a directory saved by save_to_preset: the preset
    reloads to the same logits within 1e-6, gin's hub_task loads it, and the export
    takes strings and serves the trained model's logits."""
    classifier().save_to_preset(str(tmp_path / "preset"))
    x, _ = sentences(2 * BATCH, seed=2)
    made = classifier()
    loaded = keras_hub.models.TextClassifier.from_preset(str(tmp_path / "preset"))
    assert type(loaded).__name__ == "BertTextClassifier"
    expected = made(made.preprocessor(x))
    np.testing.assert_allclose(loaded(loaded.preprocessor(x)), expected, rtol=0, atol=1e-6)

    from_gin = gin_task(
        "hub_task.task = 'TextClassifier'",
        f"hub_task.preset = '{tmp_path / 'preset'}'",
        "hub_task.sequence_length = 8",
        "hub_task.lora_rank = 2",
        "hub_task.num_classes = 2",
    )
    assert type(from_gin).__name__ == "BertTextClassifier"
    assert from_gin.preprocessor.sequence_length == 8
    query = from_gin.backbone.get_layer("transformer_layer_0")._self_attention_layer._query_dense
    assert query.lora_enabled
    for task, preset, says in [
        ("Nope", tmp_path / "preset", "'Nope' is not a task of keras_hub.models"),
        ("TextClassifier", tmp_path / "missing", "could not load preset"),
    ]:
        with pytest.raises(trainer.UserError) as caught:
            hub_task(task=task, preset=str(preset))
        assert says in first_line(caught.value)  # the line the command line prints

    snippet = next(b for b in guides.code_blocks("python") if "bert_tiny_en_uncased" in b)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(snippet.replace('"bert_tiny_en_uncased"', repr(str(tmp_path / "preset"))), namespace)
    assert namespace["estimator"].step == 20
    export_dir = tmp_path / "output/bert/export/20"
    assert json.loads((export_dir / "assets.extra" / "imports.json").read_text()) == ["keras_hub"]
    served = trainer.load_export(str(export_dir)).signatures["serving_default"]
    signature = served.structured_input_signature[1]
    assert {k: (v.dtype, v.shape.as_list()) for k, v in signature.items()} == {
        "x": (tf.string, [None])
    }
    (logits,) = served(x=tf.constant(x)).values()
    trained = namespace["classifier"]
    np.testing.assert_allclose(logits, trained(trained.preprocessor(x)), rtol=0, atol=1e-5)


def gin_task(*bindings: str) -> keras.Model:
    """``hub_task()`` as a gin file binds it."""
    try:
        gin.parse_config(bindings)
        return hub_task()
    finally:
        gin.clear_config()


def hugging_face_bert(directory, seed: int = 3) -> dict[str, np.ndarray]:
    """A BERT as Hugging Face lays one out (config.json, model.safetensors, vocab.txt),
    with random weights; returns them by Hugging Face's names."""
    rng = np.random.default_rng(seed)
    hidden, inner, shapes = WIDTH, 2 * WIDTH, {}
    shapes["embeddings.word_embeddings.weight"] = (len(VOCAB), hidden)
    shapes["embeddings.position_embeddings.weight"] = (LENGTH, hidden)
    shapes["embeddings.token_type_embeddings.weight"] = (2, hidden)
    norms = ["embeddings.LayerNorm"]
    for i in range(2):
        layer = f"encoder.layer.{i}"
        for part in ("query", "key", "value"):
            shapes[f"{layer}.attention.self.{part}.weight"] = (hidden, hidden)
            shapes[f"{layer}.attention.self.{part}.bias"] = (hidden,)
        shapes[f"{layer}.attention.output.dense.weight"] = (hidden, hidden)
        shapes[f"{layer}.attention.output.dense.bias"] = (hidden,)
        shapes[f"{layer}.intermediate.dense.weight"] = (inner, hidden)
        shapes[f"{layer}.intermediate.dense.bias"] = (inner,)
        shapes[f"{layer}.output.dense.weight"] = (hidden, inner)
        shapes[f"{layer}.output.dense.bias"] = (hidden,)
        norms += [f"{layer}.attention.output.LayerNorm", f"{layer}.output.LayerNorm"]
    shapes["pooler.dense.weight"] = (hidden, hidden)
    shapes["pooler.dense.bias"] = (hidden,)
    tensors = {k: (0.1 * rng.standard_normal(s)).astype("float32") for k, s in shapes.items()}
    for norm in norms:
        tensors[f"{norm}.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype("float32")
        tensors[f"{norm}.bias"] = (0.1 * rng.standard_normal(hidden)).astype("float32")
    directory.mkdir()
    safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": len(VOCAB),
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "hidden_size": hidden,
        "intermediate_size": inner,
        "max_position_embeddings": LENGTH,
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return tensors


@pytest.mark.slow
def test_a_hugging_face_directory_loads_and_lora_trains_only_its_adapters(tmp_path):
    """Hugging Face's weights land where keras-hub maps them; with LoRA, only the
    adapters (and the new head) move, and a resume ends bitwise where a straight run does."""
    written = hugging_face_bert(tmp_path / "hf")
    x, y = sentences(4 * BATCH, seed=4)

    hf = str(tmp_path / "hf")

    def task():
        keras.utils.set_random_seed(0)
        shorter = keras_hub.models.BertTextClassifierPreprocessor.from_preset(
            hf, sequence_length=LENGTH
        )
        model = keras_hub.models.BertTextClassifier.from_preset(
            hf, num_classes=2, preprocessor=shorter, dropout=0.0
        )
        model.backbone.enable_lora(rank=2)
        return model

    # keras-hub's sequence_length does not reach a Hugging Face directory's preprocessor,
    # which stays at 512 tokens against 12 positions: one line, before any step.
    too_long = keras_hub.models.BertTextClassifier.from_preset(hf, num_classes=2)
    with pytest.raises(trainer.UserError, match="makes sequences of 512 tokens, but Bert"):
        estimator(too_long, tmp_path / "too_long")
    model = task()
    words = model.backbone.get_layer("token_embedding").embeddings.numpy()
    np.testing.assert_array_equal(words, written["embeddings.word_embeddings.weight"])
    frozen = [v.numpy() for v in model.backbone.non_trainable_weights]
    adapters = {v.path: v.numpy() for v in model.backbone.trainable_variables}
    # keras-hub's LoRA: query and value take adapters (their biases stay trainable).
    assert sum("lora_kernel" in path for path in adapters) == 2 * 2 * 2
    assert all("lora" in p or p.endswith(("query/bias", "value/bias")) for p in adapters)

    est = estimator(model, tmp_path / "lora")
    est.train(input_fn_of(x, y), max_steps=2)
    resumed = task()
    estimator(resumed, tmp_path / "lora").train(input_fn_of(x, y), max_steps=4)
    straight = task()
    estimator(straight, tmp_path / "straight").train(input_fn_of(x, y), max_steps=4)

    assert_same_weights(resumed, straight, atol=0)  # bitwise
    for v, before in zip(straight.backbone.non_trainable_weights, frozen, strict=True):
        np.testing.assert_array_equal(v.numpy(), before, err_msg=v.path)
    moved = [
        v.path
        for v in straight.backbone.trainable_variables
        if not np.array_equal(v.numpy(), adapters[v.path])
    ]
    assert any("lora_kernel_b" in path for path in moved), moved  # b starts at zero


# GPT-2's byte-pair vocabulary for "airplane", "air", "airport" and "at" (Ġ: a space).
# As in GPT-2's, id 0 ("!") pads and is not the end token, which generation stops at.
BYTE_PAIRS = ["!", "Ġ", "<|endoftext|>", *"airplneto", "ai", "air", "Ġa", "Ġai", "Ġair"]
BYTE_PAIRS += ["pl", "an", "ane", "plane", "po", "rt", "port", "Ġat"]
MERGES = ["a i", "ai r", "Ġ a", "Ġa i", "Ġai r", "p l", "a n", "an e", "pl ane", "p o"]
MERGES += ["r t", "po rt", "Ġa t"]


def causal_lm(optimizer=None) -> keras_hub.models.GPT2CausalLM:
    """A tiny GPT-2 language model with its preprocessor, seeded, compiled as keras-hub does."""
    keras.utils.set_random_seed(0)
    vocabulary = {token: i for i, token in enumerate(BYTE_PAIRS)}
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=MERGES)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(vocabulary),
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    model = keras_hub.models.GPT2CausalLM(
        backbone, keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=LENGTH)
    )
    if optimizer is not None:
        metrics = [keras.metrics.SparseCategoricalAccuracy()]
        model.compile(optimizer=optimizer, loss=model.loss, weighted_metrics=metrics)
    return model


@pytest.mark.slow
def test_a_gpt2_causal_lm_trains_on_bare_strings_as_fit_and_resumes_through_its_tokenizer(
    tmp_path,
):
    """Strings alone, as keras-hub's fit takes a causal LM's: its preprocessor makes the
    labels and the padding's weights; the loss is per token; the iterator is saved
    through the byte-pair tokenizer's cache; predict and the export continue prompts
    given as strings, as its generate does."""
    rng = np.random.default_rng(5)
    pieces = ["airplane", " airplane", " at", " airport", " air", "!"]
    x = np.array(["".join(rng.choice(pieces, size=rng.integers(1, 6))) for _ in range(24)])

    def input_fn(mode, params):
        dataset = tf.data.Dataset.from_tensor_slices(x)
        return (dataset.repeat() if mode == trainer.Mode.TRAIN else dataset).batch(BATCH)

    theirs = causal_lm(AdamOfDenseGradients(learning_rate=2e-5))  # keras-hub's rate
    for half in np.split(x, 2):
        theirs.fit(half, batch_size=BATCH, shuffle=False, verbose=0)
    estimator(causal_lm(), tmp_path).train(input_fn, max_steps=STEPS)
    ours = causal_lm()
    ours.compile(sampler="greedy")  # keras-hub's defaults, a greedy generate
    est = estimator(ours, tmp_path)
    est.train(input_fn, max_steps=2 * STEPS)  # resumed at step 3, the second dozen next
    assert_same_weights(ours, theirs, atol=2e-5)

    expected = theirs.evaluate(x, batch_size=BATCH, return_dict=True, verbose=0)
    evaluated = est.evaluate(input_fn)
    assert evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert evaluated["bits_per_token"] == pytest.approx(expected["loss"] / np.log(2), rel=1e-5)

    # Predict continues prompts as keras-hub's generate does (greedy, as compiled), so
    # does the export, and --schedule predict writes the text (test_experiments.py).
    prompts = ["air", " at", "airplane", "!"]
    expected = ours.generate(prompts)
    predicted = list(
        est.predict(lambda mode, params: tf.data.Dataset.from_tensor_slices(prompts).batch(BATCH))
    )
    assert [p["text"].decode() for p in predicted] == expected
    assert any(len(text) > len(prompt) for text, prompt in zip(expected, prompts, strict=True))
    served = trainer.load_export(est.export(input_fn)).signatures["serving_default"]
    outputs = served(x=tf.constant(prompts))
    assert [t.decode() for t in outputs["text"].numpy()] == expected
    np.testing.assert_array_equal(outputs["token_ids"], [p["token_ids"] for p in predicted])


def test_a_causal_lm_bound_in_gin_generates_with_its_sampler_and_a_wrong_one_is_one_line(
    tmp_path,
):
    """hub_task.sampler compiles a CausalLM preset with it, as keras-hub's compile does;
    a name keras_hub.samplers does not know, or a task that does not generate, is
    refused in one line (keras-hub's own get() gives an unknown name back)."""
    causal_lm().save_to_preset(str(tmp_path / "lm"))
    classifier().save_to_preset(str(tmp_path / "classifier"))
    preset = f"hub_task.preset = '{tmp_path / 'lm'}'"
    model = gin_task("hub_task.task = 'CausalLM'", preset, "hub_task.sampler = 'greedy'")
    assert type(model).__name__ == "GPT2CausalLM"
    assert isinstance(model.sampler, keras_hub.samplers.GreedySampler)
    assert isinstance(model.optimizer, keras.optimizers.Adam)  # keras-hub's compile
    for bindings, says in [
        (("hub_task.task = 'CausalLM'", preset, "hub_task.sampler = 'nope'"),
         "hub_task.sampler = 'nope' is not a sampler of keras_hub.samplers: give 'greedy',"),
        (("hub_task.task = 'TextClassifier'", f"hub_task.preset = '{tmp_path / 'classifier'}'",
          "hub_task.num_classes = 2", "hub_task.sampler = 'greedy'"),
         "hub_task.sampler: BertTextClassifier does not generate; a sampler is for a CausalLM"),
    ]:  # fmt: skip
        with pytest.raises(trainer.UserError) as caught:
            gin_task(*bindings)
        assert says in first_line(caught.value)  # the line the command line prints


def test_token_ids_given_to_a_task_that_tokenizes_text_itself_are_one_line(tmp_path):
    """Prepared text (token ids) given to a keras-hub task, whose preprocessor takes
    strings: refused before the first step, not a traceback deep in keras-hub."""
    ids = np.array([[5, 6, 7, 0], [8, 9, 0, 0]] * 4, np.int64)

    def input_fn(mode, params):
        dataset = tf.data.Dataset.from_tensor_slices(({"tokens": ids}, np.arange(8) % 2))
        return dataset.repeat().batch(params.batch_size)

    estimator = trainer.Estimator(classifier(), str(tmp_path / "run"), global_batch_size=4)
    with pytest.raises(trainer.UserError) as caught:
        estimator.train(input_fn, 1)
    assert first_line(caught.value) == (
        "BertTextClassifier tokenizes text itself (BertTextClassifierPreprocessor takes "
        "strings), but the input_fn gives token ids (int64 [?, 4]): give it the text as "
        "strings, or load the task without its preprocessor (hub_task.preprocessor = None) "
        "and give it the inputs its backbone takes"
    )
    assert not os.path.exists(tmp_path / "run" / "checkpoint")


def test_a_masked_lm_is_said_to_draw_its_masks_anew_on_resume(caplog):
    """Its preprocessor masks at random in tf.data: the one line a run logs about it."""
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCAB)
    masked_lm = keras_hub.models.BertMaskedLM(
        classifier().backbone,
        keras_hub.models.BertMaskedLMPreprocessor(tokenizer, sequence_length=LENGTH),
    )
    with caplog.at_level(logging.WARNING):
        trainer.KerasModel(masked_lm)
    (said,) = [r.getMessage() for r in caplog.records if "masks tokens at random" in r.getMessage()]
    assert said.startswith("BertMaskedLMPreprocessor masks tokens at random in tf.data")
