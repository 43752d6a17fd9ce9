"""How a pipeline makes its batches: the knobs read once, and what goes with what.

A pipeline reads four groups of gin knobs: ``pipeline`` (how a source is held and
read), ``lengths`` (grouping by length, buckets, a token budget), ``packing`` and
``mixing``. ``read`` reads them once into one frozen ``Batching``, checks each group,
and refuses the combinations no batch can serve, all of them in one table
(``REFUSED``), in one line.

Its ``kind`` is how a training batch is made (``KINDS``; each makes its training
stream by ``datasets.pipeline.STREAMS``):

* ``'padded'``: ``global_batch_size`` examples, each padded to the batch's longest
  (or to the smallest of ``lengths.buckets`` that holds it);
* ``'budgeted'``: as many examples as fit ``lengths.token_budget`` positions
  (``datasets/token_budget.py``);
* ``'packed'``: examples end to end in rows of ``packing.length`` positions
  (``datasets/packing.py``).

Grouping (``lengths.group_batches``) is an order over the padded and budgeted kinds,
and mixing (MixUp, CutMix) acts on padded batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from datasets import lengths, mixing, packing
from trainer import UserError

_BUDGET = (
    "lengths.token_budget sizes {name}'s batches by their examples' lengths and cannot be "
    "combined with {other}: unbind one of them"
)
_PACKED = (
    "packing.length lays examples of every length out in rows of {length}; it does not go "
    "with {other}: unbind one of them"
)

# The kinds of batch but the default, ``'padded'``, each with the knob that chooses it.
# A new kind is a row here and its stream in ``datasets.pipeline.STREAMS``.
KINDS = (("packed", "packing.length"), ("budgeted", "lengths.token_budget"))

# What no batch can serve: (a knob, what it does not go with, the line that says so).
REFUSED = (
    ("lengths.token_budget", "packing.length", _BUDGET),
    ("lengths.token_budget", "mixing", _BUDGET),
    ("packing.length", "lengths.group_batches", _PACKED),
    ("packing.length", "lengths.buckets", _PACKED),
    ("packing.length", "an augment function", _PACKED),
    ("packing.length", "mixing", _PACKED),
)


@dataclasses.dataclass(frozen=True)
class Batching:
    """Every knob a pipeline reads, read once (``read``)."""

    pipeline: Mapping
    lengths: lengths.Lengths = lengths.Lengths()
    packing: packing.Packing = packing.Packing()
    mixing: mixing.Mixing = dataclasses.field(default_factory=mixing.Mixing)

    @property
    def kind(self) -> str:
        """How a training batch is made: the first of ``KINDS`` whose knob is bound."""
        bound = self.bound(augmented=False)
        return next((kind for kind, knob in KINDS if bound[knob]), "padded")

    def bound(self, augmented: bool) -> dict[str, bool]:
        """Which of ``REFUSED``'s names are bound; ``augmented``: training augments."""
        return {
            "lengths.token_budget": bool(self.lengths.token_budget),
            "lengths.group_batches": bool(self.lengths.group_batches),
            "lengths.buckets": bool(self.lengths.buckets),
            "packing.length": self.packing.active,
            "mixing": self.mixing.active,
            "an augment function": augmented,
        }


def read(pipeline: Mapping, name: str, augmented: bool = False) -> Batching:
    """The knobs, each group checked, then refused in one line if no batch can serve them.

    ``pipeline``: the ``pipeline`` knobs (``datasets.pipeline.options()``); ``name``
    names the source in the line; ``augmented``: training augments its examples.
    """
    found = Batching(dict(pipeline), lengths.knobs(), packing.knobs(), mixing.options())
    bound = found.bound(augmented)
    for knob, other, line in REFUSED:
        if bound[knob] and bound[other]:
            raise UserError(line.format(name=name, other=other, length=found.packing.length))
    return found
