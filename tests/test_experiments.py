"""Every experiment file runs, small: TFDS ones on mock data, offline ones for real."""

import math
import os
import subprocess
import sys

import gin
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import trainer
from tests.support.commands import REPO, run_cli
from tests.support.helpers import checkpoint_steps
from trainer.cli import experiment

TFDS_EXPERIMENTS = ["mnist_mlp", "fashion_mnist_mlp", "mnist_alexnet", "cifar10_alexnet"]
TFDS_EXPERIMENTS += ["cifar10_resnet56"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TFDS_EXPERIMENTS)
def test_tfds_experiment_trains_on_mock_data(tmp_path, name):
    gin.parse_config_files_and_bindings(
        [f"{REPO}/experiments/{name}.gin", f"{REPO}/experiments/smoke.gin"],
        ["Estimator.global_batch_size = 8", "tfds_images.input_fn.data_dir = 'unused'"],
    )
    with tfds.testing.mock_data(num_examples=24):
        result = experiment.experiment(model_dir=str(tmp_path), schedule="train_and_evaluate")
    assert result["global_step"] == 10
    assert 0.0 <= result["metrics"]["eval"]["accuracy"] <= 1.0
    assert checkpoint_steps(tmp_path) == [10]


@pytest.mark.slow
def test_smoke_include_shrinks_an_experiment(tmp_path, data_dir):
    proc = run_cli(
        "--gin_file",
        "experiments/digits_mlp.gin",
        "--gin_file",
        "experiments/smoke.gin",
        "--model_dir",
        str(tmp_path),
        "--gin_param",
        f"digits.input_fn.data_dir = '{data_dir}'",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert checkpoint_steps(tmp_path) == [10]
    assert "Evaluation of 'eval' at step 10 (256 examples" in proc.stdout


def test_every_experiment_parses(tmp_path):
    for name in sorted(os.listdir(f"{REPO}/experiments")):
        gin.clear_config()
        gin.parse_config_file(f"{REPO}/experiments/{name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["digits_vit", "stdlib_lm"])
def test_a_transformer_recipe_runs_small_and_the_language_model_continues_its_prompts(
    tmp_path, name, data_dir
):
    """The recipes' figures are measured in their headers; here each runs end to end,
    small: 10 steps and an evaluation of 2 batches, then the language model's predict."""
    gin.parse_config_files_and_bindings(
        [f"{REPO}/experiments/{name}.gin", f"{REPO}/experiments/smoke.gin"],
        [f"digits.input_fn.data_dir = '{data_dir}'"] if "digits" in name else [],
    )
    result = experiment.experiment(model_dir=str(tmp_path), schedule="train_and_evaluate")
    assert result["global_step"] == 10 and checkpoint_steps(tmp_path) == [10]
    metric = "accuracy" if name == "digits_vit" else "bits_per_byte"
    assert 0.0 <= result["metrics"]["eval"][metric] <= (1.0 if name == "digits_vit" else 8.0)
    if name == "stdlib_lm":
        predicted = list(
            experiment.experiment(model_dir=str(tmp_path), schedule="predict")["predictions"]
        )
        assert len(predicted) == 2 and all(p["generated"].shape == (48,) for p in predicted)
        assert all(isinstance(p["text"], bytes) for p in predicted)
        # The export takes strings and generates as predict did.
        exported = experiment.experiment(model_dir=str(tmp_path), schedule="export")
        serve = trainer.load_export(exported["export_dir"]).signatures["serving_default"]
        served = serve(text=tf.constant(["def main("]))
        assert served["text"].numpy()[0] == predicted[0]["text"]
        from datasets import stdlib

        baseline = stdlib.bigram_bits_per_byte()  # the header's 3.51 and 4.53 on Python 3.11
        assert 3.0 < baseline["bigram"] < baseline["unigram"] < 5.0


@pytest.mark.slow
def test_the_text_classifier_recipe_runs_small_on_functions_prepared_as_its_header_says(tmp_path):
    """Its header's three commands, in a working directory: the standard library's
    functions written, prepared (a vocabulary of words), trained small; and the bag of
    words its figure is compared with, on the same split."""
    from datasets import stdlib
    from datasets.text import input_fns, preparation

    gin.parse_config_files_and_bindings(
        [f"{REPO}/experiments/text_classifier.gin", f"{REPO}/experiments/smoke.gin"],
        [f"text.input_fn.data_dir = '{tmp_path}/data/functions'"],
    )
    header = open(f"{REPO}/experiments/text_classifier.gin").read()
    assert "python3 -m datasets.stdlib --functions data/functions.jsonl" in header
    assert stdlib.main(["stdlib", "--functions", str(tmp_path / "data/functions.jsonl")]) == 0
    metadata = preparation.prepare(
        str(tmp_path / "data/functions.jsonl"), str(tmp_path / "data/functions"), "words", 8000
    )
    assert metadata["num_classes"] == len(stdlib.PACKAGES) and metadata["vocab_size"] == 8000
    result = experiment.experiment(model_dir=str(tmp_path / "run"), schedule="train_and_evaluate")
    assert result["global_step"] == 10 and 0.0 <= result["metrics"]["eval"]["accuracy"] <= 1.0
    assert 0.7 < input_fns.bag_of_words_accuracy(str(tmp_path / "data/functions")) < 0.9  # 0.83


@pytest.mark.slow
def test_the_sft_recipe_runs_small_from_the_language_model_as_its_header_says(tmp_path):
    """Its header's commands, small, in a working directory: the language model trained
    10 steps; the chats written and prepared; the fine-tuning evaluated from the
    language model's checkpoint (before), then trained 10 steps warm-started from it,
    each evaluation judging the held-out answers it generates (parse_share)."""
    from datasets import stdlib
    from datasets.chat import preparation

    header = open(f"{REPO}/experiments/stdlib_sft.gin").read()
    assert "python3 -m datasets.stdlib --chats data/chats.jsonl" in header
    assert stdlib.main(["stdlib", "--chats", str(tmp_path / "data/chats.jsonl")]) == 0
    metadata = preparation.prepare(str(tmp_path / "data/chats.jsonl"), str(tmp_path / "data/chats"))
    assert metadata["kind"] == "chat" and metadata["splits"]["test"]["count"] > 100
    lm = str(tmp_path / "output/stdlib_lm")
    gin.parse_config_files_and_bindings(
        [f"{REPO}/experiments/stdlib_lm.gin", f"{REPO}/experiments/smoke.gin"], []
    )
    experiment.experiment(model_dir=lm, schedule="train")
    small = [
        f"chat.input_fn.data_dir = '{tmp_path}/data/chats'",
        f"WarmStart.source = '{lm}'",
        "LanguageModel.generate = 8",  # a few bytes of each answer, judged
    ]
    files = [f"{REPO}/experiments/stdlib_sft.gin", f"{REPO}/experiments/smoke.gin"]
    gin.clear_config()
    gin.parse_config_files_and_bindings(files, small)
    before = experiment.experiment(model_dir=lm, schedule="evaluate")
    assert before["global_step"] == 10 and 0.0 <= before["metrics"]["eval"]["parse_share"] <= 1.0
    gin.clear_config()
    gin.parse_config_files_and_bindings(files, small)
    result = experiment.experiment(model_dir=str(tmp_path / "sft"), schedule="train_and_evaluate")
    assert result["global_step"] == 10 and checkpoint_steps(tmp_path / "sft") == [10]
    assert 0.0 <= result["metrics"]["eval"]["parse_share"] <= 1.0
    assert result["metrics"]["eval"]["bits_per_byte"] < 8.0
    _the_dpo_recipe_runs_small_from_the_sft_model(tmp_path, str(tmp_path / "sft"))
    _the_lora_recipe_runs_small_from_the_language_model(tmp_path, lm, small)


def _the_lora_recipe_runs_small_from_the_language_model(tmp_path, lm: str, small: list):
    """The LoRA recipe after the language model, small: 10 steps of adapters over it,
    the language model's checkpoint untouched, the run's holding the adapters alone."""
    header = open(f"{REPO}/experiments/stdlib_sft_lora.gin").read()
    assert "python3 -m trainer --gin_file experiments/stdlib_sft_lora.gin" in header
    files = [f"{REPO}/experiments/stdlib_sft_lora.gin", f"{REPO}/experiments/smoke.gin"]
    gin.clear_config()
    gin.parse_config_files_and_bindings(files, [*small[:1], f"LoRA.base = '{lm}'", small[2]])
    before = os.stat(f"{lm}/ckpt-10.data-00000-of-00001").st_mtime_ns
    result = experiment.experiment(model_dir=str(tmp_path / "lora"), schedule="train_and_evaluate")
    assert result["global_step"] == 10 and 0.0 <= result["metrics"]["eval"]["parse_share"] <= 1.0
    assert os.stat(f"{lm}/ckpt-10.data-00000-of-00001").st_mtime_ns == before
    latest = f"{tmp_path}/lora/ckpt-10"
    shapes = [shape for _, shape in tf.train.list_variables(latest) if len(shape) == 2]
    # rank 8 on 2 blocks' 6 projections of width 128 (the MLP's 512): A, B and Adam's 2
    assert len(shapes) == 2 * 6 * 2 * 3 and max(max(s) for s in shapes) == 512
    assert min(min(s) for s in shapes) == 8


def _the_dpo_recipe_runs_small_from_the_sft_model(tmp_path, sft: str):
    """The DPO recipe's commands after the SFT's, small: the standard library's pairs
    written and prepared (a hundred of them), scored by the SFT model through the
    command line as the header types it, then evaluated from the SFT model (before)
    and tuned 10 steps from it; its results hold reward_accuracy and parse_share."""
    from datasets import stdlib
    from datasets.chat import pairs

    header = open(f"{REPO}/experiments/stdlib_dpo.gin").read()
    assert "python3 -m datasets.stdlib --pairs data/pairs.jsonl" in header
    assert "python3 -m datasets.chat.reference --gin_file experiments/stdlib_dpo.gin" in header
    written = tmp_path / "data/pairs.jsonl"
    assert stdlib.main(["stdlib", "--pairs", str(written)]) == 0
    written.write_text("".join(written.read_text().splitlines(keepends=True)[:100]))
    pairs.prepare(str(written), str(tmp_path / "data/pairs"))
    small = [f"SFT = '{sft}'", "chat.pairs_input_fn.data_dir = 'data/pairs'"]
    small += ["PreferenceModel.generate = 8"]
    files = ["experiments/stdlib_dpo.gin", "experiments/smoke.gin"]
    command = [sys.executable, "-m", "datasets.chat.reference"]
    command += [f"--gin_file={REPO}/{f}" for f in files] + [f"--gin_param={p}" for p in small]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "wrote data/pairs/reference.json"
    assert (tmp_path / "data/pairs/train-reference.npy").stat().st_size == 128 + 8 * 90
    small[1] = f"chat.pairs_input_fn.data_dir = '{tmp_path}/data/pairs'"
    for schedule, model_dir in (("evaluate", sft), ("train_and_evaluate", tmp_path / "dpo")):
        gin.clear_config()
        gin.parse_config_files_and_bindings([f"{REPO}/{f}" for f in files], small)
        result = experiment.experiment(model_dir=str(model_dir), schedule=schedule)
        metrics = result["metrics"]["eval"]
        assert 0.0 <= metrics["reward_accuracy"] <= 1.0 and 0.0 <= metrics["parse_share"] <= 1.0
        if schedule == "evaluate":  # the reference itself: every reward 0, the loss log 2
            assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-5)
            assert abs(metrics["reward_margin"]) < 1e-5
    assert result["global_step"] == 10 and metrics["reward_accuracy"] > 0.0
