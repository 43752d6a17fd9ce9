"""DPO's reference pass: the reference model scores every prepared pair, once.

``score`` runs an Estimator whose model_dir is the reference model's over every
split of prepared pairs, in PREDICT (``PreferenceModel`` scores a pair there), and
keeps each split's log-probabilities of both answers of every pair beside the
shards (``datasets.chat.scores``), where DPO training reads them by row. The pairs
are read shortest first, so that each batch pads little, and the scores are put
back by row. It costs one forward pass of each pair, against one a step for every
epoch when a second model is held in memory; its time is said per split. The
command is ``python3 -m trainer.cli.reference --gin_file experiments/stdlib_dpo.gin``.
"""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from datasets.chat import input_fns, scores
from datasets.records import shards
from datasets.text import input_fns as text
from trainer import Estimator, UserError, checkpoints


def score(estimator: Estimator, data_dir: str, reference: str) -> dict[str, np.ndarray]:
    """Every split's ``[pairs, 2]`` log-probabilities under ``reference``'s newest checkpoint.

    ``estimator``'s model_dir is ``reference``; its model scores pairs in PREDICT
    (``PreferenceModel``).
    """
    scorer = scores.identity(reference)
    step = checkpoints.step_of(scorer["checkpoint"])  # that one, should another be written
    metadata = shards.read_metadata(data_dir)
    found = {}
    for split, entry in metadata["splits"].items():
        started = time.perf_counter()
        order = np.argsort(text.kept_lengths(data_dir, entry), kind="stable")  # less padding
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
