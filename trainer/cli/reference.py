"""``python3 -m trainer.cli.reference --gin_file experiments/stdlib_dpo.gin``: DPO's reference pass.

It reads the experiment's gin files as ``python -m trainer`` does: the model (a
``PreferenceModel``), its precision and batch sizes, and ``chat.pairs_input_fn``'s
``data_dir`` and ``reference`` (the reference model's model_dir); then the newest
checkpoint there scores every pair once (``datasets.chat.reference``). Bad input
ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # the command starts quietly, as python -m trainer does
    from trainer import console

    console.quiet_start(command_line=True)

from absl import app, flags  # noqa: E402

from datasets.chat import reference as reference_pass  # noqa: E402
from datasets.records import shards  # noqa: E402
from trainer import UserError, errors, logs  # noqa: E402
from trainer.cli import experiment, gin_config  # noqa: E402, F401 (the experiment's bindings)
from trainer.precision import set_precision  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (``python -m trainer`` has its own)."""
    flags.DEFINE_multi_string("gin_file", [], "The DPO experiment's gin file; repeat to layer.")
    flags.DEFINE_multi_string("gin_param", [], "One more gin binding; repeat for more.")


def main(argv: list[str]) -> None:
    """Scores the pairs the gin files name; one line and exit 2 on bad input."""
    del argv
    logs.use_console()
    try:
        gin_config.parse(FLAGS.gin_file, FLAGS.gin_param)
        data_dir = gin_config.value("chat.pairs_input_fn.data_dir")
        reference = gin_config.value("chat.pairs_input_fn.reference")
        if data_dir is None or reference is None:
            raise UserError(
                "the reference pass scores the pairs of chat.pairs_input_fn.data_dir under "
                "chat.pairs_input_fn.reference (the reference model's model_dir): bind both "
                "in the gin file"
            )
        set_precision(gin_config.value("Devices.mixed_precision"))  # as training computes
        groups = {name: group() for name, group in gin_config.GROUPS.items()}
        model = gin_config.value("experiment.model_fn")
        estimator = gin_config.ConfiguredEstimator(
            model_fn=model, model_dir=reference, seed=0, **groups
        )
        found = reference_pass.score(estimator, data_dir, reference)
        for split, values in found.items():
            print(f"{split}: {len(values):,} pairs scored")
        print(f"wrote {data_dir}/{shards.SCORES}")
    except UserError as error:
        print(f"error: {errors.first_line(error)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
