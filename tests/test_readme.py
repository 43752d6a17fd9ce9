"""README examples are run, not imagined: quoted files match, snippets execute."""

import os
import re

from tests.conftest import REPO


def readme():
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def code_blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", readme(), flags=re.S)


def test_setup_commands_come_first_and_ci_runs_the_test_command():
    first = code_blocks("sh")[0].splitlines()
    assert first == [
        "python3 -m pip install -e . && python3 -m trainer --gin_file experiments/digits_mlp.gin",
        'python3 -m pip install -e ".[test]" && python3 -m pytest -q -n 2',
    ]
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert "README.md" in f.read()


def test_user_module_and_experiment_are_quoted_verbatim():
    for name, lang in [("polyfit.py", "python"), ("polyfit.gin", "gin")]:
        with open(os.path.join(REPO, "tests", "user_project", name)) as f:
            assert f.read() in code_blocks(lang), f"README's copy of {name} is stale"


def test_python_api_snippet_runs(tmp_path, monkeypatch):
    snippet = next(b for b in code_blocks("python") if "trainer.Estimator(" in b)
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


def test_every_experiment_has_a_header_with_its_command():
    folder = os.path.join(REPO, "experiments")
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            text = f.read()
        assert text.startswith("#"), name
        assert f"--gin_file experiments/{name}" in text and "Expected" in text, name
