"""Chats for tests of supervised fine-tuning: varied, multi-turn, prepared once a process.

``rows(count)`` are chats of one or two exchanges, some with a system turn, their
answers of 1 to 40 characters (non-ASCII among them), so that a batch's chats differ
in length and in their share of assistant tokens. ``prepared(count)`` writes them as
JSON lines and prepares them (``prepare --chat``, ChatML) into a folder kept for the
process, and removed when it ends.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile

import numpy as np

from datasets.chat import preparation

# HuggingFaceH4/zephyr-7b-beta's template as it ships (tokenizer_config.json): no span.
ZEPHYR = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n"
    "{% endif %}\n"
    "{% endfor %}"
)
# ... and with the assistant's answer and end marked, as a trainer patches it (the
# newline after the block tag doubled: Jinja's trim_blocks drops the first).
ZEPHYR_MARKED = ZEPHYR.replace(
    "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}",
    "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] + eos_token }}"
    "{% endgeneration %}\n",
)

WORDS = ["add", "two", "numbers", "sort", "a", "list", "«é»", "parse", "this", "line"]


def rows(count: int, seed: int = 0) -> list[dict]:
    """``count`` rows of ``{'messages': [...]}``."""
    rng = np.random.default_rng(seed)

    def said(most: int) -> str:
        return " ".join(rng.choice(WORDS, rng.integers(1, most + 1)))[:40]

    found = []
    for i in range(count):
        turns = [{"role": "system", "content": said(3)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            turns += [
                {"role": "user", "content": said(6)},
                {"role": "assistant", "content": said(8)},
            ]
        found.append({"messages": turns})
    return found


def write(path: str, chats: list[dict]) -> str:
    """``chats`` as a JSON lines file at ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in chats)
    return path


@functools.cache
def prepared(count: int = 64, eval_fraction: float = 0.25) -> str:
    """A folder of ``count`` prepared chats (ChatML), made once a process."""
    root = tempfile.mkdtemp(prefix="chats-")
    atexit.register(shutil.rmtree, root, True)  # the process leaves nothing behind
    source = write(os.path.join(root, "chats.jsonl"), rows(count))
    out = os.path.join(root, "prepared")
    preparation.prepare(source, out, eval_fraction=eval_fraction, num_shards=2)
    return out


PACKED_LENGTH = 320  # positions of a packed row: the longest of ``prepared()`` is 297


def trained(model_dir: str, steps: int, packed: bool = True, init: int = 3, **settings) -> dict:
    """A small ``LanguageModel``'s weights after ``steps`` steps of SGD on ``prepared()``'s
    chats, its loss over their assistant tokens; packed or padded, under Estimator
    ``settings`` (as ``parity.grouped`` takes them), with gin's bindings as they are.
    ``init`` seeds its first weights (a run resumed from ``model_dir`` restores them)."""
    import gin

    from datasets.chat import input_fns

    data_dir = prepared()
    if packed:
        gin.bind_parameter("packing.length", PACKED_LENGTH)
    try:
        model = language_model(init)
        input_fn = functools.partial(input_fns.input_fn, data_dir=data_dir)
        weights = _trained(model, model_dir, steps, input_fn, settings)
    finally:
        gin.clear_config()
    return weights


def pair_rows(count: int, seed: int = 0) -> list[dict]:
    """``count`` preference pairs: each chat's first answer chosen, cut in half rejected."""
    found = []
    for chat in rows(count, seed):
        turns = [t for t in chat["messages"] if t["role"] != "system"]
        answer = turns[1]["content"]
        rejected = answer[: len(answer) // 2] or "?"
        found.append({"prompt": turns[0]["content"], "chosen": answer, "rejected": rejected})
    return found


@functools.cache
def prepared_pairs(count: int = 64) -> str:
    """A folder of ``count`` prepared pairs (ChatML), made once a process."""
    from datasets.chat import pairs

    root = tempfile.mkdtemp(prefix="pairs-")
    atexit.register(shutil.rmtree, root, True)
    source = os.path.join(root, "pairs.jsonl")
    with open(source, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in pair_rows(count))
    out = os.path.join(root, "prepared")
    pairs.prepare(source, out, eval_fraction=0.25, num_shards=2)
    return out


def pair_records(data_dir: str, split: str) -> list[dict]:
    """A prepared split's pairs as written: each answer's ids and mask, numpy."""
    import tensorflow as tf

    from datasets.records import shards

    _, paths = shards.check_shards(data_dir, split)
    spec = {k: tf.io.VarLenFeature(tf.int64) for k in ("chosen", "rejected")}
    spec |= {f"{k}_mask": tf.io.VarLenFeature(tf.int64) for k in ("chosen", "rejected")}
    return [
        {k: tf.sparse.to_dense(v).numpy() for k, v in tf.io.parse_single_example(r, spec).items()}
        for r in tf.data.TFRecordDataset(paths)
    ]


def pair_batch(records: list[dict]):
    """Pairs as a padded batch: each chat's tokens but the last, targets and mask."""
    import tensorflow as tf

    features, labels = {}, {}

    def padded(rows):
        width = max(len(r) for r in rows)
        return tf.constant([np.pad(r, (0, width - len(r))) for r in rows], tf.int64)

    for name in ("chosen", "rejected"):
        features[name] = padded([r[name][:-1] for r in records])
        labels[f"{name}_targets"] = padded([r[name][1:] for r in records])
        labels[f"{name}_mask"] = padded([r[f"{name}_mask"][1:] for r in records])
    return features, labels


def language_model(init: int = 3):
    """``trained``'s small ``LanguageModel``, its first weights seeded by ``init``."""
    import keras

    from models.transformer import LanguageModel, Transformer

    keras.utils.set_random_seed(init)
    return LanguageModel(vocab_size=258, stack=Transformer(width=16, depth=1, heads=2))


@functools.cache
def untrained_base() -> str:
    """``language_model()``'s first weights in a checkpoint, made once a process (the
    same in any process: no training, no device): LoRA's base, DPO's reference."""
    import tensorflow as tf

    from trainer import Mode

    root = tempfile.mkdtemp(prefix="untrained-")
    atexit.register(shutil.rmtree, root, True)
    model = language_model()
    model({"tokens": tf.ones([1, 4], tf.int32)}, None, Mode.PREDICT)
    return tf.train.Checkpoint(model=model).write(os.path.join(root, "ckpt"))


def lora_tuned(model_dir: str, steps: int, **settings) -> dict:
    """Rank-2 adapters on ``untrained_base()``'s projections after ``steps`` steps
    of SGD on ``prepared()``'s chats, padded; under Estimator ``settings``."""
    from datasets.chat import input_fns
    from models.lora import LoRA

    tuned = LoRA(language_model(), untrained_base(), rank=2)
    input_fn = functools.partial(input_fns.input_fn, data_dir=prepared())
    return _trained(tuned, model_dir, steps, input_fn, settings)


def preference_model(loss: str = "simpo", held: str | None = None):
    """A small ``PreferenceModel``, its first weights seeded: SimPO (beta 2, gamma 0.5) or
    DPO (beta 0.5), its reference held in memory from ``held`` if given."""
    import keras

    from models.preference import PreferenceModel
    from models.transformer import Transformer

    keras.utils.set_random_seed(3)
    stack = Transformer(width=16, depth=1, heads=2)
    settings = {"beta": 2.0, "gamma": 0.5} if loss == "simpo" else {"beta": 0.5}
    if held is not None:
        settings["reference"] = held
    return PreferenceModel(vocab_size=258, stack=stack, loss=loss, **settings)


def tuned(
    model_dir: str,
    steps: int,
    loss: str = "simpo",
    data_dir: str | None = None,
    reference: str | None = None,
    held: str | None = None,
    **settings,
) -> dict:
    """A small ``PreferenceModel``'s weights after ``steps`` steps of SGD on ``data_dir``'s
    pairs (``prepared_pairs()``): SimPO, or DPO against the scores of ``reference`` kept
    beside them, or of ``held``, held in memory; under Estimator ``settings`` (as
    ``parity.grouped`` takes them)."""
    from datasets.chat import input_fns

    data_dir = data_dir or prepared_pairs()
    input_fn = functools.partial(input_fns.pairs_input_fn, data_dir=data_dir, reference=reference)
    return _trained(preference_model(loss, held), model_dir, steps, input_fn, settings)


@functools.cache
def scored_pairs() -> dict:
    """For DPO, made once a process: a reference model (SimPO, 2 steps, on one device)
    and a copy of ``prepared_pairs()`` it scored. ``{'reference', 'data_dir',
    'weights', 'values'}``: its model_dir, the pairs, its weights and the scores."""
    root = tempfile.mkdtemp(prefix="scored-")
    atexit.register(shutil.rmtree, root, True)
    made = scored_at(root)
    weights = tuned(made["reference"], 2, num_devices=1)  # the same in any process
    shutil.copytree(prepared_pairs(), made["data_dir"])
    values = scored(made["data_dir"], made["reference"])
    return made | {"weights": weights, "values": values}


def scored_at(root: str) -> dict:
    """Where ``scored_pairs()`` keeps its reference and pairs under its folder ``root``:
    ``{'reference', 'data_dir'}``, as another process (a worker) finds them."""
    return {"reference": os.path.join(root, "reference"), "data_dir": os.path.join(root, "pairs")}


def scored(data_dir: str, reference: str) -> dict:
    """The reference pass: ``reference``'s newest checkpoint scores ``data_dir``'s pairs,
    kept beside them; each split's scores."""
    import trainer
    from datasets.chat import reference as reference_pass

    estimator = trainer.Estimator(
        preference_model("dpo"), reference, global_batch_size=16, progress=False
    )
    return reference_pass.score(estimator, data_dir, reference)


def _trained(model, model_dir: str, steps: int, input_fn, settings: dict) -> dict:
    """``model``'s trainable weights after ``steps`` steps of SGD (0.5) on ``input_fn``,
    global batch 16, under Estimator ``settings`` (as ``parity.grouped`` takes them)."""
    import keras

    import trainer
    from tests.support import parity
    from trainer.settings import Checkpoints

    estimator = trainer.Estimator(
        model,
        model_dir,
        optimizer=keras.optimizers.SGD(0.5),
        global_batch_size=16,
        seed=0,
        steps_per_loop=steps,
        log_every_steps=steps,
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
        **parity.grouped(settings),
    )
    estimator.train(input_fn, steps)
    return {f"w{i}": variable.numpy() for i, variable in enumerate(model.trainable_variables)}
