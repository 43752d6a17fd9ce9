"""The models' and input_fns' own bindings, checked by type and range where they are bound.

Each row makes what a gin file would bind, and expects the one line the command line
prints: a value that means nothing (``beam = 0``, ``temperature < 0``, ``lora_rank = 0``)
is refused rather than taken as something else, and a value that would fail far from
the gin file (``generate = -1`` at predict, ``max_length = -1`` at evaluation) fails
where it is bound. Then what can only be seen in the data: a negative token id, a
sequence longer than the positions learned, a ViT patch that does not divide the
image; and generation given an empty prompt, no prompts, and prompts in any batch.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from datasets import lengths, stdlib
from datasets.text import windows
from models import encoder_decoder, hub, seq2seq, transformer
from tests.support import guides
from trainer import InputParams, Mode, UserError, errors

TINY = dict(width=16, depth=1, heads=2)

ROWS = {
    "bool_quoted": (
        lambda: transformer.LanguageModel(257, bytes="False"),
        r"LanguageModel\.bytes must be True or False, got 'False' \(in gin, write False "
        r"without quotes\)",
    ),
    "beam_zero": (
        lambda: transformer.LanguageModel(257, beam=0),
        r"LanguageModel\.beam must be a whole number >= 1, got 0",
    ),
    "temperature_negative": (
        lambda: transformer.LanguageModel(257, temperature=-0.5),
        r"LanguageModel\.temperature must be a number >= 0, got -0\.5",
    ),
    "beam_and_temperature": (
        lambda: transformer.LanguageModel(257, beam=4, temperature=0.7),
        r"LanguageModel\.beam = 4 searches and temperature = 0\.7 samples: choose one "
        r"\(beam = 1 to sample, temperature = 0 to search\)",
    ),
    "generate_negative": (
        lambda: transformer.LanguageModel(257, generate=-1),
        r"LanguageModel\.generate must be a whole number >= 0, got -1",
    ),
    "generate_past_learned_positions": (
        lambda: transformer.LanguageModel(
            257, generate=64, stack=transformer.Transformer(positions="learned", max_length=32)
        ),
        r"LanguageModel\.generate = 64 new tokens do not fit the Transformer\.max_length = 32 "
        r"positions it learns \(the prompt's too\): raise max_length, or generate fewer",
    ),
    "width_not_split_into_heads": (
        lambda: transformer.Transformer(width=30, heads=4),
        r"Transformer\.width = 30 does not split into 4 heads: make width a multiple of heads",
    ),
    "dropout_one": (
        lambda: transformer.Transformer(dropout=1.0),
        r"Transformer\.dropout must be a number >= 0 and < 1, got 1\.0",
    ),
    "seq2seq_beam_quoted": (
        lambda: seq2seq.Seq2Seq(20, beam="4"),
        r"Seq2Seq\.beam must be a whole number >= 1, got '4' \(in gin, write 4 without quotes\)",
    ),
    "seq2seq_beam_zero": (
        lambda: seq2seq.Seq2Seq(20, beam=0),
        r"Seq2Seq\.beam must be a whole number >= 1, got 0",
    ),
    "seq2seq_max_length_negative": (
        lambda: seq2seq.Seq2Seq(20, max_length=-1),
        r"Seq2Seq\.max_length must be a whole number >= 1, got -1",
    ),
    "encoder_decoder_alpha_negative": (
        lambda: encoder_decoder.EncoderDecoder(20, alpha=-1.0),
        r"EncoderDecoder\.alpha must be a number >= 0, got -1\.0",
    ),
    "lora_rank_zero": (
        lambda: hub.hub_task("CausalLM", "preset", lora_rank=0),
        r"hub_task\.lora_rank must be a whole number >= 1 or None, got 0",
    ),
    "lora_rank_negative": (
        lambda: hub.hub_task("CausalLM", "preset", lora_rank=-2),
        r"hub_task\.lora_rank must be a whole number >= 1 or None, got -2",
    ),
    "sequence_length_zero": (
        lambda: hub.hub_task("TextClassifier", "preset", sequence_length=0),
        r"hub_task\.sequence_length must be a whole number >= 1 or None, got 0",
    ),
    "geometric_ratio_one": (
        lambda: lengths.geometric(ratio=1),
        r"lengths\.geometric\.ratio must be a number > 1 \(each length that times the last\), "
        r"got 1",
    ),
    "geometric_multiple_zero": (
        lambda: lengths.geometric(multiple=0),
        r"lengths\.geometric\.multiple must be a whole number >= 1, got 0",
    ),
    "window_length_zero": (
        lambda: stdlib.input_fn(Mode.TRAIN, InputParams(4, 4), length=0),
        r"stdlib\.input_fn\.length must be a whole number >= 1, got 0",
    ),
    "prepared_window_length_zero": (
        lambda: windows.windows_input_fn(Mode.TRAIN, InputParams(4, 4), "data", length=0),
        r"text\.windows_input_fn\.length must be a whole number >= 1, got 0",
    ),
    "no_prompts": (
        lambda: stdlib.input_fn(Mode.PREDICT, InputParams(4, 4), prompts=()),
        r"stdlib\.input_fn\.prompts must be a list of strings to continue, got \(\): write "
        r"\['def main\('\]",
    ),
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_binding_that_means_nothing_is_one_line_where_it_is_bound(row):
    make, expected = ROWS[row]
    with pytest.raises(UserError) as raised:
        make()
    # The command line prints the first line (gin adds the configurable it called below).
    assert re.fullmatch(expected, errors.first_line(raised.value)), str(raised.value)


def _assert_failed(call, expected: str):
    """``call()`` fails at run time with the check's message (as errors.op_error_text says it)."""
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        call()
    assert expected in raised.value.message, raised.value.message


def test_what_only_the_data_shows_is_said_at_the_first_batch():
    model = transformer.LanguageModel(257, stack=transformer.Transformer(**TINY))
    negative = {"tokens": tf.constant([[5, 6, -3]], tf.int64)}
    _assert_failed(
        lambda: model(negative, None, Mode.EVAL),
        "token ids must be >= 0 (0 pads); a negative one would look up the embedding's last "
        "rows: fix the input_fn's ids; the smallest",
    )
    learned = transformer.Transformer(**TINY, positions="learned", max_length=8)
    short = transformer.TextClassifier(257, stack=learned)
    _assert_failed(
        lambda: short({"tokens": tf.ones([1, 12], tf.int64)}, None, Mode.PREDICT),
        "a sequence is longer than Transformer.max_length = 8, the positions it learns: "
        "raise max_length to the longest (and what generation adds), or cut the examples shorter",
    )
    vit = transformer.ViT(patch=3, stack=transformer.Transformer(**TINY, positions="learned"))
    with pytest.raises(UserError, match=r"^ViT\.patch = 3 does not divide the 8x8 images, so "):
        vit({"image": tf.zeros([1, 8, 8, 1])}, None, Mode.PREDICT)


def _generated(model, prompts: list[list[int]]) -> list[bytes]:
    """The text ``model`` continues each prompt with, in one batch padded to its longest."""
    tokens = tf.ragged.constant(prompts, tf.int64, ragged_rank=1).to_tensor()
    return list(model({"tokens": tokens}, None, Mode.PREDICT).predictions["text"].numpy())


@pytest.mark.slow
def test_a_sampled_continuation_is_the_prompts_own_in_any_batch():
    """One seed: a prompt's sampled text is the same alone, in batches of 3 and 8, in
    another order, and beside an empty prompt; an empty batch gives no rows."""
    model = transformer.LanguageModel(
        257,
        stack=transformer.Transformer(**TINY),
        generate=12,
        temperature=1.0,
        seed=3,
        bytes=True,
    )
    prompts = [[b + 1 for b in p.encode()] for p in ("def ", "import os", "x", "class A:", "#")]
    prompts += [[b + 1 for b in p.encode()] for p in ("for i in", "while", "return 1")]
    alone = [_generated(model, [p])[0] for p in prompts]
    assert len(set(alone)) > 1  # sampled, not one text
    assert _generated(model, prompts[:3]) == alone[:3]
    assert _generated(model, prompts) == alone
    order = [7, 2, 5, 0, 1, 6, 3, 4]
    assert _generated(model, [prompts[i] for i in order]) == [alone[i] for i in order]
    with_empty = _generated(model, [prompts[0], [], prompts[1]])
    assert with_empty[0] == alone[0] and with_empty[2] == alone[1] and len(with_empty[1]) > 0
    none = model({"tokens": tf.zeros([0, 4], tf.int64)}, None, Mode.PREDICT)
    assert none.predictions["generated"].shape == (0, 12)
    np.testing.assert_array_equal(_generated(model, [[]]), _generated(model, [[]]))


@pytest.mark.slow
def test_a_generating_export_takes_an_empty_prompt_and_an_empty_batch(tmp_path):
    """The exported language model continues an empty string beside others, and answers
    a batch of no strings with no rows; the last bytes of a long prompt are kept."""
    import trainer

    model = transformer.LanguageModel(
        stdlib.VOCAB_SIZE, stack=transformer.Transformer(**TINY), generate=4, bytes=True
    )
    estimator = trainer.Estimator(model, str(tmp_path / "run"), global_batch_size=4, progress=False)

    def input_fn(mode, params):
        return stdlib.input_fn(mode, params, length=32)

    estimator.train(input_fn, 1)
    serve = tf.saved_model.load(estimator.export(input_fn)).signatures["serving_default"]
    served = serve(text=tf.constant(["def f(", "", "import os"]))
    assert served["generated"].shape == (3, 4) and served["text"].shape == (3,)
    alone = serve(text=tf.constant(["def f("]))
    np.testing.assert_array_equal(alone["generated"][0], served["generated"][0])
    nothing = serve(text=tf.zeros([0], tf.string))
    assert nothing["generated"].shape == (0, 4)
    long = "x = 1\n" * 1000 + "def f("  # kept: its last 32 bytes, the window's length
    np.testing.assert_array_equal(
        serve(text=tf.constant([long]))["generated"],
        serve(text=tf.constant([long[-32:]]))["generated"],
    )


def test_the_guides_table_and_the_rows_agree():
    section = guides.text().split("\n## A setting's values, checked where it is bound\n", 1)[1]
    rows = re.findall(
        r"^\|.*\| ((?:`\w+`(?:, )?)+|\(in the data\)) \|$", section.split("\n## ")[0], re.M
    )
    assert sorted(re.findall(r"`(\w+)`", "\n".join(rows))) == sorted(ROWS)
