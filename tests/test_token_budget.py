"""Token-budget batches (``datasets/token_budget.py``): each training batch as many
examples as fit ``lengths.token_budget`` padded positions. Still read by index: each
example once an epoch, a resume at any batch's position is the same stream, and the
Estimator's count of where the stream stands is the pipeline's own."""

import json

import gin
import keras
import numpy as np
import pytest

import trainer
from datasets import pipeline
from tests.support import packed, parity
from tests.support.ragged import COUNT, examples_of, long_tailed, source
from trainer import InputParams, Mode, UserError, checkpoints
from trainer.model_fn import batch_sizes
from trainer.settings import Checkpoints, Devices

MOST, BUDGET, BUCKETS = 16, 128, (8, 16, 32, 64)


def budgeted(sizes, start=0, count=40, replicas=1, pipelines=(0, 1), group=0, **knobs):
    """The first ``count`` elements this pipeline yields, and the dataset's ``after``."""
    gin.bind_parameter("lengths.token_budget", knobs.get("budget", BUDGET))
    gin.bind_parameter("lengths.buckets", knobs.get("buckets", BUCKETS))
    gin.bind_parameter("lengths.group_batches", group)
    params = InputParams(
        MOST // replicas,
        MOST,
        seed=5,
        start_example=start,
        input_pipeline_id=pipelines[0],
        num_input_pipelines=pipelines[1],
    )
    dataset = pipeline.build(
        source(sizes), Mode.TRAIN, params, lambda e: ({"tokens": e["tokens"]}, {}), name="text"
    )
    batches = [f["tokens"] for f, _ in dataset.take(count).as_numpy_iterator()]
    return batches, batch_sizes(dataset)


@pytest.mark.parametrize("group", [0, 4], ids=["random order", "grouped"])
def test_each_batch_fits_the_budget_one_size_a_bucket_each_example_once_an_epoch(group):
    sizes = long_tailed(COUNT)
    batches, after = budgeted(sizes, count=150, group=group)
    shapes = {b.shape for b in batches}
    assert all(n * length <= BUDGET for n, length in shapes)
    assert all(n == min(MOST, BUDGET // length) for n, length in shapes)  # one a bucket
    assert len(shapes) > 1  # short batches hold more examples than long ones
    read = [e for b in batches for e in examples_of(b, sizes)]
    assert len(read) > COUNT and sorted(read[:COUNT]) == list(range(COUNT))  # epoch 1: once each
    ends = np.cumsum([len(b) for b in batches])
    assert [after(0, k) for k in (1, 7, 150)] == [ends[0], ends[6], ends[149]]


def test_a_resume_at_any_batch_and_on_two_replicas_reads_the_same_stream():
    sizes = long_tailed(COUNT)
    whole, after = budgeted(sizes, count=30, group=4)
    resumed, _ = budgeted(sizes, start=after(0, 11), count=19, group=4)
    assert all((a == b).all() for a, b in zip(resumed, whole[11:], strict=True))
    shares = [budgeted(sizes, count=60, replicas=2, group=4, pipelines=(i, 2))[0] for i in (0, 1)]
    for step, batch in enumerate(whole):  # each pipeline one replica's share, in order
        first, second = shares[0][step], shares[1][step]
        assert abs(len(first) - len(second)) <= 1
        assert first.shape[1] == second.shape[1] == batch.shape[1]
        np.testing.assert_array_equal(np.concatenate([first, second]), batch)


@pytest.mark.parametrize(
    "knobs, message",
    [
        (
            {"budget": 32},
            r"^lengths.token_budget 32 cannot hold one example of text's longest \(60, padded "
            r"to 64\): raise it to at least 64$",
        ),
        (
            {"budget": 100, "replicas": 2},
            r"^lengths.token_budget 100 holds 1 of text's longest examples \(padded to 64\), "
            r"fewer than the 2 replicas a batch feeds: raise it to at least 128$",
        ),
        (
            {"budget": -1},
            r"^lengths.token_budget must be a whole number of positions >= 0, got -1$",
        ),
    ],
)
def test_a_budget_too_small_or_not_a_count_is_one_line(knobs, message):
    with pytest.raises(UserError, match=message):
        budgeted(long_tailed(COUNT), count=1, **knobs)


@pytest.mark.slow
def test_training_resumes_at_the_exact_batch_and_keeps_where_the_stream_stands(tmp_path):
    """12 steps straight equal 5, then a new Estimator's 7, bit for bit; the checkpoint
    keeps the position the pipeline's own batches reach (not 12 x 16), and examples/s
    counts those examples."""
    packed.bind_budget()
    straight = packed.trained(tmp_path / "straight", 12, packed=False)
    packed.bind_budget()
    packed.trained(tmp_path / "resumed", 5, packed=False)
    packed.bind_budget()
    resumed = packed.trained(tmp_path / "resumed", 12, packed=False)
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    packed.bind_budget()
    dataset = packed.input_fn()(Mode.TRAIN, InputParams(packed.GLOBAL, packed.GLOBAL, seed=0))
    sizes = [len(f["tokens"]) for f, _ in dataset.take(12).as_numpy_iterator()]
    assert len(set(sizes)) > 1 and max(sizes) <= packed.GLOBAL
    gin.clear_config()
    for run in ("straight", "resumed"):
        latest = checkpoints.latest_checkpoint(str(tmp_path / run))
        assert checkpoints.saved_ints(latest, input_position=0)["input_position"] == sum(sizes)
    # examples/s counts the examples the steps read, over the same seconds as steps/s.
    lines = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    (logged,) = [json.loads(line) for line in lines if json.loads(line)["writer"] == "train"]
    rate = logged["examples_per_sec"] / logged["steps_per_sec"]
    assert rate == pytest.approx(sum(sizes) / 12, rel=1e-6)


@pytest.mark.slow
def test_under_jit_compile_a_budget_compiles_at_most_once_per_bucket(tmp_path):
    packed.bind_budget()
    model = parity.tokens()
    estimator = trainer.Estimator(
        packed.TokensOf(model),
        str(tmp_path),
        optimizer=keras.optimizers.SGD(0.5),
        global_batch_size=packed.GLOBAL,
        seed=0,
        steps_per_loop=10,
        devices=Devices(jit_compile=True),
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    estimator.train(packed.input_fn(), 30)
    assert 2 <= estimator.model.steps.blocks.compiled_shapes <= 5
    packed.bind_budget()
    eager = packed.trained(tmp_path / "without XLA", 30, packed=False)
    for a, b in zip(eager, [w.numpy() for w in model.weights], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("binding", ["packing.length", "mixing.mixup_alpha"])
def test_a_budget_with_what_fixes_a_batch_otherwise_is_one_line(binding):
    gin.bind_parameter("lengths.token_budget", 256)
    gin.bind_parameter(binding, 64 if binding == "packing.length" else 0.2)
    gin.bind_parameter("mixing.num_classes", 3)
    what = "packing.length" if binding == "packing.length" else "mixing"
    with pytest.raises(UserError, match=rf"^lengths.token_budget sizes text's batches .* {what}:"):
        pipeline.build(
            source(long_tailed(COUNT)),
            Mode.TRAIN,
            InputParams(MOST, MOST, seed=0),
            lambda e: ({"tokens": e["tokens"]}, {}),
            name="text",
        )
