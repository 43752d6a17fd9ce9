"""Fine-tuning a keras.applications backbone in the two phases of Keras's transfer guide."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from models.pretrained import Pretrained, scale_pixels
from tests.support import parity
from tests.support.backbones import make_backbone
from trainer import Mode, UserError

SIZE, CLASSES, BATCH, STEPS = 32, 3, 16, 3


def _data():
    rng = np.random.default_rng(2)
    x = rng.uniform(0.0, 1.0, (2 * STEPS * BATCH, SIZE, SIZE, 3)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) * 1000 % CLASSES).astype("int64")
    return x, y


def _input_fn(x, y):
    def input_fn(mode, params):
        dataset = tf.data.Dataset.from_tensor_slices(({"image": x}, {"label": y}))
        return dataset.repeat().batch(params.batch_size, drop_remainder=True)

    return input_fn


class Guide(keras.Model):
    """The guide's model: scaling, ``base_model(x, training=False)``, a new Dense head.

    Written as a subclassed model: Keras 3.15's functional model hands ``fit``'s
    ``training=True`` to every layer, overriding the ``training=False`` recorded in the
    graph (keras-team/keras#20285), so the guide's functional code runs its backbone's
    batch norm in training mode once unfrozen, which the guide says it must not.
    """

    def __init__(self, body):
        super().__init__()
        self.body, self.head = body, keras.layers.Dense(CLASSES, name="head")

    def call(self, x, training=False):
        return self.head(self.body(x * 2.0 - 1.0, training=False))  # MobileNet's [-1, 1]


def keras_guide(path, x, y, head):
    """The guide's two phases under Keras's own step: frozen body, then all at 1e-5."""
    body = keras.saving.load_model(path, compile=False)
    body.trainable = False
    model = Guide(body)
    model(x[:1])
    for variable, value in zip(model.head.weights, head, strict=True):
        variable.assign(value)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for phase, rate in enumerate((1e-3, 1e-5)):
        if phase:
            body.trainable = True
        model.compile(keras.optimizers.Adam(rate), loss, jit_compile=False)
        for step in range(STEPS):
            start = (phase * STEPS + step) * BATCH
            model.train_on_batch(x[start : start + BATCH], y[start : start + BATCH])
    return body, model.head


def framework_phases(path, x, y, tmp_path):
    """The same two phases as two runs: images_pretrained_head.gin, then _all.gin."""
    head = None
    for phase, rate in enumerate((1e-3, 1e-5)):
        model = Pretrained(path, num_classes=CLASSES, train_body=bool(phase), dropout_rate=0.0)
        model({"image": x[:1]}, None, Mode.PREDICT)  # builds the head
        if head is None:
            head = [w.numpy() for w in model.head.weights]
        part = slice(phase * STEPS * BATCH, (phase + 1) * STEPS * BATCH)
        estimator = trainer.Estimator(
            model,
            str(tmp_path / f"phase{phase}"),
            optimizer=keras.optimizers.Adam(rate),
            global_batch_size=BATCH,
            steps_per_loop=STEPS,
            progress=False,
            checkpoints=trainer.Checkpoints(every_steps=None),
            warm_start=trainer.WarmStart(str(tmp_path / "phase0") if phase else None),
        )
        estimator.train(_input_fn(x[part], y[part]), max_steps=STEPS)
    return model, head


@pytest.mark.slow
def test_the_two_phases_equal_kerass_guide_under_fit_and_batch_norm_never_moves(tmp_path):
    path = make_backbone(str(tmp_path / "mobilenet_v2.keras"))
    x, y = _data()
    model, head = framework_phases(path, x, y, tmp_path)
    body, dense = keras_guide(path, x, y, head)
    pairs = list(zip(model.body.weights, body.weights, strict=True))
    pairs += list(zip(model.head.weights, dense.weights, strict=True))
    worst = max(float(np.max(np.abs(ours.numpy() - theirs.numpy()))) for ours, theirs in pairs)
    assert worst <= parity.TOLERANCE[None], worst
    pretrained = keras.saving.load_model(path, compile=False)
    moved = [
        float(np.max(np.abs(ours.numpy() - before.numpy())))
        for ours, before in zip(model.body.weights, pretrained.weights, strict=True)
    ]
    names = [v.path for v in model.body.weights]
    statistics = [m for m, n in zip(moved, names, strict=True) if "moving" in n]
    trained = [m for m, n in zip(moved, names, strict=True) if "kernel" in n]
    assert len(statistics) == 54 and max(statistics) == 0.0  # 27 batch norms, never moved
    assert min(trained) > 0.0  # phase 2 trained every kernel of the body


def test_pixels_are_scaled_as_keras_applications_preprocess_input_does():
    image = np.random.default_rng(0).uniform(0, 1, (2, 4, 4, 3)).astype("float32")
    for mode in ("tf", "torch", "caffe"):
        expected = keras.applications.imagenet_utils.preprocess_input(image * 255.0, mode=mode)
        np.testing.assert_allclose(scale_pixels(tf.constant(image), mode), expected, atol=2e-4)


def test_a_missing_or_foreign_backbone_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"does not exist: save one first"):
        Pretrained(str(tmp_path / "none.keras"))
    (tmp_path / "weights.h5").write_bytes(b"x")
    with pytest.raises(UserError, match=r"is not a .keras file"):
        Pretrained(str(tmp_path / "weights.h5"))


def small_backbone(path):
    """A small convolutional backbone without its top, saved as a user saves one."""
    keras.utils.set_random_seed(0)
    body = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.GlobalAveragePooling2D(),
        ],
        name="small",
    )
    body.save(path)
    return str(path)


def test_a_damaged_backbone_file_or_grey_images_into_rgb_are_one_line(tmp_path):
    """A .keras file cut short (it said 'File not found'), one whose weights are damaged
    (an OSError traceback), and grey images into a backbone of 3 channels (Keras's
    '• kwargs=<class inspect._empty>')."""
    whole = small_backbone(tmp_path / "small.keras")
    data = open(whole, "rb").read()
    (tmp_path / "cut.keras").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError) as refused:
        Pretrained(str(tmp_path / "cut.keras"))
    assert str(refused.value).startswith(
        f"Pretrained.backbone = '{tmp_path}/cut.keras' is not a whole .keras file (a zip "
        "archive): copied or downloaded in part?"
    )
    import zipfile

    with zipfile.ZipFile(whole) as source, zipfile.ZipFile(tmp_path / "bad.keras", "w") as bad:
        for item in source.infolist():
            content = source.read(item)
            if item.filename.endswith(".h5"):
                content = content[:64] + b"\0" * (len(content) - 64)
            bad.writestr(item, content)
    with pytest.raises(UserError) as refused:
        Pretrained(str(tmp_path / "bad.keras"))
    said = str(refused.value).splitlines()  # gin adds its "In call to configurable" below
    assert said[0].startswith(f"Pretrained.backbone = '{tmp_path}/bad.keras' cannot be loaded (")
    assert said[0].endswith("): save it again with model.save(...)")

    grey = {"image": tf.zeros([2, 8, 8, 1])}
    with pytest.raises(UserError) as refused:
        Pretrained(whole, num_classes=2)(grey, None, Mode.PREDICT)
    assert str(refused.value) == (
        "the backbone small takes images of 3 channels, but 'image' has 1: convert them in "
        "the input_fn (tf.image.grayscale_to_rgb for grey images), or use a backbone made for 1"
    )
