"""Prepared chats read back for supervised fine-tuning: a loss on the assistant's tokens.

``chat.input_fn`` gives a language model's examples of a split prepared by
``prepare --chat`` (``preparation``), one chat each:
``({'tokens'}, {'targets', 'mask'})``, the chat's tokens but the last, the same
shifted by one, and 1 where that next token is the assistant's. A model's loss
weighted by the mask (``LanguageModel`` reads it) is a mean over the assistant's
tokens of the whole batch, as ``trainer.token_mean`` makes any loss per token: exact
however a step is cut (micro-batches, towers, replicas, workers). Packed
(``packing.length``), each chat's mask is laid out with its tokens, so no answer's
mark reaches another chat of its row; batched by length (``lengths.buckets``,
``lengths.token_budget``) from the lengths prepare kept, never reading the records
to plan.

``length`` cuts each chat to its first ``length`` tokens. A chat whose answer would
then be cut off whole is refused before the first step, counted, with the first
one's row. PREDICT gives each chat's prompt, its tokens up to the first answer, for
a model to continue.

Chats prepared with a keras-hub model's tokenizer (``prepare --preset``) are for that
model, given as it is (a ``GPT2CausalLM`` without its preprocessor): each batch is
what Keras's ``fit`` takes, ``({'token_ids', 'padding_mask'}, targets, mask)``, the
mask its sample weights, so that a loss of ``reduction='mean_with_sample_weight'`` is
the mean over the assistant's tokens. Its backbone takes no segment ids, so they are
batched padded, never packed.
"""

from __future__ import annotations

import gin
import numpy as np
import tensorflow as tf

from datasets import packing, pipeline
from datasets.chat import preparation, scores
from datasets.records import shards
from datasets.text import input_fns as text
from trainer import InputParams, Mode, UserError, errors


def parse(record: tf.Tensor) -> dict:
    """One record's ``{'tokens', 'mask'}``, int64 ``[length]`` each."""
    parsed = tf.io.parse_single_example(
        record, {"tokens": tf.io.VarLenFeature(tf.int64), "mask": tf.io.VarLenFeature(tf.int64)}
    )
    return {k: tf.sparse.to_dense(v) for k, v in parsed.items()}


def next_of_chat(length: int | None):
    """A record to a language model's example, its first ``length`` positions (None: all)."""
    cut = slice(None, length)

    def example_of(record: tf.Tensor) -> dict:
        chat = parse(record)
        tokens, mask = chat["tokens"], chat["mask"]
        return {"tokens": tokens[:-1][cut], "targets": tokens[1:][cut], "mask": mask[1:][cut]}

    return example_of


def prompt_of(record: tf.Tensor) -> dict:
    """A record's prompt: its tokens before the first of the assistant's."""
    chat = parse(record)
    return {"tokens": chat["tokens"][: tf.argmax(chat["mask"])]}


def model_inputs(example: dict):
    """``({'tokens'}, {'targets', 'mask'})``; a prompt's ``({'tokens'}, {})``."""
    labels = {k: example[k] for k in ("targets", "mask") if k in example}
    return {"tokens": example["tokens"]}, labels


def backbone_inputs(example: dict):
    """``({'token_ids', 'padding_mask'}, {'targets', 'mask'})``: a keras-hub backbone's inputs.

    The padding mask is 1 at each of the chat's tokens, so that its padding in a batch
    reads 0 (id 0 is a token of the model's own).
    """
    features, labels = model_inputs(example)
    tokens = features["tokens"]
    return {"token_ids": tokens, "padding_mask": tf.ones_like(tokens)}, labels


def weighted(features: dict, labels: dict):
    """A batch as Keras's ``fit`` takes it, ``(x, y, sample_weight)``: the mask weighs."""
    return features, labels["targets"], labels["mask"]


def check_not_packed(data_dir: str) -> None:
    """Refuses packing for a keras-hub model's chats: its backbone takes no segment ids."""
    if packing.knobs().active:
        raise UserError(
            f"packing.length: {data_dir} holds chats for a keras-hub model, whose backbone "
            "takes no segment ids, so packed chats would attend to each other: unbind "
            "packing.length (lengths.buckets or lengths.token_budget batch them by length)"
        )


@gin.configurable("chat.input_fn")
def input_fn(
    mode: Mode,
    params: InputParams,
    data_dir: str = gin.REQUIRED,
    train_split: str = "train",
    eval_split: str | None = None,
    length: int | None = None,
) -> tf.data.Dataset:
    """Batches of prepared chats, each ``({'tokens'}, {'targets', 'mask'})``.

    Padded with 0 (to ``lengths.buckets``), or packed with ``packing.length``. TRAIN
    reads ``train_split`` by index forever, EVAL ``eval_split`` once, PREDICT its
    prompts once.

    Args:
      mode: the mode.
      params: the pipeline's batch and position.
      data_dir: a folder written by ``python3 -m datasets.prepare --chat``.
      train_split: the split trained on.
      eval_split: the split evaluated and prompted from (None: dataset.json's).
      length: each chat's first positions kept (None: all of each).
    """
    errors.check_count("chat.input_fn.length", length, optional=True)
    wanted = train_split if mode == Mode.TRAIN else eval_split
    metadata, paths = shards.check_shards(data_dir, wanted)
    preparation.check_prepared(metadata, data_dir)
    split = wanted or shards.eval_split(metadata)
    entry = metadata["splits"][split]
    kept = text.kept_lengths(data_dir, entry) - 1  # an example is its chat but the last token
    starts = preparation.answer_starts(data_dir, entry)
    for_keras = "preset" in metadata  # tokenized for a keras-hub model, given as it is
    if for_keras:
        check_not_packed(data_dir)
    inputs = backbone_inputs if for_keras else model_inputs
    if mode == Mode.PREDICT:
        source = text.split_examples(data_dir, metadata, paths, split, prompt_of, starts)
        return pipeline.build(source, mode, params, inputs, name=f"prompts-{split}")
    if length is not None:
        check_answers_kept(starts, length, f"{data_dir}'s {split} split")
        kept = np.minimum(kept, length)
    source = text.split_examples(data_dir, metadata, paths, split, next_of_chat(length), kept)
    batches = pipeline.build(source, mode, params, inputs, name=f"chats-{split}")
    return batches.map(weighted) if for_keras else batches


def check_answers_kept(starts: np.ndarray, length: int, where: str) -> None:
    """Refuses a ``length`` that cuts some chat's answer off whole, before training.

    A chat's first answer token at ``start`` is the target of position ``start - 1``,
    which the first ``length`` positions hold when ``start <= length``.
    """
    cut = np.flatnonzero(starts > length)
    if len(cut):
        first, enough = cut[0], starts[cut].max()
        raise UserError(
            f"chat.input_fn.length = {length} cuts off the whole answer of {len(cut):,} chats "
            f"of {where} (the first: chat {first + 1} of the split, its answer starts at token "
            f"{starts[first]:,}): raise the length to {enough:,}, or shorten their prompts"
        )


ANSWERS = ("chosen", "rejected")


def parse_pair(record: tf.Tensor) -> dict:
    """One pair's record: each answer's chat and mask, int64 ``[length]`` each."""
    names = [*ANSWERS, *(f"{a}_mask" for a in ANSWERS)]
    parsed = tf.io.parse_single_example(
        record, {name: tf.io.VarLenFeature(tf.int64) for name in names}
    )
    return {k: tf.sparse.to_dense(v) for k, v in parsed.items()}


def next_of_pair(record: tf.Tensor) -> dict:
    """A pair as a language model's two examples: each chat's tokens, targets and mask."""
    pair, found = parse_pair(record), {}
    for answer in ANSWERS:
        tokens = pair[answer]
        found |= {answer: tokens[:-1], f"{answer}_targets": tokens[1:]}
        found[f"{answer}_mask"] = pair[f"{answer}_mask"][1:]
    return found


def next_of_scored_pair(item: dict) -> dict:
    """A pair's examples (``next_of_pair``) and the reference model's scores of its answers."""
    reference = item["reference"]
    found = next_of_pair(item["record"])
    return found | {"reference_chosen": reference[0], "reference_rejected": reference[1]}


def pair_prompt_of(record: tf.Tensor) -> dict:
    """A pair's prompt: the chosen chat's tokens before its answer."""
    pair = parse_pair(record)
    return {"tokens": pair["chosen"][: tf.argmax(pair["chosen_mask"])]}


def pair_inputs(example: dict):
    """``({'chosen', 'rejected'}, {their targets and masks})``; a prompt's ``({'tokens'}, {})``."""
    if "tokens" in example:
        return {"tokens": example["tokens"]}, {}
    return {a: example[a] for a in ANSWERS}, {k: v for k, v in example.items() if k not in ANSWERS}


@gin.configurable("chat.pairs_input_fn")
def pairs_input_fn(
    mode: Mode,
    params: InputParams,
    data_dir: str = gin.REQUIRED,
    train_split: str = "train",
    eval_split: str | None = None,
    reference: str | None = None,
) -> tf.data.Dataset:
    """Batches of prepared preference pairs, for ``models.preference.PreferenceModel``.

    Each pair's two chats, padded apart (each to the batch's longest of its kind):
    ``({'chosen', 'rejected'}, {'chosen_targets', 'chosen_mask', 'rejected_targets',
    'rejected_mask'})``; batched by length from the longer chat of each pair. With a
    ``reference``, the labels hold its log-probabilities of the two answers too,
    ``reference_chosen`` and ``reference_rejected``, as DPO needs them: scored once
    and kept beside the pairs (``datasets.chat.scores``). PREDICT gives each pair's
    prompt, ``{'tokens'}``, for the model to continue.

    Args:
      mode: the mode.
      params: the pipeline's batch and position.
      data_dir: a folder written by ``python3 -m datasets.prepare --pairs``.
      train_split: the split trained on.
      eval_split: the split evaluated and prompted from (None: dataset.json's).
      reference: the reference model's model_dir, whose newest checkpoint scored the
        pairs (``python3 -m datasets.chat.reference``); None: no scores read.
    """
    wanted = train_split if mode == Mode.TRAIN else eval_split
    metadata, paths = shards.check_shards(data_dir, wanted)
    preparation.check_prepared(metadata, data_dir, "pairs")
    check_bytes(metadata, data_dir)
    split = wanted or shards.eval_split(metadata)
    if mode == Mode.PREDICT:  # a prompt's length is not kept
        source = text.split_examples(data_dir, metadata, paths, split, pair_prompt_of)
        return pipeline.build(source, mode, params, pair_inputs, name=f"prompts-{split}")
    kept = text.kept_lengths(data_dir, metadata["splits"][split]) - 1
    source = text.split_examples(data_dir, metadata, paths, split, next_of_pair, kept)
    if reference is not None:
        values = scores.read(data_dir, split, reference, metadata)
        scored = scores.Scored(source.records, values)
        source = pipeline.RecordExamples(scored, next_of_scored_pair, source.name, kept)
    return pipeline.build(source, mode, params, pair_inputs, name=f"pairs-{split}")


def scoring_input_fn(data_dir: str, split: str, order: np.ndarray):
    """An input_fn whose PREDICT gives each pair of ``split`` once, its rows in ``order``.

    Its targets and masks are among the features: what a reference model scores
    (``datasets.chat.reference``).
    """

    def input_fn(mode: Mode, params: InputParams) -> tf.data.Dataset:
        metadata, paths = shards.check_shards(data_dir, split)
        preparation.check_prepared(metadata, data_dir, "pairs")
        check_bytes(metadata, data_dir)
        source = text.split_examples(data_dir, metadata, paths, split, next_of_pair)
        records = scores.Rearranged(source.records, order)
        source = pipeline.RecordExamples(records, next_of_pair, source.name)
        return pipeline.build(source, mode, params, scored_inputs, name=f"scored-{split}")

    return input_fn


def check_bytes(metadata: dict, data_dir: str) -> None:
    """Refuses pairs tokenized for a keras-hub model: ``PreferenceModel`` reads bytes.

    Its models take id 0 for padding, which is a token of such a model's own (GPT-2's
    ``!``): they would read those tokens as padding.
    """
    if "preset" in metadata:
        raise UserError(
            f"{data_dir} holds pairs tokenized by {metadata['tokenizer']} for a keras-hub "
            "model (prepare --preset), and PreferenceModel reads bytes: prepare the pairs "
            "again without --preset"
        )


def scored_inputs(example: dict):
    """A pair to score: all of it features, no labels."""
    return example, {}


@gin.configurable("chat.vocab_size")
def vocab_size(data_dir: str | None = None) -> int:
    """The prepared chats' ids, padding and the end id included (an embedding's rows).

    ``LanguageModel.vocab_size = @chat.vocab_size()``; ``data_dir`` defaults to
    ``chat.input_fn.data_dir``'s binding.
    """
    data_dir = data_dir or gin.query_parameter("chat.input_fn.data_dir")
    return int(shards.read_metadata(data_dir)["vocab_size"])
