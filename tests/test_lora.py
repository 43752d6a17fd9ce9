"""LoRA on a model of models/ (models/lora.py): a small LanguageModel trained on chats
for two steps is the base; rank-2 adapters on its projections fine-tune it. Only the
adapters move and only they are checkpointed; a resume equals a straight run; an
export merges them and answers as the unmerged model does; bad settings are refused."""

import functools
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from datasets.chat import input_fns
from models.lora import LoRA
from tests.support import chats
from trainer import Mode, warm_start
from trainer.settings import Checkpoints

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@functools.cache
def base() -> str:
    """The base run (made once a process): chats.trained's LanguageModel, 2 steps."""
    model_dir = os.path.join(chats.prepared(), os.pardir, "base")
    chats.trained(model_dir, 2, packed=False)
    return model_dir


def lora_estimator(model_dir: str, **lora) -> trainer.Estimator:
    model = LoRA(chats.language_model(), base(), rank=lora.pop("rank", 2), **lora)
    return trainer.Estimator(
        model,
        model_dir,
        optimizer=keras.optimizers.Adam(0.01),
        global_batch_size=16,
        seed=0,
        steps_per_loop=2,
        checkpoints=Checkpoints(every_steps=2),
        progress=False,
    )


def input_fn(mode, params):
    return input_fns.input_fn(mode, params, data_dir=chats.prepared())


def saved_shapes(model_dir: str) -> list[tuple]:
    """The shapes of what the newest checkpoint holds (its scalars left out)."""
    latest = trainer.checkpoints.latest_checkpoint(model_dir)
    return sorted(tuple(shape) for _, shape in tf.train.list_variables(latest) if shape)


def test_only_the_adapters_train_and_only_they_are_checkpointed(tmp_path, caplog):
    estimator = lora_estimator(str(tmp_path / "lora"))
    model = estimator.model_fn
    with caplog.at_level("INFO"):
        estimator.train(input_fn, 4)
    # Six projections of one block (query, key, value, out, mlp_in, mlp_out), A and B each.
    trainable = model.trainable_variables
    assert (
        sorted(v.path.split("/")[-1] for v in trainable)
        == ["lora_kernel_a"] * 6 + ["lora_kernel_b"] * 6
    )
    assert all(v.dtype == "float32" for v in trainable)
    assert sorted(model._layers) == [
        f"stack/block_0/{name}"
        for name in ("attention/key", "attention/out", "attention/query", "attention/value")
        + ("mlp_in", "mlp_out")
    ]
    assert all(np.abs(layer.lora_kernel_b.numpy()).max() > 0 for layer in model._layers.values())
    # The base is as its checkpoint holds it.
    source = warm_start.Source(base())
    for name in ("stack/block_0/attention/query/_kernel", "embedding/_embeddings"):
        variable = functools.reduce(getattr, name.split("/"), model.adapted)
        np.testing.assert_array_equal(variable.numpy(), source.read(name))
    # The run's checkpoint: the adapters and Adam's two slots of each (and scalars).
    adapters = [tuple(v.shape) for v in trainable]
    assert saved_shapes(str(tmp_path / "lora")) == sorted(adapters * 3)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA:")]
    assert len(said) == 1 and "on 6 layers, 576 parameters" in said[0], said


def test_a_resumed_lora_run_equals_a_straight_one(tmp_path):
    straight = lora_estimator(str(tmp_path / "straight"))
    straight.train(input_fn, 4)
    lora_estimator(str(tmp_path / "resumed")).train(input_fn, 2)
    resumed = lora_estimator(str(tmp_path / "resumed"))  # a new process's objects
    resumed.train(input_fn, 4)
    assert resumed.step == 4
    for a, b in zip(
        straight.model_fn.trainable_variables, resumed.model_fn.trainable_variables, strict=True
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    # A new process's evaluation: the base read again, the adapters restored.
    evaluated = lora_estimator(str(tmp_path / "resumed")).evaluate(input_fn)
    assert evaluated == straight.evaluate(input_fn)


def test_the_merged_export_answers_as_the_unmerged_model(tmp_path):
    estimator = lora_estimator(str(tmp_path / "lora"))
    estimator.train(input_fn, 2)
    model = estimator.model_fn
    query = model._layers["stack/block_0/attention/query"]
    kernel = query._kernel.numpy()
    features, _ = next(
        iter(input_fns.input_fn(Mode.EVAL, trainer.InputParams(4, 4), chats.prepared()))
    )
    tokens = {"tokens": features["tokens"]}
    unmerged = model(tokens, None, Mode.PREDICT).predictions["logits"].numpy()
    exported = estimator.export(input_fn, str(tmp_path / "export"))
    # In memory after the export: the kernels as they were, the adapters on.
    np.testing.assert_array_equal(query._kernel.numpy(), kernel)
    assert query.lora_enabled
    served = trainer.load_export(exported).signatures["serving_default"](**tokens)["logits"]
    np.testing.assert_allclose(served.numpy(), unmerged, rtol=0, atol=2e-5)
    # The export's kernel is the merged one: W + alpha / rank * A B.
    reader = tf.train.load_checkpoint(os.path.join(exported, "variables", "variables"))
    delta = query.lora_kernel_a.numpy() @ query.lora_kernel_b.numpy()
    shapes = reader.get_variable_to_shape_map()
    merged = [reader.get_tensor(n) for n, shape in shapes.items() if shape == list(kernel.shape)]
    assert any(np.allclose(m, kernel + delta, atol=1e-6) for m in merged)
    assert not any(np.array_equal(m, kernel) for m in merged)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"rank": 0}, "LoRA.rank must be a whole number >= 1, got 0"),
        ({"rank": -4}, "LoRA.rank must be a whole number >= 1, got -4"),
        (
            {"layers": ["attention/query$", "attention/gate$"]},
            "LoRA.layers pattern 'attention/gate$' matches none of the model's 6 Dense layers; "
            "their names are like stack/block_0/attention/value",
        ),
        ({"layers": "mlp_in$"}, "LoRA.layers must be a list of regular expressions"),
    ],
)
def test_a_lora_that_cannot_be_is_refused_in_one_line(tmp_path, settings, said):
    with pytest.raises(trainer.UserError, match=None) as error:
        lora_estimator(str(tmp_path / "lora"), **settings).train(input_fn, 2)
    assert str(error.value).startswith(said), str(error.value)
    assert not os.path.exists(tmp_path / "lora" / "checkpoint")


def test_warm_start_beside_lora_is_one_line(tmp_path):
    """WarmStart.source with LoRA (stdlib_sft.gin's, included and not unbound) would look
    for the base's weights under LoRA's names: refused, naming LoRA.base."""
    model = LoRA(chats.language_model(), base(), rank=2)
    with pytest.raises(trainer.UserError) as error:
        trainer.Estimator(
            model, str(tmp_path), warm_start=trainer.WarmStart("output/stdlib_lm"), progress=False
        )
    assert str(error.value) == (
        "WarmStart.source = 'output/stdlib_lm' with LoRA, whose weights LoRA.base loads: "
        "unbind WarmStart.source (give LoRA.base the weights to start from)"
    )


def test_a_base_that_is_not_the_whole_model_is_refused(tmp_path):
    lora_estimator(str(tmp_path / "lora")).train(input_fn, 2)
    model = LoRA(chats.language_model(), str(tmp_path / "lora"), rank=2)  # a LoRA run's adapters
    estimator = trainer.Estimator(model, str(tmp_path / "again"), progress=False)
    with pytest.raises(trainer.UserError) as error:
        estimator.train(input_fn, 2)
    assert f"LoRA.base {tmp_path / 'lora'} is not the whole model LoRA adapts" in str(error.value)


def test_under_mixed_bfloat16_the_adapters_are_float32(tmp_path):
    trainer.set_precision("mixed_bfloat16")
    try:
        model = LoRA(chats.language_model(), base(), rank=2)
    finally:
        trainer.set_precision(None)
    estimator = trainer.Estimator(
        model,
        str(tmp_path / "lora"),
        optimizer=keras.optimizers.Adam(0.01),
        global_batch_size=16,
        devices=trainer.Devices(mixed_precision="mixed_bfloat16"),
        progress=False,
    )
    estimator.train(input_fn, 2)
    query = model._layers["stack/block_0/attention/query"]
    assert query.compute_dtype == "bfloat16"
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    assert np.abs(query.lora_kernel_b.numpy()).max() > 0
    assert np.isfinite(estimator.evaluate(input_fn)["loss"])


def test_a_preference_model_tunes_through_adapters(tmp_path):
    """LoRA over a PreferenceModel (SimPO on pairs), from a LanguageModel's checkpoint:
    its variables are named as the language model's, so the base loads as it is."""
    model = LoRA(chats.preference_model("simpo"), chats.untrained_base(), rank=2)
    estimator = trainer.Estimator(
        model, str(tmp_path / "lora"), global_batch_size=16, progress=False
    )
    estimator.train(functools.partial(input_fns.pairs_input_fn, data_dir=chats.prepared_pairs()), 2)
    assert len(model.trainable_variables) == 12
    assert all(np.abs(layer.lora_kernel_b.numpy()).max() > 0 for layer in model._layers.values())


def test_dpo_through_adapters_scores_against_the_base_as_a_held_copy_of_it_would(tmp_path):
    """LoRA over DPO given no reference: the reference is the base itself, the adapters
    off (no second copy of the model); three steps train what they train against a
    copy of the same base held in memory."""
    pairs = functools.partial(input_fns.pairs_input_fn, data_dir=chats.prepared_pairs())
    found = {}
    for name, held in (("base", None), ("held", chats.untrained_base())):
        model = LoRA(chats.preference_model("dpo", held), chats.untrained_base(), rank=2)
        estimator = trainer.Estimator(
            model,
            str(tmp_path / name),
            optimizer=keras.optimizers.SGD(0.5),
            global_batch_size=16,
            seed=0,
            progress=False,
        )
        estimator.train(pairs, 3)
        found[name] = [v.numpy() for v in model.trainable_variables]
    assert len(found["base"]) == len(found["held"]) == 12  # the adapters alone
    for ours, held in zip(found["base"], found["held"], strict=True):
        np.testing.assert_allclose(ours, held, rtol=0, atol=1e-6)
    assert max(np.abs(w).max() for w in found["base"][1::2]) > 1e-3  # B moved from zero
