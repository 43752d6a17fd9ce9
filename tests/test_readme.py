"""README's and the guides' examples are run, not imagined: quoted files match, snippets
execute, tables are the code's."""

import os

import pytest

from tests.support import guides
from tests.support.commands import REPO


def test_setup_commands_come_first_and_ci_runs_the_test_command():
    first = guides.code_blocks("sh")[0].splitlines()
    assert first == [
        "python3 -m pip install -e . && python3 -m trainer --gin_file experiments/digits_mlp.gin",
        'python3 -m pip install -e ".[test]" && python3 -m pytest -q -n 2',
    ]
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert "README.md" in f.read()


def test_user_module_and_experiment_are_quoted_verbatim():
    quoted = [("polyfit.py", "python"), ("polyfit.gin", "gin")]
    for name, lang in [*quoted, ("parity.py", "python"), ("parity.gin", "gin")]:
        with open(os.path.join(REPO, "tests", "user_project", name)) as f:
            assert f.read() in guides.code_blocks(lang), f"the guides' copy of {name} is stale"


def test_python_api_snippet_runs(tmp_path, monkeypatch):
    python = guides.code_blocks("python")
    snippet = next(b for b in python if "trainer.Estimator(\n    PolynomialFit" in b)
    monkeypatch.syspath_prepend(os.path.join(REPO, "tests", "user_project"))
    import keras
    import polyfit

    import trainer

    namespace = dict(vars(polyfit), keras=keras, trainer=trainer)
    exec(snippet.replace('"/tmp/poly"', repr(str(tmp_path))), namespace)
    estimator = namespace["est"]
    assert estimator.step == 500
    kernel = estimator.model_fn.dense.kernel.numpy()[:, 0]
    assert abs(kernel[1] - 5) < 0.3 and abs(estimator.model_fn.dense.bias.numpy()[0] - 3) < 0.2


@pytest.mark.slow
def test_keras_snippet_trains_the_model_it_compiled(tmp_path, monkeypatch):
    """README's 'Your Keras model', run as written from a working directory."""
    snippet = next(
        b for b in guides.code_blocks("python") if "keras.Sequential(" in b and "tags" not in b
    )
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(snippet, namespace)
    assert namespace["est"].step == 600
    metrics = namespace["est"].evaluate(namespace["digits"].input_fn)
    assert metrics["accuracy"] >= 0.95
    import keras
    import numpy as np

    images = np.random.default_rng(0).uniform(size=(16, 8, 8, 1)).astype("float32")
    loaded = keras.models.load_model(tmp_path / "output" / "my_keras.keras")
    np.testing.assert_allclose(loaded.predict(images, verbose=0), namespace["model"](images))


def test_every_experiment_has_a_header_with_its_command():
    folder = os.path.join(REPO, "experiments")
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            text = f.read()
        assert text.startswith("#"), name
        assert f"--gin_file experiments/{name}" in text and "Expected" in text, name


def test_data_table_says_what_the_offline_input_fns_yield(data_dir):
    """README's data table (and the docstrings it copies) against the real batches."""
    import numpy as np
    import tensorflow as tf

    from datasets import diabetes, digits
    from trainer import InputParams, Mode

    rows = {r.split("|")[1].strip(" `"): r for r in guides.lines() if r.startswith("| `")}
    params = InputParams(batch_size=512, global_batch_size=512, seed=0)
    cases = [
        (lambda m, p: digits.input_fn(m, p, data_dir=data_dir), "digits", ("image", "label")),
        (diabetes.input_fn, "diabetes", ("x", "y")),
    ]
    for input_fn, name, (feature, label) in cases:
        row = rows[f"{name}.input_fn"]
        ranges = {}
        for mode in (Mode.TRAIN, Mode.EVAL):
            features, labels = next(iter(input_fn(mode, params)))
            assert list(features) == [feature] and list(labels) == [label]
            x, y = features[feature], labels[label]
            shape = ", ".join(["batch", *map(str, x.shape[1:])])
            assert f"'{feature}'`: {x.dtype.name} `[{shape}]`" in row
            assert f"'{label}'`: {y.dtype.name} `[batch]`" in row
            ranges[mode] = (float(tf.reduce_min(x)), float(tf.reduce_max(x)), y.numpy())
        if name == "digits":
            assert "float32 ``[batch, 8, 8, 1]``" in digits.input_fn.__doc__
            assert all(lo >= 0 and hi <= 1 for lo, hi, _ in ranges.values())
            labels = np.concatenate([r[2] for r in ranges.values()])
            assert set(labels) == set(range(10)) and "0..9" in row
        else:
            assert "float32 ``[batch, 10]``" in diabetes.input_fn.__doc__
            y_all = np.concatenate([diabetes.arrays(s)[1] for s in ("train", "test")])
            assert f"{y_all.min():.0f}..{y_all.max():.0f}" in row


def test_own_arrays_snippet_reads_by_index_and_shares_out_the_examples():
    """README's ArraySource input_fn: positioned, batched, disjoint shares per worker."""
    import dataclasses

    import numpy as np

    import trainer
    from trainer.model_fn import is_positioned

    snippet = next(b for b in guides.code_blocks("python") if "def my_input_fn" in b)
    namespace = {}
    exec(snippet, namespace)
    params = trainer.InputParams(batch_size=16, global_batch_size=32, seed=0)
    shares = []
    for worker in (0, 1):
        share = dataclasses.replace(params, num_input_pipelines=2, input_pipeline_id=worker)
        dataset = namespace["my_input_fn"](trainer.Mode.TRAIN, share)
        assert is_positioned(dataset)
        features, labels = next(iter(dataset))
        assert features["x"].shape == (16, 64) and labels["y"].shape == (16,)
        shares.append({tuple(row) for row in np.round(features["x"].numpy(), 5)})
    assert not shares[0] & shares[1]


def test_the_exit_code_table_is_the_one_the_code_uses():
    """README's table of exit codes, row for row, is ``trainer/exit_codes.py``'s."""
    from trainer import exit_codes

    table = guides.text().split("| exit | meaning | what to do |\n| --- | --- | --- |\n", 1)[1]
    rows = [line.strip("|").split(" | ") for line in table.split("\n\n", 1)[0].splitlines()]
    assert [tuple(cell.strip() for cell in row) for row in rows] == list(exit_codes.TABLE)


@pytest.mark.slow
def test_text_snippet_tags_every_real_token(tmp_path, monkeypatch):
    """The guide 'Text and sequences', run as written from a working directory: trained
    in four slices, grouped and bucketed, by a token budget, and packed, evaluated over
    every real token."""
    import json

    import gin

    blocks = guides.code_blocks("python")
    snippet = next(b for b in blocks if "tokens_and_tags" in b)
    budgeted = next(b for b in blocks if "lengths.token_budget" in b)
    packed = next(b for b in blocks if "packing.length" in b)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    try:
        exec(snippet, namespace)
        exec(budgeted, namespace)
        exec(packed, namespace)
    finally:
        gin.clear_config()
    runs = {"tagger": "est", "tagger_budget": "budgeted", "tagger_packed": "packed"}
    for name, estimator in ((name, namespace[variable]) for name, variable in runs.items()):
        assert estimator.step == 300
        evaluated = estimator.evaluate(namespace["input_fn"])
        assert evaluated["accuracy"] > 0.95, name
        logged = [json.loads(line) for line in open(f"output/{name}/metrics.jsonl")]
        shares = [line["padding_share"] for line in logged if line["writer"] == "train"]
        assert shares and max(shares) < 0.2, name  # at random, lengths 3 to 59 pad about half
    trained = [json.loads(line) for line in open("output/tagger_budget/metrics.jsonl")]
    per_step = [
        t["examples_per_sec"] / t["steps_per_sec"] for t in trained if t["writer"] == "train"
    ]
    assert 8 < min(per_step) and max(per_step) < 64  # lengths 3 to 59: neither all nor few
