"""LoRA: a model fine-tuned through low-rank adapters on its projections, its base frozen.

``LoRA(model, base)`` wraps a model of ``models/`` on Transformer blocks (a
``LanguageModel``, a ``PreferenceModel``). Once its variables exist, every one of them
is loaded from ``base`` (the checkpoint of the model it fine-tunes) and frozen, and
each Dense layer whose name matches one of ``layers`` (by default the attention's
query, key, value and output projections and the MLP's two) learns ``W + alpha / rank
* A B`` through Keras's own adapters (``keras.layers.Dense.enable_lora``: ``A`` and
``B`` float32 under any precision policy, ``B`` zero at first, so that the model starts
as its base).

Only the adapters train, and only they are in the run's checkpoints (with their
optimizer's slots and the model's random state): the base is read from ``base`` again
at every start, so that a resume, an evaluation and a prediction see one model. An
export merges them into the kernels for its time (``merged``): its outputs are the
unmerged model's, without the adapters' matmuls.

Over a DPO ``PreferenceModel`` given no other reference (no scores beside the pairs,
none held in memory), the reference is the base itself: the same weights with the
adapters off (``adapters_off``), as TRL does for a PEFT model: a second forward pass
a step, and no second copy of the model.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import zlib
from collections.abc import Mapping, Sequence

import gin
import keras
import numpy as np
import tensorflow as tf
from absl import logging

from models.preference import PreferenceModel
from trainer import ModelFn, UserError, errors, internals, warm_start

# The Transformer blocks' projections (models/transformer/blocks.py), by Keras path.
PROJECTIONS = (r"(attention|cross)/(query|key|value|out)$", r"mlp_(in|out)$")


@gin.configurable
class LoRA(ModelFn):
    """``model`` fine-tuned from ``base`` through rank-``rank`` adapters on ``layers``.

    Args:
      model: the model of ``models/`` to fine-tune (its input and output unchanged).
      base: the checkpoint (or model_dir: its newest) of ``model`` trained: every
        variable of ``model`` is loaded from it.
      rank: the adapters' rank (a whole number >= 1).
      alpha: their scale is ``alpha / rank``; None: ``rank`` (a scale of 1).
      layers: regular expressions (``re.search``) on the names of ``model``'s Dense
        layers (``stack/block_0/attention/query``, ``stack/block_0/mlp_in``): those
        adapted; each must match one.
      base_map: ``{pattern: replacement}`` from ``model``'s variable names to
        ``base``'s, as ``WarmStart.map`` (a ``PreferenceModel`` from a
        ``LanguageModel``'s run).
      seed: with each layer's name, seeds its ``A`` (He-uniform, as Keras's): the
        same first adapters in any process, on any devices.
    """

    weights_from = "LoRA.base"  # WarmStart.source beside it is refused

    def __init__(
        self,
        model: ModelFn = gin.REQUIRED,
        base: str = gin.REQUIRED,
        rank: int = 8,
        alpha: float | None = None,
        layers: Sequence[str] = PROJECTIONS,
        base_map: Mapping[str, str] | None = None,
        seed: int = 0,
    ):
        super().__init__(name="lora")
        errors.check_count("LoRA.rank", rank)
        errors.check_count("LoRA.seed", seed, minimum=0)
        if alpha is not None:
            errors.check_number("LoRA.alpha", alpha, 0)
        if isinstance(layers, str) or not layers:
            fix = f"write [{layers!r}]" if layers else "give one at least"
            raise UserError(
                f"LoRA.layers must be a list of regular expressions, got {layers!r}: {fix}"
            )
        for pattern in layers:
            try:
                re.compile(pattern)
            except re.error as error:
                raise UserError(
                    f"LoRA.layers pattern {pattern!r} is not a regular expression: {error}"
                ) from None
        self.adapted, self.base, self.rank = model, base, rank
        self.alpha = float(rank if alpha is None else alpha)
        self.patterns, self.base_map, self.seed = tuple(layers), dict(base_map or {}), seed
        self.takes_sample_weights = model.takes_sample_weights
        self.input_map = model.input_map
        self._frozen: list = []  # the base's variables, once loaded
        self._layers: dict[str, keras.layers.Dense] = {}  # the adapted layers, once made
        if isinstance(model, PreferenceModel):  # DPO may score against the base
            model.offer_base(self.adapters_off)

    def __str__(self) -> str:
        return f"LoRA({self.adapted})"

    def __call__(self, features, labels, mode):
        """The adapted model's Spec."""
        return self.adapted(features, labels, mode)

    def variables_made(self) -> None:
        """Loads and freezes the base, then adds the adapters (once)."""
        if self._layers:
            return
        self.adapted.variables_made()  # its own first (a PreferenceModel's reference)
        layers = adapted_layers(self.adapted, self.patterns)
        frozen = warm_start.load_frozen(
            self.adapted,
            self.base,
            "LoRA.base",
            "the whole model LoRA adapts",
            "give the checkpoint of that model trained whole (not a LoRA run's), or map "
            "names with LoRA.base_map",
            self.base_map,
        )
        for name, layer in layers.items():
            first = keras.initializers.HeUniform(seed=layer_seed(self.seed, name))
            layer.enable_lora(self.rank, lora_alpha=self.alpha, a_initializer=first)
        self._frozen, self._layers = frozen, layers
        logging.info("%s", sizes(list(layers.values()), frozen, self.rank))

    def checkpointed(self) -> dict:
        """The adapters by layer path, and the state that is not the base's."""
        adapters = {}
        for name, layer in self._layers.items():
            key = name.replace("/", ".")
            adapters[f"{key}.a"], adapters[f"{key}.b"] = layer.lora_kernel_a, layer.lora_kernel_b
        base = {id(v) for v in self._frozen}
        return dict(
            model=adapters, rng=[v for v in self.non_trainable_variables if id(v) not in base]
        )

    @contextlib.contextmanager
    def merged(self):
        """Each adapted kernel ``W + alpha / rank * A B`` while inside, without adapters."""
        layers = list(self._layers.values())
        kept = [internals.stored_kernel(layer).numpy() for layer in layers]
        try:
            for layer in layers:
                internals.stored_kernel(layer).assign(merged_kernel(layer))
            with self.adapters_off():
                yield self
        finally:
            for layer, kernel in zip(layers, kept, strict=True):
                internals.stored_kernel(layer).assign(kernel)

    @contextlib.contextmanager
    def adapters_off(self):
        """The base alone while inside: what is called (or traced) computes without adapters."""
        layers = list(self._layers.values())
        try:
            for layer in layers:
                layer.lora_enabled = False
            yield self
        finally:
            for layer in layers:
                layer.lora_enabled = True


def layer_seed(seed: int, name: str) -> int:
    """The seed of layer ``name``'s first ``A``: ``seed`` and a hash of the name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**31


def merged_kernel(layer: keras.layers.Dense) -> tf.Tensor:
    """``W + alpha / rank * A B`` in float32 (Keras's own sum in the adapted layer's call)."""
    delta = tf.matmul(layer.lora_kernel_a.value, layer.lora_kernel_b.value)
    return internals.stored_kernel(layer).value + (layer.lora_alpha / layer.lora_rank) * delta


def adapted_layers(model: ModelFn, patterns: Sequence[str]) -> dict[str, keras.layers.Dense]:
    """The Dense layers of ``model`` whose names match one of ``patterns``, by name.

    A layer's name is its path of attributes from the model down
    (``stack/block_0/attention/query``), the same in every process, as checkpoints
    name what they hold (Keras paths are numbered by the layers a process made).

    Raises:
      UserError: a pattern that matches none of them.
    """
    dense = {}
    for layer in model.layers:
        for inner in internals.sublayers(layer):
            if isinstance(inner, keras.layers.Dense):
                dense[id(internals.stored_kernel(inner))] = inner
    kernels = list(map(internals.stored_kernel, dense.values()))
    names = warm_start.object_names(model, kernels)
    named = {names[id(k)].rsplit("/", 1)[0]: dense[id(k)] for k in kernels}
    for pattern in patterns:
        if not any(re.search(pattern, name) for name in named):
            raise UserError(matches_no_layer(pattern, list(named)))
    return {
        name: layer for name, layer in named.items() if any(re.search(p, name) for p in patterns)
    }


def matches_no_layer(pattern: str, paths: list[str]) -> str:
    """Says that ``pattern`` matches no Dense layer, naming the closest paths."""
    if not paths:
        return f"LoRA.layers pattern {pattern!r}: the model has no Dense layer to adapt"
    close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.3) or paths[:3]
    return (
        f"LoRA.layers pattern {pattern!r} matches none of the model's {len(paths)} Dense "
        f"layers; their names are like {', '.join(close)} (matched with re.search)"
    )


def sizes(layers: list, frozen: list, rank: int) -> str:
    """One line: the adapters' parameters and bytes against the frozen base's."""
    adapters = [w for layer in layers for w in (layer.lora_kernel_a, layer.lora_kernel_b)]
    count = sum(int(np.prod(w.shape)) for w in adapters)
    base = sum(int(np.prod(v.shape)) for v in frozen)
    return (
        f"LoRA: rank-{rank} adapters on {len(layers)} layers, {count:,} parameters "
        f"({count / max(base, 1):.2%} of the base's {base:,}, which is frozen); a checkpoint "
        f"holds their {4 * count / 1e6:.3g} MB of float32 (and the optimizer's slots), "
        "not the base"
    )
