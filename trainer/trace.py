"""What one trace of the model found: what the steps of a mode compute and report.

``ModelState`` calls the model once on symbolic inputs in a mode (``_trace``) and hands
the steps this one frozen object, never its parts one by one: the Spec's metric and
scalar names, its streamed metric objects, how its loss is given (one per group, a
token mean), and in EVAL where a classifier's labels and scores are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainer.model_fn import Mode


@dataclasses.dataclass(frozen=True)
class Trace:
    """A trace of the model in ``mode``.

    Attributes:
      mode: the mode traced.
      metrics: the per-example metrics' names, in the Spec's order.
      streamed: the Keras metric objects it names (in TRAIN, the epochs' copies).
      scalars: the per-batch scalars' names (each group's loss among them).
      by_group: whether ``Spec.loss`` is a dict of one loss per group (in any trace).
      token_loss: its loss's kind of token mean (``trainer.tokens.kind``), or None.
      padded: the feature whose zeros pad, which a loss that counts no tokens reports.
      classifier: in EVAL, where a classifier's labels and scores are, or None.
    """

    mode: Mode
    metrics: tuple[str, ...] = ()
    streamed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scalars: tuple[str, ...] = ()
    by_group: bool = False
    token_loss: str | None = None
    padded: str | None = None
    classifier: Any = None

    def streamed_in(self, mode: Mode) -> Mapping[str, Any]:
        """The streamed metrics of ``mode``'s steps: another mode's are found in its trace."""
        return self.streamed if mode == self.mode else {}
