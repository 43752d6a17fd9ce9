"""Research models beyond one loss: what a model reports beside its loss."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from tests.support.body_head import line_data
from tests.support.helpers import event_tags, scalar_series


class TwoPartLoss(trainer.ModelFn):
    """A squared error plus an L1 pull on the weights: each part reported as a scalar."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def __call__(self, features, labels, mode):
        y = self.dense(features["x"])[:, 0]
        if labels is None:
            return trainer.Spec({"y": y})
        squared = tf.reduce_mean((y - labels["y"]) ** 2)
        pull = 0.01 * tf.add_n([tf.reduce_sum(tf.abs(w)) for w in self.dense.weights])
        return trainer.Spec(
            {"y": y},
            loss=squared + pull,
            metrics={"abs_error": tf.abs(y - labels["y"])},
            scalars={"squared_error": squared, "pull": pull},
        )


def test_a_models_scalars_are_logged_beside_its_loss_in_training_and_evaluation(tmp_path):
    estimator = trainer.Estimator(
        TwoPartLoss(),
        str(tmp_path),
        global_batch_size=32,
        log_every_steps=50,
        optimizer=keras.optimizers.Adam(0.05),
        progress=False,
    )
    final = estimator.train_and_evaluate(line_data, line_data, 200, eval_every_steps=100)
    result = final["eval"]
    assert sorted(result) == ["abs_error", "loss", "pull", "squared_error"]
    assert result["loss"] == pytest.approx(result["squared_error"] + result["pull"], rel=1e-5)
    assert 0.0 < result["squared_error"] < 0.05 and 0.02 < result["pull"] < 0.04

    assert {"pull", "squared_error", "loss"} <= event_tags(str(tmp_path / "train"))
    trained = dict(scalar_series(str(tmp_path / "train"), "pull"))
    assert sorted(trained) == [50, 100, 150, 200]
    assert trained[200] == pytest.approx(0.01 * np.abs(estimator_weights(estimator)).sum(), 0.1)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["writer"] == "train"]
    assert all("pull" in r and "squared_error" in r for r in train_rows)
    eval_rows = [r for r in rows if r["writer"] == "eval_eval"]
    assert eval_rows[-1]["pull"] == pytest.approx(result["pull"])


def estimator_weights(estimator):
    return np.concatenate([w.numpy().ravel() for w in estimator.model_fn.dense.weights])


@pytest.mark.parametrize(
    "scalars, message",
    [
        ({"part": tf.zeros([4])}, "scalar 'part' must be one number, got (4,)"),
        ({"abs_error": tf.zeros([])}, "scalar 'abs_error' has the name of a metric or of the loss"),
    ],
)
def test_a_scalar_that_is_not_one_number_or_reuses_a_name_is_refused(scalars, message):
    from trainer.model_fn import check_spec

    spec = trainer.Spec(
        {"y": tf.zeros([4])}, tf.zeros([]), {"abs_error": tf.zeros([4])}, scalars=scalars
    )
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_spec(spec, trainer.Mode.TRAIN, "M")
