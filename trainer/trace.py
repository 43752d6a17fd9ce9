"""What one trace of the model found: what the steps of a mode compute and report.

``ModelState`` calls the model once on symbolic inputs in a mode (``_trace``) and hands
the steps this one frozen object, never its parts one by one: the Spec's metric and
scalar names, its streamed metric objects, how its loss is given (one per group) and
counted (``trainer.accounting``: per example, per token), and in EVAL where a
classifier's labels and scores are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from trainer import tokens
from trainer.accounting import Examples, Tokens
from trainer.model_fn import Mode

# How a Spec's loss of each type is counted: ``made(loss, padded)``. A new kind is a row.
KINDS: dict[type, Callable[[Any, str | None], Examples]] = {
    tokens.TokenMean: Tokens.of,
}


def accounting_of(loss, features_spec) -> Examples:
    """How the steps count a Spec's ``loss`` (``KINDS``), on features of ``features_spec``."""
    padded = tokens.padded_ids(features_spec)
    for kind, made in KINDS.items():
        if isinstance(loss, kind):
            return made(loss, padded)
    return Examples(padded)


@dataclasses.dataclass(frozen=True)
class Trace:
    """A trace of the model in ``mode``.

    Attributes:
      mode: the mode traced.
      metrics: the per-example metrics' names, in the Spec's order.
      streamed: the Keras metric objects it names (in TRAIN, the epochs' copies).
      scalars: the per-batch scalars' names (each group's loss among them).
      by_group: whether ``Spec.loss`` is a dict of one loss per group (in any trace).
      accounting: how its loss is counted (``accounting_of``): per example, per token.
      classifier: in EVAL, where a classifier's labels and scores are, or None.
    """

    mode: Mode
    metrics: tuple[str, ...] = ()
    streamed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scalars: tuple[str, ...] = ()
    by_group: bool = False
    accounting: Examples = Examples()
    classifier: Any = None

    def streamed_in(self, mode: Mode) -> Mapping[str, Any]:
        """The streamed metrics of ``mode``'s steps: another mode's are found in its trace."""
        return self.streamed if mode == self.mode else {}
