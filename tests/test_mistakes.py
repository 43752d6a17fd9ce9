"""The mistake table (docs/guide/troubleshooting.md), one ``python -m trainer`` run per row.

Each row makes one mistake against a copy of a trained model_dir (checkpoints at
steps 50 and 100) and checks what the user is promised: exit code 2, exactly one
line on stderr that says what to fix, no traceback, and every file of the model_dir
byte for byte as it was. ``test_readme_table_and_the_tests_agree`` keeps the guide's
table and these rows (and the fault tests it names) the same. The commands are forks
of one process that has imported the command line (``tests/support/forked.py``): the
same command, without 69 imports of TensorFlow.
"""

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import guides
from tests.support.commands import REPO
from tests.support.helpers import dir_hash


@dataclass
class Mistake:
    """Where a row makes its mistake: ``tmp`` for files, the model_dir to keep."""

    tmp: Path
    model_dir: Path
    faulty_gin: str
    data_dir: str

    def file(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.write_text(text)
        return str(path)

    def damaged_data(self, damage: str) -> str:
        """A copy of the data_dir whose digits test shard is corrupt or missing."""
        copy = self.tmp / "data"
        shutil.copytree(self.data_dir, copy)
        shard = copy / "digits" / "1.0.0" / "digits-test.tfrecord-00000-of-00001"
        if damage == "corrupt":
            data = bytearray(shard.read_bytes())
            data[3000:3100] = b"x" * 100
            shard.write_bytes(bytes(data))
        else:
            shard.unlink()
        return f"digits.input_fn.data_dir = '{copy}'"


def gin(*bindings):
    """``--gin_param`` flags on top of the trained run's own command."""
    return lambda m: [arg for binding in bindings for arg in ("--gin_param", binding)]


def changed(*bindings):
    """A change of model or data under the checkpoints, with --overwrite_config."""
    return lambda m: [*gin(*bindings, "experiment.max_steps = 200")(m), "--overwrite_config"]


def record(m, appended):
    """Appends to the trained run's config record; no arguments."""
    path = m.model_dir / "operative_config.gin"
    path.write_text(path.read_text() + appended)
    return []


def written(m, name, text):
    """Writes ``text`` to a file of the trained run's model_dir; no arguments."""
    path = m.model_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return []


def flags(*args):
    return lambda m: list(args)


# Each row: (its arguments, given the Mistake; the stderr line as a regular
# expression, where {model_dir} and {tmp} stand for those paths). The run's command
# is the trained run's (--gin_file faulty.gin --model_dir DIR) plus the arguments,
# unless they give a --model_dir themselves.
ROWS = {
    # ---- the config
    "gin_syntax_error": (
        lambda m: ["--gin_file", m.file("bad.gin", "# header\nMLP.hidden_units = [256,\n 256\n")],
        r"{tmp}/bad\.gin:2: gin syntax error: a bracket opened here is never closed",
    ),
    "bracket_left_open_before_a_binding": (
        lambda m: [
            "--gin_file",
            m.file("open.gin", "# header\nMLP.hidden_units = [256, 256\nAdam.epsilon = 1e-7\n"),
        ],
        r"{tmp}/open\.gin:2: gin syntax error: a bracket opened here is never closed",
    ),
    "missing_include": (
        lambda m: ["--gin_file", m.file("inc.gin", "# header\ninclude 'experiments/base.gin'\n")],
        r"{tmp}/inc\.gin:2: include 'experiments/base\.gin' not found in the working directory "
        + re.escape(REPO)
        + r" nor above the gin file: run from the directory it is relative to, or include it "
        r"by its absolute path",
    ),
    "unknown_configurable": (
        gin("Estimater.steps_per_loop = 5"),
        r"--gin_param: No configurable matching 'Estimater'; did you mean 'Estimator'\?",
    ),
    "unused_command_line_macro": (
        gin("max_steps=50"),
        r"--gin_param 'max_steps=50' sets nothing: without a 'Configurable\.' in front, "
        r"max_steps is a macro no setting uses \(write 'experiment\.max_steps = 50'\)",
    ),
    "reference_without_at": (
        gin("Estimator.optimizer = SGD()"),
        r"--gin_param:1: gin syntax error: SGD is not a value gin knows \(in "
        r"'Estimator\.optimizer = SGD\(\)'\): write @SGD\(\) for a new instance of a "
        r"configurable, @SGD for the class or function itself, or 'SGD' with quotes for a string",
    ),
    "colon_for_equals": (
        gin("experiment.max_steps:500"),
        r"--gin_param:1: gin syntax error: a binding is 'name = value': "
        r"write 'experiment\.max_steps = 500'",
    ),
    "quoted_reference": (
        gin("Estimator.optimizer = '@SGD()'"),
        r"optimizer must be a Keras optimizer instance, got the string '@SGD\(\)' \(in gin, "
        r"write @SGD\(\) without quotes\)",
    ),
    "configurable_in_lower_case": (
        gin("mlp.dropout_rate = 0.2"),
        r"--gin_param: No configurable matching 'mlp'; did you mean 'MLP'\?",
    ),
    "unknown_reference": (
        gin("experiment.model_fn = @MLPP()"),
        r"--gin_param: No configurable matching reference '@MLPP\(\)'; did you mean 'MLP'\?",
    ),
    "unknown_parameter": (
        lambda m: ["--gin_file", m.file("b.gin", "# header\nMLP.hidden_unit = [4]\n")],
        r"{tmp}/b\.gin:2: Configurable 'MLP' doesn't have a parameter named 'hidden_unit'; "
        r"did you mean 'hidden_units'\?",
    ),
    "callback_only_fit_runs": (
        gin("experiment.callbacks = [@callbacks.TensorBoard()]", "experiment.max_steps = 200"),
        r"keras\.callbacks\.TensorBoard works only inside model\.fit: the framework writes "
        r"TensorBoard event files to model_dir \(Summaries for histograms, images and the "
        r"profiler\)",
    ),
    "export_format_without_export": (
        lambda m: ["--schedule", "train", "--export_format", "tflite"],
        r"--export_format applies to --schedule export; --schedule=train writes no export: run "
        r"it, then --schedule export --export_format tflite",
    ),
    "flat_estimator_argument": (
        gin("Estimator.save_checkpoints_steps = 500"),
        r"--gin_param: Configurable 'Estimator' doesn't have a parameter named "
        r"'save_checkpoints_steps': it is Checkpoints\.every_steps now \(trainer/settings\.py\): "
        r"write 'Checkpoints\.every_steps = \.\.\.' instead",
    ),
    "ambiguous_parameter": (
        gin("Estimator.batch_size = 64"),
        r"--gin_param: Configurable 'Estimator' doesn't have a parameter named 'batch_size'; "
        r"did you mean 'eval_batch_size' or 'global_batch_size'\?",
    ),
    "module_not_imported": (
        gin("experiment.model_fn = @AlexNet()"),
        r"--gin_param: No configurable matching reference '@AlexNet\(\)'; it is in "
        r"models\.alexnet: add 'import models\.alexnet' to the \.gin file",
    ),
    "misspelt_import": (
        gin("import modles.mlp"),
        r"--gin_param: No module named 'modles'; did you mean 'models'.*\?",
    ),
    "moved_module": (
        gin("import datasets.tfrecord"),
        r"--gin_param: No module named 'datasets\.tfrecord'; it is datasets\.records\.tfrecord "
        r"now: write 'import datasets\.records\.tfrecord' instead",
    ),
    "configurable_in_a_package_not_imported": (
        gin("experiment.input_fn = @text.input_fn"),
        r"--gin_param: No configurable matching reference '@text\.input_fn'; it is in "
        r"datasets\.text\.input_fns: add 'import datasets\.text\.input_fns' to the \.gin file",
    ),
    "missing_gin_file": (
        lambda m: ["--gin_file", "experiments/nope.gin", "--model_dir", str(m.model_dir)],
        r"--gin_file=experiments/nope\.gin: no such file; experiments here: .*digits_mlp.*",
    ),
    "missing_required_binding": (
        lambda m: [
            "--gin_file",
            m.file("lone.gin", "import models.mlp\nexperiment.model_fn = @MLP()\n"),
            "--model_dir",
            str(m.model_dir),
        ],
        r"experiment needs values for input_fn, max_steps: add e\.g\. "
        r"'experiment\.input_fn = \.\.\.' to the \.gin file, or --gin_param",
    ),
    "undefined_macro": (
        gin("experiment.max_steps = %MAX_STEP"),
        r"%MAX_STEP is used but never given a value: add 'MAX_STEP = \.\.\.' to a \.gin file",
    ),
    "wrong_value_type": (
        gin("experiment.max_steps = 'many'"),
        r"experiment\.max_steps must be a whole number, got 'many'",
    ),
    "zero_steps_per_loop": (
        gin("Estimator.steps_per_loop = 0"),
        r"Estimator\.steps_per_loop must be a whole number >= 1, got 0",
    ),
    "keras_gradient_accumulation": (
        gin("Adam.gradient_accumulation_steps = 4"),
        r"the optimizer has gradient_accumulation_steps=4, which counts every slice as a step: "
        r"drop it and set Optimization\.microbatches = 4 \(one step stays one update of the "
        r"whole batch\)",
    ),
    "unknown_nan_policy": (
        gin("Optimization.nonfinite_loss = 'ignore'"),
        r"Optimization\.nonfinite_loss must be 'stop' or 'rollback', got 'ignore'",
    ),
    "model_class_not_instance": (
        gin("experiment.model_fn = @MLP"),
        r"model_fn must be a trainer\.ModelFn or a keras\.Model instance, got the class MLP "
        r"\(in gin, write @MLP\(\) with parentheses\)",
    ),
    "constructor_refuses_a_setting": (
        changed("MLP.hidden_units = [-5]"),
        r"MLP\(num_classes=10, hidden_units=\[-5\], dropout_rate=0\.1\) failed: Received an "
        r"invalid value for `units`, expected a positive integer\. Received: units=-5",
    ),
    "one_value_for_a_list": (
        gin("MLP.hidden_units = 256"),
        r"MLP\.hidden_units must be a list of whole numbers, got 256: write \[256\]",
    ),
    "quoted_number_of_a_model": (
        gin("MLP.l2 = '1e-4'"),
        r"MLP\.l2 must be a number, got '1e-4' \(in gin, write 1e-4 without quotes\)",
    ),
    "input_fn_not_a_function": (
        changed("experiment.input_fn = 3"),
        r"the input_fn for mode 'eval' must be a function \(mode, params\) -> tf\.data\.Dataset, "
        r"got int 3 \(in gin, name it without parentheses: @my_input_fn\)",
    ),
    "input_fn_called_in_gin": (
        gin("experiment.input_fn = @faulty_digits()"),
        r"faulty_digits is called in the gin file \(faulty_digits\(\) missing 2 required "
        r"positional arguments: 'mode' and 'params'\): name an input_fn without parentheses",
    ),
    "optimizer_class_not_instance": (
        gin("Estimator.optimizer = @SGD"),
        r"optimizer must be a Keras optimizer instance, got the class SGD \(in gin, write "
        r"@SGD\(\) with parentheses\)",
    ),
    "changed_config": (
        gin("MLP.dropout_rate = 0.2", "Adam.learning_rate = 0.01", "experiment.max_steps = 200"),
        r"the config differs from the one the checkpoints in this model_dir were trained with: "
        r"Adam\.learning_rate: 0\.001 -> 0\.01; MLP\.dropout_rate: 0\.1 -> 0\.2\. "
        r"Use a new --model_dir, or --overwrite_config to resume anyway",
    ),
    "changed_config_the_checkpoints_cannot_fit": (
        gin("MLP.hidden_units = [128]", "Adam.learning_rate = 0.01", "experiment.max_steps = 200"),
        r"the config differs from the one the checkpoints in this model_dir were trained with "
        r"\(Adam\.learning_rate: 0\.001 -> 0\.01; MLP\.hidden_units: \[256, 256\] -> \[128\]\), "
        r"and they do not fit the model it makes \(logits/kernel has shape \(128, 10\), "
        r"which no saved value has\): use a new --model_dir, or restore the config they were "
        r"trained with",
    ),
    "changed_optimizer_said_in_few_items": (
        gin("Estimator.optimizer = @SGD()", "experiment.max_steps = 200"),
        r"the config differs from the one the checkpoints in this model_dir were trained with: "
        r"Adam: 15 bindings -> \(unset\); Estimator\.optimizer: @Adam\(\) -> @SGD\(\); "
        r"SGD: \(unset\) -> 13 bindings\. Use a new --model_dir, or --overwrite_config to "
        r"resume anyway",
    ),
    "another_models_model_dir": (
        gin("import models.keras_cnn", "experiment.model_fn = @keras_cnn()"),
        r"the checkpoints in this model_dir are of another model \(experiment\.model_fn: "
        r"@MLP\(\) -> @keras_cnn\(\)\): train this one in a new --model_dir",
    ),
    "another_models_model_dir_predicted": (
        lambda m: [
            *gin("import models.keras_cnn", "experiment.model_fn = @keras_cnn()")(m),
            *("--schedule", "predict", "--results", str(m.tmp / "p.jsonl")),
        ],
        r"the checkpoints in this model_dir are of another model \(experiment\.model_fn: "
        r"@MLP\(\) -> @keras_cnn\(\)\): evaluate, predict or export it with the config it "
        r"was trained with \({model_dir}/operative_config\.gin\)",
    ),
    # ---- the command line
    "unknown_flag_that_is_a_setting": (
        flags("--max_steps=500"),
        r"unknown flag --max_steps: it is a gin setting, e\.g\. "
        r"--gin_param 'experiment\.max_steps = 500'",
    ),
    "keras_batch_size_flag": (
        flags("--batch_size=256"),
        r"unknown flag --batch_size: the training batch, over all devices, is "
        r"--gin_param 'Estimator\.global_batch_size = 256' \(Estimator\.eval_batch_size is "
        r"evaluation's\)",
    ),
    "keras_epochs_flag": (
        flags("--epochs=10"),
        r"unknown flag --epochs: training runs to a step, not an epoch: --gin_param "
        r"'experiment\.max_steps = N' with N = 10 x training examples / "
        r"Estimator\.global_batch_size",
    ),
    "keras_lr_flag": (
        flags("--lr=0.01"),
        r"unknown flag --lr: the learning rate is the optimizer's, e\.g\. --gin_param "
        r"'Adam\.learning_rate = 0\.01' for the optimizer Estimator\.optimizer names",
    ),
    "misspelt_flag": (
        flags("--model-dir=x"),
        r"unknown flag --model-dir; did you mean --model_dir\?",
    ),
    "unknown_schedule": (
        flags("--schedule", "fly"),
        r"flag --schedule=fly: value should be one of <train\|evaluate\|train_and_evaluate\|"
        r"continuous_eval\|predict\|export> \(see --help\)",
    ),
    "positional_argument": (
        flags("extra"),
        r"unexpected arguments \['extra'\]: every option is a --flag \(see --help\)",
    ),
    "unquoted_binding": (
        flags("--gin_param", "Adam.learning_rate", "=", "0.01"),
        r"--gin_param Adam\.learning_rate = 0\.01 was split by the shell at its spaces: "
        r"quote the binding, --gin_param 'Adam\.learning_rate = 0\.01'",
    ),
    "num_devices_not_a_number": (
        flags("--num_devices", "two"),
        r"num_devices must be 'auto' or a number, got 'two'",
    ),
    "profile_steps_not_a_range": (
        flags("--profile_steps", "10"),
        r"--profile_steps=10: give START,STOP global steps with START < STOP, e\.g\. 100,110",
    ),
    "predict_without_results": (
        flags("--schedule", "predict"),
        r"--schedule=predict needs --results=PATH\.jsonl to write to",
    ),
    "results_through_a_file": (
        lambda m: ["--results", m.file("afile", "") + "/results.json"],
        r"--results={tmp}/afile is a file, not a directory; choose a directory",
    ),
    "results_a_directory": (
        lambda m: ["--results", str(m.tmp)],
        r"--results={tmp} is a directory; name a file in it, e\.g\. {tmp}/results\.json",
    ),
    "results_over_the_runs_own_file": (
        lambda m: ["--results", str(m.model_dir / "checkpoint")],
        r"--results={model_dir}/checkpoint would overwrite a file of the run in {model_dir}: "
        r"name another file, e\.g\. {model_dir}/results\.json",
    ),
    "config_record_unreadable": (
        lambda m: [*record(m, "MLP.hidden_units = [256,\n"), *gin("experiment.max_steps = 150")(m)],
        r"{model_dir}/operative_config\.gin:\d+: gin syntax error: a bracket opened here is "
        r"never closed; it records the config this model_dir was trained with: restore it, or "
        r"pass --overwrite_config to resume with this run's config",
    ),
    "best_export_ranking_unreadable": (
        lambda m: [
            *written(m, "export/best/best.json", '[{"step": 50, "val'),
            *gin("BestExport.metric = 'accuracy'", "experiment.max_steps = 150")(m),
        ],
        r"{model_dir}/export/best/best\.json is unreadable \(.*\): it ranks the best exports; "
        r"restore it, or move it and the exports beside it away to rank anew",
    ),
    "model_dir_through_a_file": (
        lambda m: ["--gin_file", m.faulty_gin, "--model_dir", m.file("afile", "") + "/run"],
        r"--model_dir={tmp}/afile/run is not writable \(Not a directory\); "
        r"choose a directory you can write to",
    ),
    # ---- the model's and the input_fn's contracts
    "no_loss": (
        changed("experiment.model_fn = @NoLoss()"),
        r"NoLoss\(mode='train'\): Spec\.loss is required in train mode",
    ),
    "tuple_input": (
        changed("experiment.input_fn = @tuple_digits"),
        r"MLP cannot take the input_fn's features \[128, 8, 8, 1\]: features and labels must be "
        r"dicts of tensors, not bare tensors: end the input_fn with dataset\.map\(lambda image, "
        r"label: \({{'image': image}}, {{'label': label}}\)\) and look them up by key in the model",
    ),
    "feature_not_given": (
        changed("MLP.image_key = 'pixels'"),
        r"MLP looks up 'pixels', which the input_fn does not give \(features 'image'; labels "
        r"'label'\): name it 'pixels' in the input_fn, or set MLP.image_key to one of them",
    ),
    "input_fn_not_a_dataset": (
        changed("faulty_digits.fault = 'not_a_dataset'"),
        r"input_fn faulty_digits returned list for mode 'train'; it must return a "
        r"tf\.data\.Dataset of \(features, labels\)",
    ),
    # ---- a Keras model
    "keras_inputs_match_no_feature": (
        changed("experiment.model_fn = @faulty_keras()", "faulty_keras.fault = 'inputs'"),
        r"Keras model 'two_inputs' has inputs \['pixels', 'ink'\], but the input_fn gives "
        r"features \['image'\]: name each keras\.Input like the feature it takes "
        r"\(keras\.Input\(\.\.\., name='image'\)\)",
    ),
    "keras_loss_does_not_fit_the_labels": (
        changed("experiment.model_fn = @faulty_keras()", "faulty_keras.fault = 'loss'"),
        r"Keras model 'faulty': loss 'categorical_crossentropy' does not fit output 'output' "
        r"of shape \(128, 10\) and its label of shape \(128,\) \(int64\): compile "
        r"with a loss for these labels \(class ids take sparse_categorical_crossentropy\)",
    ),
    "keras_model_without_loss": (
        changed("experiment.model_fn = @faulty_keras()", "faulty_keras.fault = 'uncompiled'"),
        r"Keras model 'faulty' has no loss: compile it with model\.compile\(loss=\.\.\.\), "
        r"or pass trainer\.KerasModel\(model, loss=\.\.\.\)",
    ),
    "keras_metric_misspelt": (
        changed("experiment.model_fn = @faulty_keras()", "faulty_keras.fault = 'metric'"),
        r"Keras model 'faulty': metric 'acuracy' is not a Keras metric: did you mean "
        r"'accuracy'\? \(name a keras\.metrics function or class, or pass a "
        r"keras\.metrics\.Metric\)",
    ),
    # ---- the data
    "label_out_of_range": (
        changed("faulty_digits.fault = 'label'"),
        r"training step 101 failed: label out of range \[0, 10\); is num_classes right\? "
        r"\(got 1\d( 1\d)*(\.\.\.)?\)",
    ),
    "label_not_a_class_id": (
        changed("faulty_digits.fault = 'half_label'"),
        r"training step 101 failed: label must be a whole class id \(got \d\.5( \d\.5)*(\.\.\.)?\)",
    ),
    "training_data_runs_out": (
        changed("faulty_digits.fault = 'empty'"),
        # The restored prefetch buffer may still hold a batch or two; then the input ends.
        r"the training input ran out of data at step 10\d: an input_fn must repeat its data "
        r"in TRAIN mode \(dataset\.repeat\(\)\)",
    ),
    "corrupt_data_file": (
        lambda m: ["--schedule", "evaluate", "--gin_param", m.damaged_data("corrupt")],
        r"reading digits 'test': input data is corrupt \(corrupted record at 2990\b.*",
    ),
    "missing_data_file": (
        lambda m: ["--schedule", "evaluate", "--gin_param", m.damaged_data("missing")],
        r"reading digits 'test': input data is missing \({tmp}/data/digits/1\.0\.0/"
        r"digits-test\.tfrecord-00000-of-00001; No such file or directory\)",
    ),
    # ---- the checkpoints
    "checkpoint_of_another_model": (
        changed("MLP.hidden_units = [256, 128]"),
        r"checkpoint {model_dir}/ckpt-100 does not fit this model: logits/kernel has shape "
        r"\(128, 10\) here but \(256, 10\) in the checkpoint; train in a new --model_dir, or "
        r"restore the config this checkpoint was trained with",
    ),
    "images_of_another_size": (
        changed("faulty_digits.fault = 'shape'"),
        r"checkpoint {model_dir}/ckpt-100 does not fit this model: dense/dense_0/kernel has "
        r"shape \(16, 256\) here but \(64, 256\) in the checkpoint; .*",
    ),
    "batch_size_under_a_saved_iterator": (
        changed("Estimator.global_batch_size = 64"),
        r"{model_dir}/ckpt-100 holds the training input's tf\.data iterator, which batches 128 "
        r"examples, so global_batch_size cannot change to 64 there: keep 128, or train in a "
        r"new --model_dir \(a dataset read by position, as in datasets/, can change it\)",
    ),
    "evaluate_before_training": (
        lambda m: [*empty(m.model_dir), "--schedule", "evaluate"],
        r"no checkpoint in {model_dir}: train first \(--schedule train\) or point --model_dir "
        r"at a trained run",
    ),
}


def empty(directory: Path) -> list[str]:
    """Empties ``directory`` (a model_dir nothing was trained in); no arguments."""
    shutil.rmtree(directory)
    directory.mkdir()
    return []


@pytest.mark.slow
@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_mistake_is_one_line_and_changes_nothing(
    row, forked_cli, model_dir, faulty_gin, data_dir, tmp_path
):
    make_args, expected = ROWS[row]
    args = make_args(Mistake(tmp_path, model_dir, faulty_gin, data_dir))
    if "--model_dir" not in args:
        args = ["--gin_file", faulty_gin, "--model_dir", str(model_dir), *args]
    before = dir_hash(model_dir)
    proc = forked_cli.run(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    pattern = expected.format(model_dir=re.escape(str(model_dir)), tmp=re.escape(str(tmp_path)))
    assert re.fullmatch(f"error: {pattern}", lines[0]), lines[0]
    assert dir_hash(model_dir) == before


# The table's rows whose mistake needs more than one run, a signal or a resource limit:
# their tests live beside the other faults.
FAULT_TESTS = (
    "tests/test_faults.py",
    "tests/test_damaged_files.py",
    "tests/test_tfrecord.py",
    "tests/test_text.py",
    "tests/test_tables.py",
    "tests/test_lines.py",
    "tests/test_sft.py",
    "tests/test_preference.py",
    "tests/test_reference.py",
    "tests/test_lora.py",
    "tests/test_hub_sft.py",
)


def test_readme_table_and_the_tests_agree():
    table = re.split(r"\n#+ ", guides.text().split("\n## Every mistake, one line\n", 1)[1])[0]
    named = re.findall(r"^\|.*\| `([\w:.]+)` \|$", table, re.M)
    rows = [name for name in named if "::" not in name]
    assert sorted(rows) == sorted(ROWS)
    faults = {}
    for path in FAULT_TESTS:
        with open(os.path.join(REPO, path)) as f:
            faults[os.path.basename(path)] = f.read()
    for name in set(named) - set(rows):
        path, test = name.split("::")
        assert f"def {test}(" in faults.get(path, ""), name
    assert len(named) >= 30
