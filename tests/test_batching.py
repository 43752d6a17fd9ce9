"""``datasets/batching.py``: the knobs read once, and one table of what goes with what."""

import gin
import pytest

from datasets import batching, pipeline
from tests.support.ragged import COUNT, long_tailed, source
from trainer import InputParams, Mode, UserError

BOUND = {  # a binding of each name in batching.REFUSED (the augment function is given)
    "lengths.token_budget": ("lengths.token_budget", 256),
    "lengths.group_batches": ("lengths.group_batches", 2),
    "lengths.buckets": ("lengths.buckets", [8, 16, 32, 64, 128, 512]),
    "packing.length": ("packing.length", 512),
    "mixing": ("mixing.mixup_alpha", 0.2),
}


@pytest.mark.parametrize("knob, other, line", batching.REFUSED, ids=lambda v: str(v)[:24])
def test_each_combination_no_batch_serves_is_refused_in_the_tables_line(knob, other, line):
    gin.bind_parameter("mixing.num_classes", 3)
    for name in (knob, other):
        if name in BOUND:
            gin.bind_parameter(*BOUND[name])
    augment = (lambda features, labels, seed: (features, labels)) if "augment" in other else None
    expected = line.format(name="text", other=other, length=512)
    with pytest.raises(UserError) as refused:
        pipeline.build(
            source(long_tailed(COUNT)),
            Mode.TRAIN,
            InputParams(16, 16, seed=0),
            lambda e: ({"tokens": e["tokens"]}, {}),
            augment=augment,
            name="text",
        )
    assert str(refused.value) == expected


def test_the_kind_of_batch_follows_the_knobs():
    options = pipeline.options()
    assert batching.read(options, "text").kind == "padded"
    gin.bind_parameter("lengths.token_budget", 256)
    assert batching.read(options, "text").kind == "budgeted"
    gin.clear_config()
    gin.bind_parameter("packing.length", 64)
    made = batching.read(options, "text")
    assert made.kind == "packed" and made.packing.length == 64


def test_each_kind_of_batch_has_its_training_stream_and_its_knob_is_read():
    kinds = {"padded", *(kind for kind, _ in batching.KINDS)}
    assert set(pipeline.STREAMS) == kinds == {"padded", "budgeted", "packed"}
    bound = batching.read(pipeline.options(), "text").bound(augmented=False)
    assert {knob for _, knob in batching.KINDS} <= set(bound)
