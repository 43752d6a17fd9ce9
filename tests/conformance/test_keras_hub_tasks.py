"""keras-hub 0.32's own task tests, ported: ``run_task_test`` with the Estimator.

keras-hub tests every task with ``TestCase.run_task_test``: predict on arrays, on a
dataset and on a dataset preprocessed apart (``task.preprocessor = None``), then fit
the same three ways. Ported here for ``GPT2CausalLM`` and ``BertTextClassifier`` with
their own test's setUp (``gpt2_causal_lm_test.py``, ``bert_text_classifier_test.py``):
``predict`` and ``fit`` are the Estimator's, everything else is kept. Changed on
purpose (docs/guide/keras.md, "Keras's own tests"):

* a causal LM's ``predict`` continues prompts by default (the framework's PREDICT
  of a language model); ``KerasModel(task, generates=False)`` predicts its logits,
  as ``task.predict`` does, which is what this test compares;
* the training input_fn repeats its dataset (README's input_fn: the stream of
  batches training reads), where ``fit`` reads one epoch;
* the training runs go on in one model_dir, so the third, on a pipeline that maps the
  preprocessor apart, cannot resume the second's saved input iterator: it is refused
  in one line that says so, and goes on with ``Checkpoints(input=False)``;
* an uncompiled task is refused before the first step, as a ``ValueError``, as
  ``fit`` refuses it.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras_hub.models import (
    BertBackbone,
    BertTextClassifier,
    BertTextClassifierPreprocessor,
    BertTokenizer,
    GPT2Backbone,
    GPT2CausalLM,
    GPT2CausalLMPreprocessor,
    GPT2Tokenizer,
)

from trainer import Checkpoints, Estimator, KerasModel, UserError

pytestmark = pytest.mark.slow  # each trains, or runs Keras beside the Estimator


def gpt2_setup():
    """``GPT2CausalLMTest.setUp``, as written."""
    merges = ["Ġ a", "Ġ t", "Ġ i", "Ġ b", "a i", "p l", "n e"]
    merges += ["Ġa t", "p o", "r t", "Ġt h", "ai r", "pl a", "po rt"]
    merges += ["Ġai r", "Ġa i", "pla ne"]
    vocab = []
    for merge in merges:
        a, b = merge.split(" ")
        vocab.extend([a, b, a + b])
    vocab += ["!", "<|endoftext|>"]
    vocab = sorted(set(vocab))  # Remove duplicates
    vocab = dict([(token, i) for i, token in enumerate(vocab)])
    preprocessor = GPT2CausalLMPreprocessor(
        GPT2Tokenizer(vocabulary=vocab, merges=merges),
        sequence_length=8,
    )
    vocabulary_size = preprocessor.tokenizer.vocabulary_size()
    backbone = GPT2Backbone(
        vocabulary_size=vocabulary_size,
        num_layers=2,
        num_heads=2,
        hidden_dim=4,
        intermediate_dim=8,
        max_sequence_length=preprocessor.sequence_length,
    )
    init_kwargs = {"preprocessor": preprocessor, "backbone": backbone}
    train_data = ([" airplane at airport", " airplane at airport"],)
    return init_kwargs, train_data, (2, 8, vocabulary_size)


def bert_setup():
    """``BertTextClassifierTest.setUp``, as written."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += ["the", "quick", "brown", "fox", "."]
    preprocessor = BertTextClassifierPreprocessor(
        BertTokenizer(vocabulary=vocab),
        sequence_length=5,
    )
    backbone = BertBackbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
        num_layers=2,
        num_heads=2,
        hidden_dim=2,
        intermediate_dim=4,
        max_sequence_length=preprocessor.sequence_length,
    )
    init_kwargs = {"preprocessor": preprocessor, "backbone": backbone, "num_classes": 2}
    train_data = (
        ["the quick brown fox.", "the slow brown fox."],  # Features.
        [1, 0],  # Labels.
    )
    return init_kwargs, train_data, (2, 2)


def of(dataset):
    """An input_fn of ``dataset``, which ``fit`` and ``predict`` would take as it is."""
    return lambda mode, params: dataset


def repeated(dataset):
    """An input_fn of ``dataset``, repeated: the training stream (README's input_fn)."""
    return lambda mode, params: dataset.repeat()


def run_task_test(cls, init_kwargs, train_data, expected_output_shape, model_dir, batch_size=2):
    """keras-hub's ``run_task_test``, its ``predict`` and ``fit`` the Estimator's."""
    keras.utils.set_random_seed(0)
    task = cls(**init_kwargs)
    preprocessor = task.preprocessor
    ds = tf.data.Dataset.from_tensor_slices(train_data).batch(batch_size)
    x, y, sw = keras.utils.unpack_x_y_sample_weight(train_data)

    def estimator(**settings):
        model = KerasModel(task, generates=False)
        return Estimator(model, str(model_dir), global_batch_size=batch_size, **settings)

    def predict(input_fn):
        found = list(estimator().predict(input_fn))
        assert all(len(p) == 1 for p in found)  # one output, named as Keras names it
        return np.stack([next(iter(p.values())) for p in found])

    # Test predict.
    output = predict(of(tf.data.Dataset.from_tensor_slices(x).batch(batch_size)))
    np.testing.assert_allclose(output, task.predict(x, verbose=0), atol=1e-6)
    if expected_output_shape is not None:
        assert output.shape == expected_output_shape
    # With a dataset.
    output_ds = predict(of(ds))
    np.testing.assert_allclose(output, output_ds, atol=1e-6)
    # With split preprocessing.
    task.preprocessor = None
    output_split = predict(of(ds.map(preprocessor)))
    task.preprocessor = preprocessor
    np.testing.assert_allclose(output, output_split, atol=1e-6)

    # Test fit.
    xy = tuple(part for part in (x, y, sw) if part is not None)
    estimator().train(repeated(tf.data.Dataset.from_tensor_slices(xy).batch(batch_size)), 1)
    # With a dataset.
    estimator().train(repeated(ds), 2)
    # With split preprocessing: the saved input iterator does not fit this pipeline.
    task.preprocessor = None
    with pytest.raises(UserError, match="tf.data iterator, which does not fit") as refused:
        estimator().train(repeated(ds.map(preprocessor)), 3)
    assert "weights, optimizer and step are intact" in str(refused.value)
    going_on = estimator(checkpoints=Checkpoints(input=False))
    assert going_on.train(repeated(ds.map(preprocessor)), 3) == 3
    task.preprocessor = preprocessor
    # Turn off default compilation, should error during `fit()`.
    task = cls(**init_kwargs, compile=False)
    with pytest.raises(ValueError, match="has no loss"):
        Estimator(task, str(model_dir / "uncompiled")).train(repeated(ds), 1)


@pytest.mark.parametrize(
    "setup, cls", [(gpt2_setup, GPT2CausalLM), (bert_setup, BertTextClassifier)]
)
def test_task_basics(setup, cls, tmp_path):
    init_kwargs, train_data, shape = setup()
    run_task_test(cls, init_kwargs, train_data, shape, tmp_path)


def test_a_causal_lm_continues_prompts_and_gives_their_padding_mask(tmp_path):
    """``GPT2CausalLMTest.test_generate``'s prompt, continued by predict: the prompt's
    tokens and padding mask lead the output, as ``generate`` returns them."""
    init_kwargs, _, _ = gpt2_setup()
    causal_lm = GPT2CausalLM(**init_kwargs)
    prompt = " airplane at airport"
    prompt_ids = init_kwargs["preprocessor"].generate_preprocess([prompt])
    predicted = list(
        Estimator(causal_lm, str(tmp_path)).predict(of(tf.data.Dataset.from_tensors([prompt])))
    )
    assert predicted[0]["text"].decode().startswith(prompt)
    np.testing.assert_array_equal(predicted[0]["token_ids"][:5], prompt_ids["token_ids"][0, :5])
    np.testing.assert_array_equal(
        predicted[0]["padding_mask"][:5], prompt_ids["padding_mask"][0, :5]
    )
