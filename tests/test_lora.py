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
from models.transformer import LanguageModel, Transformer
from tests.support import chats
from trainer import warm_start
from trainer.settings import Checkpoints

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@functools.cache
def base() -> str:
    """The base run (made once a process): chats.trained's LanguageModel, 2 steps."""
    model_dir = os.path.join(chats.prepared(), os.pardir, "base")
    chats.trained(model_dir, 2, packed=False)
    return model_dir


def language_model() -> LanguageModel:
    return LanguageModel(vocab_size=258, stack=Transformer(width=16, depth=1, heads=2))


def lora_estimator(model_dir: str, **lora) -> trainer.Estimator:
    keras.utils.set_random_seed(5)  # the adapters' A
    model = LoRA(language_model(), base(), rank=lora.pop("rank", 2), **lora)
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
