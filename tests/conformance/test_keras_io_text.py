"""keras-io's text examples as written, trained by the Estimator and by ``fit``.

Each example's model, compile and data pipeline are kept as published (Keras 3.15);
only the download is replaced by synthetic text of the same shape, and the sizes are
made small. What changes, and why:

* dropout is 0: its draws differ between ``fit`` and the framework's step;
* the shuffle is left out, so that both read the same batches in the same order;
* where an embedding meets Adam, ``fit`` runs Keras's Adam of the dense gradient
  (``AdamOfDenseGradients``, the framework's update by design: docs/guide/keras.md);
* ``ops.tile(mask, mult)`` given a symbolic multiple does not build under Keras 3.15:
  ``ops.tile(mask, [batch_size, 1, 1])`` stands in its place.
"""

import string

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

from tests.support.parity import AdamOfDenseGradients
from trainer import Checkpoints, Estimator, Mode

pytestmark = pytest.mark.slow  # each trains, or runs Keras beside the Estimator

WORDS = [f"w{i}" for i in range(100)]
STEPS = 4
BATCH = 8


def sentences(count, seed=0):
    """Lines of 3 to 14 words, a few with the review's ``<br />`` and punctuation."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(count):
        words = rng.choice(WORDS, size=rng.integers(3, 15))
        lines.append(" ".join(words) + ("<br />!" if i % 5 == 0 else "."))
    return lines


# ------------------------------------------------ text_generation_with_miniature_gpt

vocab_size = 60
maxlen = 12
embed_dim = 16
num_heads = 2
feed_forward_dim = 16


def causal_attention_mask(batch_size, n_dest, n_src, dtype):
    i = ops.arange(n_dest)[:, None]
    j = ops.arange(n_src)
    m = i >= j - n_src + n_dest
    mask = ops.cast(m, dtype)
    mask = ops.reshape(mask, [1, n_dest, n_src])
    return ops.tile(mask, [batch_size, 1, 1])  # as published: a symbolic multiple


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.0):  # published: 0.1
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads, embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        input_shape = ops.shape(inputs)
        batch_size = input_shape[0]
        seq_len = input_shape[1]
        causal_mask = causal_attention_mask(batch_size, seq_len, seq_len, "bool")
        attention_output = self.att(inputs, inputs, attention_mask=causal_mask)
        attention_output = self.dropout1(attention_output)
        out1 = self.layernorm1(inputs + attention_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(0, maxlen, 1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def create_model(optimizer="adam"):
    keras.utils.set_random_seed(1)
    inputs = layers.Input(shape=(maxlen,), dtype="int32")
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, feed_forward_dim)
    x = transformer_block(x)
    outputs = layers.Dense(vocab_size)(x)
    model = keras.Model(inputs=inputs, outputs=[outputs, x])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer,
        loss=[loss_fn, None],
    )  # No loss and optimization based on word embeddings from transformer block
    return model


def custom_standardization(input_string):
    """Remove html line-break tags and handle punctuation"""
    lowercased = tf.strings.lower(input_string)
    stripped_html = tf.strings.regex_replace(lowercased, "<br />", " ")
    return tf.strings.regex_replace(stripped_html, f"([{string.punctuation}])", r" \1")


def gpt_pipeline():
    """The example's text_ds and its vectorize_layer (adapted to the text)."""
    lines = sentences(BATCH * STEPS)
    vectorize_layer = layers.TextVectorization(
        standardize=custom_standardization,
        max_tokens=vocab_size - 1,
        output_mode="int",
        output_sequence_length=maxlen + 1,
    )
    vectorize_layer.adapt(tf.data.Dataset.from_tensor_slices(lines).batch(BATCH))

    def prepare_lm_inputs_labels(text):
        text = tf.expand_dims(text, -1)
        tokenized_sentences = vectorize_layer(text)
        x = tokenized_sentences[:, :-1]
        y = tokenized_sentences[:, 1:]
        return x, y

    def text_ds(batch_size):
        ds = tf.data.Dataset.from_tensor_slices(lines).batch(batch_size)
        return ds.map(prepare_lm_inputs_labels, num_parallel_calls=tf.data.AUTOTUNE)

    return text_ds, vectorize_layer.get_vocabulary()


class TextGenerator(keras.callbacks.Callback):
    """The example's callback, as written (its print kept in ``self.printed``)."""

    def __init__(self, max_tokens, start_tokens, index_to_word, top_k=10, print_every=1):
        self.max_tokens = max_tokens
        self.start_tokens = start_tokens
        self.index_to_word = index_to_word
        self.print_every = print_every
        self.k = top_k
        self.printed = []

    def sample_from(self, logits):
        logits, indices = ops.top_k(logits, k=self.k, sorted=True)
        indices = np.asarray(indices).astype("int32")
        preds = keras.activations.softmax(ops.expand_dims(logits, 0))[0]
        preds = np.asarray(preds).astype("float32")
        return np.random.choice(indices, p=preds)

    def detokenize(self, number):
        return self.index_to_word[number]

    def on_epoch_end(self, epoch, logs=None):
        start_tokens = [_ for _ in self.start_tokens]
        if (epoch + 1) % self.print_every != 0:
            return
        num_tokens_generated = 0
        tokens_generated = []
        while num_tokens_generated <= self.max_tokens:
            pad_len = maxlen - len(start_tokens)
            sample_index = len(start_tokens) - 1
            if pad_len < 0:
                x = start_tokens[:maxlen]
                sample_index = maxlen - 1
            elif pad_len > 0:
                x = start_tokens + [0] * pad_len
            else:
                x = start_tokens
            x = np.array([x])
            y, _ = self.model.predict(x, verbose=0)
            sample_token = self.sample_from(y[0][sample_index])
            tokens_generated.append(sample_token)
            start_tokens.append(sample_token)
            num_tokens_generated = len(tokens_generated)
        txt = " ".join([self.detokenize(_) for _ in self.start_tokens + tokens_generated])
        self.printed.append(f"generated text:\n{txt}\n")


def weights_apart(ours: keras.Model, theirs: keras.Model) -> float:
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True)
    )


def test_miniature_gpt_with_an_output_of_no_loss_trains_as_fit_does(tmp_path):
    """``outputs=[logits, x]``, ``loss=[loss_fn, None]``: the one label is the logits'
    target, as ``fit`` gives it; its TextGenerator callback predicts as written."""
    text_ds, vocab = gpt_pipeline()
    word_to_index = {word: index for index, word in enumerate(vocab)}
    start_tokens = [word_to_index.get(_, 1) for _ in "w1 w2 w3".split()]

    theirs = create_model(AdamOfDenseGradients())
    fit_generator = TextGenerator(3, start_tokens, vocab)
    history = theirs.fit(text_ds(BATCH), verbose=0, epochs=1, callbacks=[fit_generator])

    ours = create_model()
    generator = TextGenerator(3, start_tokens, vocab)
    estimator = Estimator(
        ours,
        str(tmp_path),
        global_batch_size=BATCH,
        steps_per_loop=STEPS,
        log_every_steps=STEPS,  # an epoch
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    estimator.train(lambda mode, params: text_ds(params.batch_size).repeat(), STEPS, [generator])
    assert weights_apart(ours, theirs) < 2e-5
    assert [len(p.split()) for p in generator.printed] == [2 + 3 + 4]
    assert len(generator.printed) == len(fit_generator.printed) == 1
    assert history.history["loss"][0] == pytest.approx(np.log(vocab_size), rel=0.1)


def test_miniature_gpt_evaluates_and_predicts_both_outputs(tmp_path):
    text_ds, _ = gpt_pipeline()
    model = create_model()
    estimator = Estimator(
        model, str(tmp_path), global_batch_size=BATCH, eval_batch_size=BATCH, progress=False
    )
    estimator.train(lambda mode, params: text_ds(params.batch_size).repeat(), 2)
    found = estimator.evaluate(lambda mode, params: text_ds(params.batch_size))
    expected = model.evaluate(text_ds(BATCH), verbose=0, return_dict=True)
    assert found["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    predicted = next(iter(estimator.predict(lambda mode, params: text_ds(params.batch_size))))
    logits, x = model.output_names  # Keras's names of the two outputs
    assert predicted[logits].shape == (maxlen, vocab_size)
    assert predicted[x].shape == (maxlen, embed_dim)


# ------------------------------------------------ text_classification_with_transformer


class ClassifierBlock(layers.Layer):
    """The example's TransformerBlock."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.0):  # published: 0.1
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


CLASSIFIER_VOCABULARY = 200  # published: 20000 words, 200 tokens, 32 wide
CLASSIFIER_LENGTH = 20


def text_classifier(optimizer="adam"):
    """The example's model and compile, small (and its dropout 0)."""
    keras.utils.set_random_seed(2)
    embed_dim, num_heads, ff_dim = 8, 2, 8
    inputs = layers.Input(shape=(CLASSIFIER_LENGTH,))
    embedding_layer = TokenAndPositionEmbedding(CLASSIFIER_LENGTH, CLASSIFIER_VOCABULARY, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = ClassifierBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.0)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.0)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def reviews(count, seed):
    """IMDB's shape after ``pad_sequences``: word ids, zeros before each review (Keras
    pads at the front), a label that some words tell."""
    rng = np.random.default_rng(seed)
    x = np.zeros((count, CLASSIFIER_LENGTH), "int32")
    y = rng.integers(0, 2, size=count)
    for row, label in zip(x, y, strict=True):
        length = rng.integers(5, CLASSIFIER_LENGTH + 1)
        words = rng.integers(10, CLASSIFIER_VOCABULARY, size=length)
        words[rng.random(length) < 0.3] = 2 + label  # the telling words
        row[-length:] = words
    return x, y


def test_text_classifier_trains_as_fit_with_adam_of_the_dense_gradient(tmp_path, caplog):
    """keras-io's text classifier (Adam, as written), 20 steps of 32: every weight as
    ``fit``'s under Adam of the dense gradient; the log names the tables whose update
    differs from ``fit``'s as it is (docs/guide/keras.md, note 7)."""
    x_train, y_train = reviews(640, seed=0)
    x_val, y_val = reviews(256, seed=1)
    theirs = text_classifier(AdamOfDenseGradients())
    theirs.fit(x_train, y_train, batch_size=32, epochs=1, shuffle=False, verbose=0)
    ours = text_classifier()

    def input_fn(mode, params):
        data = (x_train, y_train) if mode == Mode.TRAIN else (x_val, y_val)
        dataset = tf.data.Dataset.from_tensor_slices(data)
        return (dataset.repeat() if mode == Mode.TRAIN else dataset).batch(params.batch_size)

    estimator = Estimator(
        ours,
        str(tmp_path),
        global_batch_size=32,
        eval_batch_size=32,
        steps_per_loop=20,
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    with caplog.at_level("INFO"):
        estimator.train(input_fn, 20)
    assert weights_apart(ours, theirs) < 5e-5
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Embedding")]
    assert len(said) == 1
    assert said[0].startswith("Embedding tables ") and "take Adam's update" in said[0]
    assert "token_and_position_embedding" in said[0]
    expected = theirs.evaluate(x_val, y_val, batch_size=32, verbose=0, return_dict=True)
    found = estimator.evaluate(input_fn)
    assert found["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)


# ------------------------------------------------ neural_machine_translation_with_transformer


class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = None if mask is None else ops.cast(mask[:, None, :], dtype="int32")
        attention_output = self.attention(
            query=inputs, value=inputs, key=inputs, attention_mask=padding_mask
        )
        proj_input = self.layernorm_1(inputs + attention_output)
        proj_output = self.dense_proj(proj_input)
        return self.layernorm_2(proj_input + proj_output)


class PositionalEmbedding(layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = layers.Embedding(input_dim=sequence_length, output_dim=embed_dim)

    def call(self, inputs):
        length = ops.shape(inputs)[-1]
        positions = ops.arange(0, length, 1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        inputs, encoder_outputs = inputs
        causal_mask = self.get_causal_attention_mask(inputs)
        if mask is None:
            inputs_padding_mask, encoder_outputs_padding_mask = None, None
        else:
            inputs_padding_mask, encoder_outputs_padding_mask = mask
        attention_output_1 = self.attention_1(
            query=inputs,
            value=inputs,
            key=inputs,
            attention_mask=causal_mask,
            query_mask=inputs_padding_mask,
        )
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(
            query=out_1,
            value=encoder_outputs,
            key=encoder_outputs,
            query_mask=inputs_padding_mask,
            key_mask=encoder_outputs_padding_mask,
        )
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        proj_output = self.dense_proj(out_2)
        return self.layernorm_3(out_2 + proj_output)

    def get_causal_attention_mask(self, inputs):
        input_shape = ops.shape(inputs)
        batch_size, sequence_length = input_shape[0], input_shape[1]
        i = ops.arange(sequence_length)[:, None]
        j = ops.arange(sequence_length)
        mask = ops.cast(i >= j, dtype="int32")
        mask = ops.reshape(mask, (1, input_shape[1], input_shape[1]))
        return ops.tile(mask, [batch_size, 1, 1])  # as published: a symbolic multiple


class RMSpropOfDenseGradients(keras.optimizers.RMSprop):
    """Keras's RMSprop given an embedding's gradient as the dense tensor it stands for
    (as ``AdamOfDenseGradients``: the framework's update by design)."""

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(tf.convert_to_tensor(gradient), variable, learning_rate)


TRANSLATION_VOCABULARY, TRANSLATION_LENGTH = 40, 8  # published: 15000, 20


def transformer(optimizer="rmsprop"):
    """The example's model and compile (RMSprop, ``ignore_class=0``), small, dropout 0."""
    keras.utils.set_random_seed(3)
    vocab_size, sequence_length = TRANSLATION_VOCABULARY, TRANSLATION_LENGTH
    embed_dim, latent_dim, num_heads = 8, 16, 2  # published: 256, 2048, 8
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(encoder_inputs)
    encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(decoder_inputs)
    x = TransformerDecoder(embed_dim, latent_dim, num_heads)([x, encoder_outputs])
    x = layers.Dropout(0.0)(x)  # published: 0.5
    decoder_outputs = layers.Dense(vocab_size, activation="softmax")(x)
    model = keras.Model(
        {"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs},
        decoder_outputs,
        name="transformer",
    )
    model.compile(
        optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0),
        metrics=["accuracy"],
    )
    return model


def sentence_pairs(count):
    """What ``format_dataset`` makes of the pairs: word ids padded with 0 at the end,
    the Spanish side one longer, between its start (2) and end (3) ids."""
    rng = np.random.default_rng(4)
    eng = np.zeros((count, TRANSLATION_LENGTH), "int64")
    spa = np.zeros((count, TRANSLATION_LENGTH + 1), "int64")
    for e, s in zip(eng, spa, strict=True):
        words = rng.integers(4, TRANSLATION_VOCABULARY, size=rng.integers(2, TRANSLATION_LENGTH))
        e[: len(words)] = words
        s[: len(words) + 2] = [2, *((words * 7) % (TRANSLATION_VOCABULARY - 4) + 4), 3]
    return {"encoder_inputs": eng, "decoder_inputs": spa[:, :-1]}, spa[:, 1:]


def test_translation_transformer_leaves_the_padding_out_as_fit_does(tmp_path):
    """keras-io's translation Transformer: its loss leaves class 0 out and its outputs
    carry the decoder's mask; 3 steps of RMSprop from the same weights as ``fit``'s,
    under RMSprop of the dense gradient (the framework's update: note 7)."""
    inputs, targets = sentence_pairs(3 * 16)
    theirs = transformer(RMSpropOfDenseGradients())
    history = theirs.fit(inputs, targets, batch_size=16, shuffle=False, verbose=0)
    ours = transformer()
    estimator = Estimator(
        ours,
        str(tmp_path),
        global_batch_size=16,
        steps_per_loop=3,
        log_every_steps=3,
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    dataset = tf.data.Dataset.from_tensor_slices((inputs, targets)).repeat().batch(16)
    estimator.train(lambda mode, params: dataset, 3)
    assert weights_apart(ours, theirs) < 5e-5
    evaluated = estimator.evaluate(lambda mode, params: dataset.take(3))
    expected = theirs.evaluate(inputs, targets, batch_size=16, verbose=0, return_dict=True)
    # The token mean of the whole set (Keras's evaluate: the mean of its batches' means,
    # docs/guide/keras.md note 6); the mask keeps no position the loss leaves out.
    probabilities = theirs.predict(inputs, batch_size=16, verbose=0)
    whole = keras.losses.SparseCategoricalCrossentropy(ignore_class=0)(targets, probabilities)
    assert evaluated["loss"] == pytest.approx(float(whole), rel=1e-5)
    assert evaluated["loss"] != pytest.approx(expected["loss"], rel=1e-4)
    assert evaluated["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert history.history["loss"][0] == pytest.approx(np.log(TRANSLATION_VOCABULARY), rel=0.2)
