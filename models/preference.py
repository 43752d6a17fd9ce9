"""Preference tuning: a language model taught to prefer one answer of a pair to the other.

A pair is one prompt with a chosen and a rejected answer (``prepare --pairs``). Each
answer's log-probability under the model is the sum over its tokens (its mask) of
each token's log-probability given what precedes it (``answer_logps``). The losses
are per pair, so the framework's mean over examples makes them exact however a step
is cut:

* ``'dpo'`` (Rafailov et al., 2023, the sigmoid loss): with ``r = beta * (log pi(y) -
  log pi_ref(y))`` the implicit reward of an answer against the reference model's
  log-probability, ``-log sigmoid(r_chosen - r_rejected)``;
* ``'simpo'`` (Meng et al., 2024, reference-free): with ``r = beta * log pi(y) / |y|``,
  the mean log-probability of the answer's tokens, ``-log sigmoid(r_chosen -
  r_rejected - gamma)``.

Reported beside the loss, as users of TRL read them: ``rewards_chosen``,
``rewards_rejected``, ``reward_margin`` (their difference) and ``reward_accuracy``
(the share of pairs whose chosen answer has the higher reward); and with a
``judge``, its score of each pair's prompt continued by the model (``parse_share``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import gin
import tensorflow as tf
from absl import logging

from models.transformer.blocks import Transformer, checked_ids, positions_of, segments_of
from models.transformer.tasks import LanguageModel
from trainer import Mode, Spec, UserError, errors, warm_start

LOSSES = ("dpo", "simpo")


@tf.autograph.experimental.do_not_convert
def answer_logps(logits: tf.Tensor, targets: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """``[b]``: each row's summed log-probability of its ``targets`` where ``mask`` is 1.

    ``logits`` ``[b, n, vocab]``, ``targets`` and ``mask`` ``[b, n]``.
    """
    logps = -tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=tf.cast(logits, tf.float32)
    )
    return tf.reduce_sum(logps * tf.cast(mask, tf.float32), axis=1)


@tf.autograph.experimental.do_not_convert
def rewards(
    loss: str,
    logps: tuple[tf.Tensor, tf.Tensor],
    beta: float,
    references: tuple[tf.Tensor, tf.Tensor] | None = None,
    lengths: tuple[tf.Tensor, tf.Tensor] | None = None,
) -> tuple[tf.Tensor, tf.Tensor]:
    """``(chosen, rejected)`` rewards ``[b]`` of the answers' log-probabilities ``logps``.

    DPO's are against ``references`` (the reference model's log-probabilities);
    SimPO's are per token of the answers' ``lengths``.
    """
    if loss == "dpo":
        return tuple(beta * (p - r) for p, r in zip(logps, references, strict=True))
    return tuple(
        beta * p / tf.maximum(tf.cast(n, tf.float32), 1.0)
        for p, n in zip(logps, lengths, strict=True)
    )


@tf.autograph.experimental.do_not_convert
def pair_losses(chosen: tf.Tensor, rejected: tf.Tensor, gamma: float = 0.0) -> tf.Tensor:
    """``[b]``: ``-log sigmoid(chosen - rejected - gamma)`` of each pair's rewards."""
    return tf.nn.softplus(-(chosen - rejected - gamma))


@tf.autograph.experimental.do_not_convert
def reward_metrics(chosen: tf.Tensor, rejected: tf.Tensor) -> dict[str, tf.Tensor]:
    """Per-pair values the eval set's means are reported of."""
    return {
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "reward_margin": chosen - rejected,
        "reward_accuracy": tf.cast(chosen > rejected, tf.float32),
    }


@gin.configurable
class PreferenceModel(LanguageModel):
    """A ``LanguageModel`` tuned on preference pairs: DPO or SimPO.

    Its variables are the language model's, named as it names them, so it warm-starts
    from a language model's checkpoint as it is. A batch of pairs has features
    ``{'chosen', 'rejected'}`` (each chat's tokens but the last) and labels
    ``{'chosen_targets', 'chosen_mask', 'rejected_targets', 'rejected_mask'}``, and for
    DPO the reference model's log-probabilities of each answer, ``reference_chosen``
    and ``reference_rejected`` (``[b]``). Any other batch is the language model's.

    Args:
      vocab_size: as ``LanguageModel``'s.
      stack: as ``LanguageModel``'s.
      loss: ``'dpo'`` or ``'simpo'``.
      beta: the rewards' scale (DPO's 0.1; SimPO's 2 or so).
      gamma: SimPO's target margin between the rewards; 0 for DPO.
      reference: DPO's reference model held in memory: its model_dir (or checkpoint),
        a model of this one's ``stack``, scored on each batch as it trains, frozen and
        not checkpointed; None (the default): its log-probabilities are read from
        beside the pairs (``chat.pairs_input_fn.reference``), computed once, or, under
        ``models.lora.LoRA`` and with none beside the pairs, computed by LoRA's base
        (this model, its adapters off).
      **kwargs: the rest of ``LanguageModel``'s (generation, ``bytes``).
    """

    def __init__(
        self,
        vocab_size: int = gin.REQUIRED,
        stack: Transformer | None = None,
        loss: str = "dpo",
        beta: float = 0.1,
        gamma: float = 0.0,
        reference: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(vocab_size, stack, **kwargs)
        if loss not in LOSSES:
            raise UserError(
                f"PreferenceModel.loss = {loss!r}: the losses are {', '.join(map(repr, LOSSES))}"
            )
        errors.check_number("PreferenceModel.beta", beta, 0)
        if beta == 0:
            raise UserError(
                "PreferenceModel.beta = 0 makes every reward 0 and the loss a constant: give "
                "beta > 0 (DPO's 0.1)"
            )
        errors.check_number("PreferenceModel.gamma", gamma, 0)
        if loss == "dpo" and gamma:
            raise UserError(
                f"PreferenceModel.gamma = {gamma:g} is SimPO's margin; DPO has none: unbind it, "
                "or choose loss = 'simpo'"
            )
        if reference is not None and loss != "dpo":
            raise UserError(
                f"PreferenceModel.reference is DPO's reference model, and loss = {loss!r} "
                "needs none: unbind it, or choose loss = 'dpo'"
            )
        self.loss, self.beta, self.gamma, self.reference = loss, beta, gamma, reference
        self._held = None  # the reference held in memory, if it is
        self._base = None  # LoRA's adapters_off, when LoRA adapts this model
        if reference is not None:  # outside the tracked attributes: not trained, not saved
            stack = type(self.stack).from_config(self.stack.get_config())
            self._held = _Held(LanguageModel(vocab_size, stack))

    def variables_made(self) -> None:
        """With a reference held in memory: its variables made, loaded and frozen."""
        if self._held is None or self._held.loaded:
            return
        model = self._held.model
        tokens = tf.ones([1, 1], tf.int32)
        model.logits(tokens, segments_of({}, tokens), positions_of({}, tokens))
        warm_start.load_frozen(
            model,
            self.reference,
            "PreferenceModel.reference",
            "a model of this one's stack",
            "give the model_dir of the model DPO starts from",
        )
        self._held.loaded = True

    def offer_base(self, adapters_off: Callable[[], contextlib.AbstractContextManager]) -> None:
        """DPO's reference when no other is given: this model inside ``adapters_off()``.

        ``models.lora.LoRA`` offers it: its base, the same weights with the adapters off.
        """
        self._base = adapters_off

    def __call__(self, features, labels, mode):
        """A pair's loss and rewards; a language model's Spec for any other batch."""
        if not isinstance(features, dict) or "chosen" not in features:
            return super().__call__(features, labels, mode)
        answers = ("chosen", "rejected")
        scored = features if labels is None else labels  # PREDICT: pairs scored whole
        logps = tuple(self.answer_logps(features, scored, name, mode) for name in answers)
        if labels is None:
            return Spec(dict(zip(("chosen_logps", "rejected_logps"), logps, strict=True)))
        if self.loss == "dpo":
            references = self._references(features, labels)
            found = rewards("dpo", logps, self.beta, references=references)
        else:
            lengths = tuple(
                tf.reduce_sum(tf.cast(labels[f"{n}_mask"], tf.float32), 1) for n in answers
            )
            found = rewards("simpo", logps, self.beta, lengths=lengths)
        losses = pair_losses(*found, self.gamma)
        predictions = dict(zip(("chosen_logps", "rejected_logps"), logps, strict=True))
        metrics = reward_metrics(*found)
        if mode == Mode.EVAL and self.judge is not None:  # each pair's prompt, continued
            chosen = checked_ids(features["chosen"])
            segments = segments_of({}, chosen)
            metrics[self.judge.name] = self._judged(chosen, segments, labels["chosen_mask"])
        return Spec(predictions, loss=tf.reduce_mean(losses), metrics=metrics)

    def _references(self, features: dict, labels: dict) -> tuple[tf.Tensor, tf.Tensor]:
        """DPO's reference log-probabilities of the pairs' answers, ``[b]`` each.

        Read from the labels, or computed by the reference held in memory.
        """
        answers = ("chosen", "rejected")
        stored = {"reference_chosen", "reference_rejected"} & set(labels)
        if self._held is not None and stored:
            raise UserError(
                "DPO's reference log-probabilities are given twice: read from beside the "
                "pairs (chat.pairs_input_fn.reference) and computed by the reference held "
                "in memory (PreferenceModel.reference): unbind one"
            )
        if self._held is not None:
            return tuple(
                tf.stop_gradient(logps_of(self._held.model, features, labels, n, False))
                for n in answers
            )
        if not stored and self._base is not None:  # LoRA's base: its adapters off
            logging.log_first_n(  # once a process: a step is traced more than once
                logging.INFO, "DPO's reference is LoRA's base: the model with its adapters off", 1
            )
            with self._base():
                return tuple(
                    tf.stop_gradient(logps_of(self, features, labels, n, False)) for n in answers
                )
        if len(stored) < 2:
            raise UserError(
                "PreferenceModel.loss = 'dpo' scores each answer against the reference "
                "model's log-probabilities, and the batch has none (labels "
                "'reference_chosen' and 'reference_rejected'): set "
                "chat.pairs_input_fn.reference to the reference model's model_dir and "
                "score the pairs with it (python3 -m datasets.chat.reference), or hold the "
                "reference in memory (PreferenceModel.reference), or choose loss = "
                "'simpo', which needs no reference"
            )
        return tuple(tf.cast(labels[f"reference_{n}"], tf.float32) for n in answers)

    def answer_logps(self, features: dict, scored: dict, name: str, mode: Mode) -> tf.Tensor:
        """``[b]``: each pair's answer ``name``, its summed log-probability under the model.

        ``scored`` holds its targets and mask: the labels, or in PREDICT the features
        (``chat.scoring_input_fn``, what ``datasets.chat.reference`` scores).
        """
        return logps_of(self, features, scored, name, training=mode == Mode.TRAIN)


class _Held:
    """A reference model, out of reach of the framework's tracking (``PreferenceModel``)."""

    def __init__(self, model: LanguageModel):
        self.model, self.loaded = model, False


def logps_of(model: LanguageModel, features: dict, scored: dict, name: str, training: bool):
    """``[b]``: answer ``name`` of each pair, its summed log-probability under ``model``."""
    tokens = checked_ids(features[name])
    segments, positions = segments_of({}, tokens), positions_of({}, tokens)
    logits = model.logits(tokens, segments, positions, training=training)
    return answer_logps(logits, scored[f"{name}_targets"], scored[f"{name}_mask"])
