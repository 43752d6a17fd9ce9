"""Every command README.md, the guides and the experiment headers show, run as written.

The rest of the suite passes absolute temporary paths. A user types the guides'
commands from the root of a clone, with relative paths and the default model_dir,
and runs them twice: a relative model_dir joined onto itself hid behind absolute
paths for a whole turn. Here each command is read out of README.md, docs/guide/ and
experiments/*.gin and given to bash as text, in a copy of the repository, with
the user's environment; ``test_every_command_shown_is_run_here`` fails when a
command appears that no test here runs or excuses.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from tests.support import deployment_checks, guides
from tests.support.as_typed import ok, sh, user_env
from tests.support.commands import REPO
from tests.support.helpers import checkpoint_steps, closed_form_eval_mse, event_tags
from trainer.distributed.launcher import free_ports

HEADER_COMMAND = re.compile(r"^#\s+((?:PYTHONPATH=\S+ )?python3? -m .*)$", re.M)

# Shown, but not run here, and why.
NOT_RUN = {
    "python3 -m trainer --gin_file FILE [--gin_file FILE ...] [--gin_param 'A.b = 1' ...]": (
        "the syntax, not a command"
    ),
    "python3 -m pip install -e .": "CI's own install (.ci/run runs README's commands)",
    'python3 -m pip install -e ".[test]"': "CI's own install",
    "python3 -m pytest -q -n 2": "this suite",
    'python3 -m pip install -e ".[docs]"': "CI's own install (the test extra has the docs')",
    "python3 -m datasets.prepare --text functions.jsonl --out data/functions": "a user's "
    "file: tests/test_text.py writes one (the standard library's functions) and runs it so",
    "python3 -m datasets.prepare --text FILE.parquet": "a user's file: tests/test_tables.py "
    "prepares a Parquet file and a save_to_disk folder so, and a cut-short one as a command",
    "python3 -m datasets.prepare --text reviews.jsonl --out data/reviews": "a user's file: "
    "tests/test_text.py runs the same command on a file of the standard library's functions",
    "python3 -m mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri "
    "sqlite:///mlflow.db": "a server that runs until stopped: tests/test_tracking.py starts "
    "one the same way, on a free port",
    "python3 -m trainer --gin_file experiments/cifar10_alexnet.gin --num_devices 8": "8 GPUs",
    "python3 -m datasets.prepare --chat data/chats.jsonl --out data/gpt2_chats --preset "
    "presets/gpt2_chat": "a user's preset: tests/test_hub_sft.py saves a GPT-2 there and runs "
    "the command as written, in that folder",
    'python3 -c "import keras; keras.applications.MobileNetV2(include_top=False, '
    "input_shape=(96, 96, 3), pooling='avg').save('mobilenet_v2.keras')\"": "downloads "
    "ImageNet's weights; the fine-tuning test saves the same model made with weights=None",
    "python3 -m trainer --gin_file experiments/imagenet_resnet50.gin --num_devices 8": "ImageNet "
    "on 8 GPUs; test_image_folders.py trains it small on shards in ImageNet's layout",
    "python3 -m trainer --gin_file experiments/imagenet_alexnet.gin": "ImageNet; "
    "test_image_folders.py trains it small on shards in ImageNet's layout",
    **{
        f"python3 -m datasets.prepare --tfrecords '/imagenet/{split}-*' --split {split} "
        "--label_offset -1 --out data/imagenet": "ImageNet's shards; test_image_folders.py "
        "runs it on shards in that layout"
        for split in ("train", "validation")
    },
    "python3 -m trainer --gin_file experiments/cifar10_alexnet.gin --num_devices 8 "
    "--gin_param \"Devices.distribution = 'towers'\"": "8 GPUs",
    # The sequence recipes take 46 s to 3 min whole, more than the suite can pay for:
    # each runs small in the tests named, and its header's figure was measured whole.
    "python3 -m trainer --gin_file experiments/digits_vit.gin": "48 s whole; "
    "test_experiments.py runs it small",
    "python3 -m trainer --gin_file experiments/reverse_lstm.gin": "46 s whole; "
    "test_seq2seq.py trains it small, resumed, on two devices and in micro-batches",
    "python3 -m trainer --gin_file experiments/stdlib_lm.gin": "3 min whole; "
    "test_experiments.py runs it small, then predicts and exports it",
    "python3 -m trainer --gin_file experiments/stdlib_lm.gin --schedule predict --results "
    "continued.jsonl": "after the 3 min run; test_experiments.py predicts after a small one",
    "python3 -m datasets.stdlib --functions data/functions.jsonl": "test_experiments.py "
    "runs it (its main) and prepares what it writes",
    "python3 -m datasets.prepare --text data/functions.jsonl --tokenizer words "
    "--vocab_size 8000 --out data/functions": "test_experiments.py prepares the same file so",
    "python3 -m trainer --gin_file experiments/text_classifier.gin": "75 s whole; "
    "test_experiments.py runs it small on the functions prepared as its header says",
    "python3 -m datasets.stdlib --functions data/functions.parquet": "test_tables.py runs "
    "it as a command from a working directory, and its main before the recipe",
    "python3 -m trainer --gin_file experiments/text_classifier_parquet.gin": "2.5 min whole; "
    "test_tables.py runs it small from the Parquet file and from a save_to_disk folder",
    "python3 -m datasets.prepare --pairs pairs.jsonl --out data/pairs": "a user's file: "
    "tests/test_prepare_mistakes.py runs the same command on a file of pairs",
    "python3 -m datasets.prepare --chat chats.jsonl --out data/chats": "a user's file: "
    "test_experiments.py prepares the standard library's chats so, and "
    "tests/test_prepare_mistakes.py runs --chat as a command",
    "python3 -m datasets.stdlib --chats data/chats.jsonl": "test_experiments.py runs it (its "
    "main) and prepares what it writes",
    "python3 -m datasets.prepare --chat data/chats.jsonl --out data/chats": "test_experiments.py "
    "prepares the same file so; tests/test_prepare_mistakes.py runs --chat as a command",
    "python3 -m trainer --gin_file experiments/stdlib_sft.gin --schedule evaluate --model_dir "
    "output/stdlib_lm --results output/stdlib_sft_before.json": "after stdlib_lm's 3 min; "
    "test_experiments.py evaluates a small stdlib_lm so",
    "python3 -m trainer --gin_file experiments/stdlib_sft.gin --results "
    "output/stdlib_sft.json": "5 min whole, after stdlib_lm's 3; test_experiments.py runs it "
    "small from a small stdlib_lm, as its header says",
    "python3 -m trainer --gin_file experiments/stdlib_sft.gin": "5 min whole, after "
    "stdlib_lm's 3 (the DPO recipe's start); test_experiments.py runs it small",
    "python3 -m datasets.stdlib --pairs": "test_experiments.py runs it (its main) and "
    "prepares what it writes",
    "python3 -m datasets.stdlib --pairs data/pairs.jsonl": "test_experiments.py runs it (its "
    "main) and prepares what it writes",
    "python3 -m datasets.prepare --pairs data/pairs.jsonl --out data/pairs": "test_experiments.py "
    "prepares the same file so; tests/test_prepare_mistakes.py runs --pairs as a command",
    "python3 -m datasets.chat.reference --gin_file experiments/stdlib_dpo.gin": "after the SFT "
    "recipe; test_experiments.py runs this command in a working directory, small",
    "python3 -m trainer --gin_file experiments/stdlib_dpo.gin --schedule evaluate --model_dir "
    "output/stdlib_sft --results output/stdlib_dpo_before.json": "after the SFT recipe; "
    "test_experiments.py evaluates a small SFT model so",
    "python3 -m trainer --gin_file experiments/stdlib_dpo.gin --results "
    "output/stdlib_dpo.json": "3 min whole, after the SFT recipe; test_experiments.py runs "
    "it small from a small SFT model, as its header says",
    "python3 -m trainer --gin_file experiments/stdlib_sft_lora.gin --results "
    "output/stdlib_sft_lora.json": "5 min whole, after stdlib_lm's 3; test_experiments.py "
    "runs it small from a small stdlib_lm, as its header says",
}
# Two machines (host1, host2, /shared): tests/test_parallel.py runs these workers on 127.0.0.1.
MULTI_WORKER = "TF_CONFIG="
NEEDS_DOWNLOAD = ["mnist_mlp", "fashion_mnist_mlp", "mnist_alexnet", "cifar10_alexnet"]
NEEDS_DOWNLOAD += ["cifar10_resnet56"]


def shown_commands() -> set[str]:
    """The commands README.md and the experiment headers show, one string each."""
    readme = guides.text()
    commands = set()
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", readme, re.S):
        if lang in ("", "sh"):
            text = block.replace("\\\n", " ")
            for line in text.splitlines():
                line = re.sub(r"\s+", " ", line.strip())
                if re.match(r"(TF_CONFIG=|PYTHONPATH=|python3? )", line):
                    commands.update(part.strip() for part in line.split("&&"))
    for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", readme, flags=re.S)):
        span = re.sub(r"\s+", " ", span)
        if re.match(r"(PYTHONPATH=\S+ )?python3? -m (trainer|datasets)\S* --", span):
            commands.add(span)
    for name in sorted(os.listdir(os.path.join(REPO, "experiments"))):
        with open(os.path.join(REPO, "experiments", name)) as f:
            commands.update(HEADER_COMMAND.findall(f.read()))
    for name in ("polyfit.gin", "parity.gin"):
        with open(os.path.join(REPO, "tests", "user_project", name)) as f:
            commands.update(HEADER_COMMAND.findall(f.read()))
    return commands


def final_metrics(stdout):
    """The end-of-run table's first row: ``{'loss': ..., 'accuracy': ...}``."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("eval set "))
    names, values = lines[at].split()[2:], lines[at + 1].split()[1:]
    return dict(zip(names, map(float, values), strict=True))


def expected(name):
    """The header's promise: ``Expected: eval METRIC ~VALUE (>= FLOOR)`` -> its parts.

    ``~VALUE±SPREAD`` gives its own spread (a chaotic recipe, whose figure moves with
    the CPU's kernels); else it is 2% of the value (at least 0.02).
    """
    with open(os.path.join(REPO, "experiments", f"{name}.gin")) as f:
        header = f.read()
    found = re.search(r"Expected: eval (\w+) ~([\d.]+)(±[\d.]+)? \(([<>]=) ([\d.]+)\)", header)
    assert found, f"{name}.gin's header gives no 'Expected: eval METRIC ~X (>= Y)'"
    metric, about, spread, sense, bound = found.groups()
    return metric, float(about), spread, sense, float(bound)


def check_promise(name, stdout):
    """The run keeps its header's promise, and README's table promises the same."""
    metric, about, spread, sense, bound = expected(name)
    value = final_metrics(stdout)[metric]
    assert value >= bound if sense == ">=" else value <= bound, (name, metric, value)
    allowed = float(spread[1:]) if spread else 0.02 * max(abs(about), 1.0)
    assert abs(value - about) <= allowed, (name, metric, value, about)
    row = next(line for line in guides.lines() if line.startswith(f"| `{name}.gin`"))
    assert f"{metric} ~{about:g}{spread or ''} ({sense} {bound:g})" in row, row
    return value


def figures_out(line):
    """``line`` with its numbers as ``#``, to compare a console line with README's."""
    return re.sub(r"\d+(\.\d+)?(e-\d+)?", "#", line.strip())


DIGITS = "python3 -m trainer --gin_file experiments/digits_mlp.gin"
IMAGES = "python3 -m datasets.prepare --images photos --out data/photos"


@pytest.mark.slow
def test_readmes_first_command_resumes_after_ctrl_c_reruns_and_serves_every_schedule(
    clone, data_dir
):
    """README's first command, interrupted, rerun twice; then each schedule on its model_dir.

    Its export's TFLite and ONNX files are checked in their runtimes as a client runs them
    (``deployment_checks``)."""
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {DIGITS}"],
        cwd=clone,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("Saved checkpoint output/digits_mlp/ckpt-"):
            proc.send_signal(signal.SIGINT)  # Ctrl-C after the first checkpoint
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert re.fullmatch(
        r"preempted: SIGINT received: saved output/digits_mlp/ckpt-\d+ at step \d+; "
        r"rerun the same command to resume\n",
        err,
    )
    resumed = ok(sh(DIGITS, clone))
    assert resumed.stderr == ""
    assert re.search(r"^Restored output/digits_mlp/ckpt-\d+$", resumed.stdout, re.M)
    assert "step 2000/2000" in resumed.stdout
    check_promise("digits_mlp", resumed.stdout)
    again = ok(sh(DIGITS, clone))
    assert "global_step 2000 >= max_steps 2000: nothing to train." in again.stdout
    assert final_metrics(again.stdout) == final_metrics(resumed.stdout)

    for schedule in ("evaluate", "continuous_eval"):
        evaluated = ok(sh(f"{DIGITS} --schedule {schedule}", clone, timeout=120))
        assert final_metrics(evaluated.stdout) == final_metrics(resumed.stdout), schedule
    exported = ok(sh(next(c for c in shown_commands() if "--export_format" in c), clone))
    assert "exported     output/digits_mlp/export/2000" in exported.stdout
    export_dir = clone / "output/digits_mlp/export/2000"
    assert (export_dir / "saved_model.pb").is_file()
    shown = {figures_out(line) for line in guides.lines() if line.startswith("Exported ")}
    lines = [line for line in exported.stdout.splitlines() if line.startswith("Exported ")]
    assert {figures_out(line) for line in lines[1:]} == shown  # README's, but for figures
    for name in ("model.tflite", "model_int8.tflite", "model.onnx"):
        assert (export_dir / name).stat().st_size > 1000, name
    deployment_checks.check_tflite_and_onnx_serve_as_the_saved_model_does(
        export_dir, "output/digits_mlp/export/2000", exported.stdout, data_dir
    )
    ok(sh(f"{DIGITS} --schedule predict --results predictions.jsonl", clone))
    lines = (clone / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 360 and 0 <= json.loads(lines[0])["classes"] < 10
    assert sorted(os.listdir(clone / "output")) == ["digits_mlp"]  # nothing nested


@pytest.mark.slow
def test_readmes_console_is_the_first_commands_line_for_line_and_its_model_fine_tunes(clone):
    """README shows the first command's whole console: the real one, numbers aside. Its
    fine-tuning example then puts the digits MLP's body under a new head: the warm
    start's report, then accuracy (one run of the first command for both)."""
    proc = ok(sh(DIGITS, clone))
    assert proc.stderr == ""  # no warning either: the digits in memory are not input-bound
    shape = lambda text: [re.sub(r"\d+(\.\d+)?", "N", line) for line in text.splitlines()]  # noqa: E731
    shown = re.search(r"```console\n(.*?)```", guides.text(), re.S).group(1)
    assert shape(shown) == shape(proc.stdout)
    noise = ("E0000", "W0000", "I0000", "WARNING: All log messages", "Sharding callback")
    assert not [line for line in proc.stdout.splitlines() if line.startswith(noise)]
    model_dir = clone / "output/digits_mlp"
    assert {"loss", "accuracy", "learning_rate", "steps_per_sec"} <= event_tags(model_dir / "train")
    assert {"loss", "accuracy"} <= event_tags(model_dir / "eval_eval")
    operative = (model_dir / "operative_config.gin").read_text()
    assert "MLP.hidden_units = [256, 256]" in operative
    assert "experiment.max_steps = 2000" in operative
    saved = {
        s: os.path.getmtime(model_dir / f"ckpt-{s}.index") for s in checkpoint_steps(model_dir)
    }
    smoke = f"{DIGITS} --gin_file experiments/smoke.gin"
    assert "nothing to train" in ok(sh(smoke, clone)).stdout  # its model_dir is digits_mlp's
    assert {s: os.path.getmtime(model_dir / f"ckpt-{s}.index") for s in saved} == saved

    (finetune,) = [c for c in shown_commands() if "parity.gin" in c]
    proc = ok(sh(finetune, clone))
    report = next(line for line in proc.stdout.splitlines() if "Warm-started" in line)
    assert report.startswith(
        "Warm-started from output/digits_mlp/ckpt-2000: loaded 4 of the source's 6 "
        "(hidden/dense_0/_kernel, hidden/dense_0/bias, hidden/dense_1/_kernel, "
        "hidden/dense_1/bias); skipped 2 whose shape differs (logits/_kernel ((256, 10) "
        "there, (256, 2) here)"
    ), report
    assert "'^dense/' matches 4 variables" in proc.stdout
    assert final_metrics(proc.stdout)["accuracy"] >= 0.95
    assert "nothing to train" in ok(sh(finetune, clone)).stdout


@pytest.mark.slow
def test_readmes_own_model_trains_resumes_and_predicts(clone):
    train, predict = sorted(c for c in shown_commands() if "polyfit.gin" in c)[:2]
    assert predict.endswith("--schedule predict --results predictions.jsonl"), predict
    first = ok(sh(train, clone))
    assert final_metrics(first.stdout)["abs_error"] < 0.15  # the noise level, 0.1
    assert "nothing to train" in ok(sh(train, clone)).stdout
    ok(sh(predict, clone))
    ys = [
        json.loads(line)["y"][0] for line in (clone / "predictions.jsonl").read_text().splitlines()
    ]
    assert ys == pytest.approx([3.0, 4.25, 8.0], abs=0.1)  # y = 5x^2 + 3 at x = 0, .5, 1


@pytest.mark.slow
def test_tfrecord_experiment_prepares_trains_verifies_and_runs_from_another_directory(clone):
    prepare = "python3 -m datasets.prepare --dataset digits --out data/digits --shards 4"
    prepared = ok(sh(prepare, clone))
    assert prepared.stderr == "", prepared.stderr  # no TensorFlow start-up lines
    assert len(list((clone / "data/digits").glob("train-*-of-00004.tfrecord"))) == 4
    run = ok(sh("python3 -m trainer --gin_file experiments/digits_mlp_tfrecord.gin", clone))
    check_promise("digits_mlp_tfrecord", run.stdout)
    verify = ok(sh("python3 -m datasets.prepare --verify data/digits", clone))
    assert verify.stdout == "data/digits: all records readable\n" and verify.stderr == ""
    # From another directory: a relative --gin_file whose include is relative to the root.
    elsewhere = (
        "python3 -m trainer --gin_file ../experiments/digits_mlp_tfrecord.gin "
        "--gin_file ../experiments/smoke.gin "
        "--gin_param \"tfrecord.input_fn.data_dir = '../data/digits'\""
    )
    proc = subprocess.run(
        ["bash", "-c", elsewhere],
        cwd=clone / "tests",
        env=dict(user_env(), PYTHONPATH=str(clone)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ok(proc)
    assert (clone / "tests/output/digits_mlp_tfrecord/ckpt-10.index").is_file()


@pytest.mark.slow
def test_your_own_images_prepare_and_train_as_promised(clone):
    """README's folder of images: prepared, trained with the ImageNet recipe, rerun."""
    from tests.support import image_folders

    image_folders.make(str(clone / "photos"), 60, split_folders=())
    prepared = ok(sh(IMAGES, clone))
    assert "train: 162 examples in 1 shards, 2 files skipped" in prepared.stdout
    assert prepared.stderr.count("warning: Skipping photos/at dusk/") == 2, prepared.stderr
    assert "already written" in ok(sh(IMAGES, clone)).stdout
    run = ok(sh("python3 -m trainer --gin_file experiments/images_alexnet.gin", clone))
    check_promise("images_alexnet", run.stdout)


@pytest.mark.slow
def test_a_pretrained_backbone_fine_tunes_in_two_phases_as_written(clone):
    """README's fine-tuning recipe; its backbone made here, as nothing downloads."""
    import keras
    import numpy as np

    from tests.support import image_folders
    from tests.support.backbones import make_backbone
    from trainer.warm_start import Source

    commands = [c for c in shown_commands() if "images_pretrained" in c]
    (head,) = [c for c in commands if c.endswith("images_pretrained_head.gin")]
    (whole,) = [c for c in commands if c.endswith("images_pretrained_all.gin")]
    # README's first command with weights=None, and statistics that fit images.
    make_backbone(str(clone / "mobilenet_v2.keras"), keras.applications.MobileNetV2, 96, 0.35)
    image_folders.make(str(clone / "photos"), 60, split_folders=())
    ok(sh(IMAGES, clone))
    refused = sh(whole, clone)  # phase 2 before phase 1: one line
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "output/images_pretrained_head: there is nothing there; train" in refused.stderr
    first = ok(sh(head, clone))
    assert (
        "Loaded backbone mobilenetv2_0.35_96 from mobilenet_v2.keras: 410,208 weights "
        "in 155 layers (52 batch norms, kept in inference mode), frozen; the head alone "
        "trains; new head of 3 classes"
    ) in first.stdout
    assert "(3,843 parameters)" in first.stdout  # the head's 1280 x 3 + 3
    assert final_metrics(first.stdout)["accuracy"] >= 0.9
    second = ok(sh(whole, clone))
    assert "Warm-started from output/images_pretrained_head/ckpt-100: loaded 262 of the " in (
        second.stdout
    )
    assert final_metrics(second.stdout)["accuracy"] >= 0.9
    # Phase 2 trained the body; no moving statistic of its 52 batch norms moved.
    before = Source(str(clone / "output/images_pretrained_head"))
    after = Source(str(clone / "output/images_pretrained_all"))
    moving = [name for name in before.shapes if "moving" in name]
    assert len(moving) == 104 and before.shapes == after.shapes
    assert all(np.array_equal(before.read(n), after.read(n)) for n in moving)
    changed = [n for n in before.shapes if not np.array_equal(before.read(n), after.read(n))]
    assert len(changed) > 100 and any(n.endswith("gamma") for n in changed)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["diabetes_linear", "diabetes_linear_momentum"])
def test_diabetes_experiments_reach_the_closed_form(clone, name):
    proc = ok(sh(f"python3 -m trainer --gin_file experiments/{name}.gin", clone))
    mse = check_promise(name, proc.stdout)
    assert mse == pytest.approx(closed_form_eval_mse(), rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["digits_alexnet", "digits_alexnet_bn"])
def test_digits_alexnet_keeps_its_promise(clone, name):
    proc = ok(sh(f"python3 -m trainer --gin_file experiments/{name}.gin", clone))
    assert proc.stderr == ""  # not reported input-bound: its data is in memory
    check_promise(name, proc.stdout)


@pytest.mark.slow
def test_digits_gan_keeps_its_promise_and_resumes(clone):
    """Two optimizers through the CLI: the promise, digits in TensorBoard, a rerun."""
    command = "python3 -m trainer --gin_file experiments/digits_gan.gin"
    check_promise("digits_gan", ok(sh(command, clone)).stdout)
    assert "predicted/generated" in event_tags(str(clone / "output/digits_gan/train"))
    assert "nothing to train" in ok(sh(command, clone)).stdout


@pytest.mark.slow
def test_digits_keras_keeps_its_promise_resumes_and_exports(clone):
    """A compiled Keras model through the CLI: trains, reruns to nothing, exports."""
    command = "python3 -m trainer --gin_file experiments/digits_keras.gin"
    check_promise("digits_keras", ok(sh(command, clone)).stdout)
    assert "nothing to train" in ok(sh(command, clone)).stdout
    ok(sh(f"{command} --schedule export", clone))
    assert list((clone / "output/digits_keras/export").glob("*/saved_model.pb"))


@pytest.mark.slow
@pytest.mark.parametrize("name", NEEDS_DOWNLOAD)
def test_tfds_experiments_without_their_data_say_how_to_get_it(clone, name):
    started = time.monotonic()
    proc = sh(f"python3 -m trainer --gin_file experiments/{name}.gin", clone, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "tfds build" in lines[0], lines
    assert not (clone / "output").exists()
    assert time.monotonic() - started < 120


@pytest.mark.slow
def test_readmes_local_workers_train_one_model_as_promised(clone):
    """README's ``--workers 2``: two worker processes on this machine, one run."""
    proc = ok(sh(f"{DIGITS} --workers 2", clone))
    assert "multi_worker over 2 replicas" in proc.stdout
    check_promise("digits_mlp", proc.stdout)


@pytest.mark.slow
def test_kubernetes_recipe_describes_its_cluster_and_runs_as_each_pod(clone, tmp_path):
    """README's manifest: its TF_CONFIG names the Job's pods; its script trains as written."""
    documents = re.search(r"```yaml\n(.*?)```", guides.text(), re.S)[1]
    service, job, policy = yaml.safe_load_all(documents)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    script = container["args"][0]
    count = spec["completions"]

    def pods_tf_config(index):
        export = next(line for line in script.splitlines() if "TF_CONFIG=" in line)
        shown = subprocess.run(
            ["bash", "-c", f'{export}; echo "$TF_CONFIG"'],
            env={"JOB_COMPLETION_INDEX": str(index)},
            capture_output=True,
            text=True,
        )
        return json.loads(shown.stdout)

    name, domain = job["metadata"]["name"], service["metadata"]["name"]
    for index in range(count):
        config = pods_tf_config(index)
        assert config["task"] == {"type": "worker", "index": index}
        hosts = [address.rsplit(":", 1)[0] for address in config["cluster"]["worker"]]
        assert hosts == [f"{name}-{i}.{domain}" for i in range(count)]  # Indexed Job names
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == count == 2
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == domain
    assert service["spec"]["selector"] == {"job-name": name}
    assert pod["restartPolicy"] == "Never"  # what a podFailurePolicy requires
    actions = {
        code: rule["action"]
        for rule in spec["podFailurePolicy"]["rules"]
        if "onExitCodes" in rule and rule["onExitCodes"]["containerName"] == container["name"]
        for code in rule["onExitCodes"]["values"]
    }
    assert actions == {2: "FailJob", 3: "FailJob", 75: "Ignore"}  # the guide's exit codes

    # The workers' port is open to the Job's own pods only (the guide's "Who can reach").
    ports = {int(a.rsplit(":", 1)[1]) for a in pods_tf_config(0)["cluster"]["worker"]}
    pods_of_the_job = {"matchLabels": {"job-name": name}}  # the Job controller's label
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == pods_of_the_job
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": pods_of_the_job}]
    assert rule["ports"] == [{"protocol": "TCP", "port": port} for port in sorted(ports)]

    # Each pod's script, as written but for where the cluster and the shared volume are.
    local = script
    for index, port in enumerate(free_ports(count)):
        local = local.replace(f"{name}-{index}.{domain}:2222", f"127.0.0.1:{port}")
    local = local.replace("experiments/cifar10_alexnet.gin", "experiments/digits_mlp.gin")
    local = local.replace("/shared/runs/c10", str(tmp_path / "c10"))
    local = local.rstrip() + " --gin_param experiment.max_steps=40\n"
    pods = [
        subprocess.Popen(
            ["bash", "-c", local],
            cwd=clone,
            env={**user_env(), "JOB_COMPLETION_INDEX": str(index)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(count)
    ]
    outputs = [p.communicate(timeout=300) for p in pods]
    assert [p.returncode for p in pods] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "multi_worker over 2 replicas" in outputs[0][0]
    assert checkpoint_steps(tmp_path / "c10") == [40]


def test_help_as_written(clone):
    proc = ok(sh("python3 -m trainer --help", clone))
    assert proc.stdout.startswith("usage: python3 -m trainer --gin_file")


SWEEP = (
    f"{DIGITS} --gin_param 'experiment.max_steps = 300' --model_dir output/digits_sweep "
    "--sweep 'Adam.learning_rate = [1e-3, 3e-3]' --sweep 'MLP.hidden_units = [[64], [256, 256]]'"
)


@pytest.mark.slow
def test_callbacks_as_written(clone):
    """README's callbacks command: a CSV row per evaluation, the same after a rerun."""
    command = next(c for c in shown_commands() if "experiment.callbacks" in c)
    first = ok(sh(command, clone))
    path = clone / "output" / "digits_callbacks.csv"
    rows = path.read_text().splitlines()
    assert rows[0] == "epoch,accuracy,learning_rate,loss,val_accuracy,val_loss"
    assert [row.split(",")[0] for row in rows[1:]] == ["0", "1", "2", "3", "4"]
    accuracy = final_metrics(first.stdout)["accuracy"]  # printed to 4 places
    assert float(rows[-1].split(",")[4]) == pytest.approx(accuracy, abs=1e-4)
    assert "nothing to train" in ok(sh(command, clone)).stdout
    assert path.read_text().splitlines() == rows


@pytest.mark.slow
def test_mlflow_as_written(clone):
    """README's MLflow command: one run in the local store, rerun, still one run."""
    mlflow = pytest.importorskip("mlflow", reason="MLflow is the [mlflow] extra")
    command = next(c for c in shown_commands() if "--tracking_uri" in c)
    ok(sh(command, clone))
    assert "nothing to train" in ok(sh(command, clone)).stdout
    client = mlflow.tracking.MlflowClient(f"sqlite:///{clone}/output/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("trainer").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(200, 2001, 200))
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "digits_mlflow"


@pytest.mark.slow
def test_sweep_as_written(clone):
    """README's sweep, from a clone's root: four trials, then their table, best first."""
    proc = ok(sh(SWEEP, clone))
    table = proc.stdout.split("sweep: 4 trials in output/digits_sweep, best first by ")[1]
    rows = [line.split() for line in table.splitlines()[2:6]]
    assert sorted(row[0] for row in rows) == sorted(os.listdir(clone / "output" / "digits_sweep"))
    losses = [float(row[2]) for row in rows]
    assert losses == sorted(losses) and all(row[1] == "300" for row in rows)


def test_every_command_shown_is_run_here():
    """Each command shown is one the tests above run, or one NOT_RUN excuses."""
    covered = {
        DIGITS,
        f"{DIGITS} --gin_file experiments/smoke.gin",
        f"{DIGITS} --workers 2",
        "python3 -m trainer --help",
        f"{DIGITS} --schedule evaluate",
        f"{DIGITS} --schedule predict --results predictions.jsonl",
        guides.BUILD,  # tests/test_docs.py
        SWEEP,
        "python3 -m datasets.prepare --dataset digits --out data/digits --shards 4",
        "python3 -m datasets.prepare --verify data/digits",
        IMAGES,
        *(f"python3 -m trainer --gin_file experiments/{n}.gin" for n in NEEDS_DOWNLOAD),
        *(
            f"python3 -m trainer --gin_file experiments/{n}.gin"
            for n in (
                "digits_alexnet",
                "digits_alexnet_bn",
                "digits_gan",
                "digits_keras",
                "digits_mlp_tfrecord",
                "diabetes_linear",
                "images_alexnet",
            )
        ),
        "python3 -m trainer --gin_file experiments/diabetes_linear_momentum.gin",
        *(c for c in shown_commands() if "images_pretrained" in c),
        *(c for c in shown_commands() if "experiment.callbacks" in c),
        *(c for c in shown_commands() if "--tracking_uri" in c),
        *(c for c in shown_commands() if "--export_format" in c),
    }
    shown = shown_commands()
    polyfit = {c for c in shown if "polyfit.gin" in c or "parity.gin" in c}
    multi_worker = {c for c in shown if c.startswith(MULTI_WORKER)}
    left = shown - covered - polyfit - multi_worker - set(NOT_RUN)
    assert not left, f"commands shown but not run by tests/test_as_written.py: {sorted(left)}"
    assert len(polyfit) == 3 and len(multi_worker) == 2
