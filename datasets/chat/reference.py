"""DPO's reference pass: the reference model scores every prepared pair, once.

``score`` runs an Estimator whose model_dir is the reference model's over every
split of prepared pairs, in PREDICT (``PreferenceModel`` scores a pair there), and
keeps each split's log-probabilities of both answers of every pair beside the
shards (``datasets.chat.scores``), where DPO training reads them by row. The pairs
are read shortest first, so that each batch pads little, and the scores are put
back by row. It costs one forward pass of each pair, against one a step for every
epoch when a second model is held in memory; its time is said per split.

    python3 -m datasets.chat.reference --gin_file experiments/stdlib_dpo.gin

reads the experiment's gin files as ``python -m trainer`` does (a command, as that
one is: the only other module that imports ``trainer.cli``): the model (a
``PreferenceModel``), its precision and batch sizes, and ``chat.pairs_input_fn``'s
``data_dir`` and ``reference`` (the reference model's model_dir); then the newest
checkpoint there scores every pair once. Bad input ends in one line on stderr and
exit code 2.
"""

from __future__ import annotations

import sys
import time

if __name__ == "__main__":  # the command starts quietly, as python -m trainer does
    from trainer import console

    console.quiet_start(command_line=True)

import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from datasets.chat import input_fns, scores  # noqa: E402
from datasets.records import shards  # noqa: E402
from datasets.text import input_fns as text  # noqa: E402
from trainer import Estimator, UserError, checkpoints, errors, logs  # noqa: E402

FLAGS = flags.FLAGS


def score(
    estimator: Estimator, data_dir: str, reference: str, shortest_first: bool = True
) -> dict[str, np.ndarray]:
    """Every split's ``[pairs, 2]`` log-probabilities under ``reference``'s newest checkpoint.

    ``estimator``'s model_dir is ``reference``; its model scores pairs in PREDICT
    (``PreferenceModel``), shortest first unless ``shortest_first`` is False (the
    benchmark's comparison: in row order).
    """
    scorer = scores.identity(reference)
    step = checkpoints.step_of(scorer["checkpoint"])  # that one, should another be written
    metadata = shards.read_metadata(data_dir)
    found = {}
    for split, entry in metadata["splits"].items():
        started = time.perf_counter()
        order = np.arange(entry["count"])
        if shortest_first:  # less padding in each batch
            order = np.argsort(text.kept_lengths(data_dir, entry), kind="stable")
        predicted = estimator.predict(input_fns.scoring_input_fn(data_dir, split, order), step)
        values = np.array([_pair(p, estimator.model_fn) for p in predicted], np.float32)
        if len(values) != entry["count"]:
            raise UserError(
                f"scored {len(values):,} pairs of {data_dir}'s {split} split, which "
                f"holds {entry['count']:,}: prepare it again"
            )
        found[split] = np.empty_like(values)
        found[split][order] = values  # by row again
        logging.info(
            "Scored %s pairs of %s under %s in %.1f s",
            f"{len(found[split]):,}",
            split,
            scorer["checkpoint"],
            time.perf_counter() - started,
        )
    scores.write(data_dir, scorer, found, metadata)
    return found


def _pair(prediction: dict, model) -> tuple[float, float]:
    """A pair's two log-probabilities, from a model that scores pairs."""
    if "chosen_logps" not in prediction:
        raise UserError(
            f"experiment.model_fn is a {type(model).__name__}, which does not "
            "score pairs: the reference pass needs the DPO experiment's PreferenceModel"
        )
    return prediction["chosen_logps"], prediction["rejected_logps"]


def define_flags() -> None:
    """The command's flags, defined when it runs (``python -m trainer`` has its own)."""
    flags.DEFINE_multi_string("gin_file", [], "The DPO experiment's gin file; repeat to layer.")
    flags.DEFINE_multi_string("gin_param", [], "One more gin binding; repeat for more.")


def main(argv: list[str]) -> None:
    """Scores the pairs the gin files name; one line and exit 2 on bad input."""
    del argv
    logs.use_console()
    from trainer.cli import experiment, gin_config  # noqa: F401 (the experiment's bindings)
    from trainer.precision import set_precision

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
        found = score(estimator, data_dir, reference)
        for split, values in found.items():
            print(f"{split}: {len(values):,} pairs scored")
        print(f"wrote {data_dir}/{shards.SCORES}")
    except UserError as error:
        print(f"error: {errors.first_line(error)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
