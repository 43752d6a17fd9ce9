"""The towers' training step, op by op, for tests/test_parallel.py (run in a subprocess
that split its CPU into two logical devices: ``helpers.on_two_cpus``)."""

import tensorflow as tf

from models.mlp import MLP
from trainer import Devices, Estimator


def tower_placement(model_dir, kind="mlp"):
    """Each op of the towers' training step: its tower (None outside them), device, type
    and the towers of the ops it reads (run in a subprocess that made two logical CPUs).

    ``kind`` 'gan': the GAN's step, two losses and two optimizers."""
    import re

    from models.gan import GAN
    from trainer.model_fn import Mode

    def data(mode, params):
        x = tf.random.stateless_uniform([64, 8, 8, 1], [1, 2])
        features = {"image": x, "noise": tf.random.stateless_normal([64, 4], [3, 4])}
        labels = {"label": tf.zeros([64], tf.int64)}
        return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(32)

    model = MLP(num_classes=10, hidden_units=[16])
    if kind == "gan":
        model = GAN(generator_units=[16], discriminator_units=[16])
    estimator = Estimator(
        model,
        model_dir,
        global_batch_size=32,
        devices=Devices(distribution="towers", count=2),
        progress=False,
    )
    dataset = estimator.inputs.dataset(data, Mode.TRAIN)
    steps = estimator.model.build(dataset.element_spec, Mode.TRAIN)
    phase = steps.plan.phases[0]  # every optimizer: the step at global step 0
    step = tf.function(lambda x, y: steps._step(x, y, tf.constant(True), phase))
    graph = step.get_concrete_function(*dataset.element_spec).graph

    def tower(op):  # forward ops are named tower_i/..., their gradients gradient_tape/tower_i/...
        found = re.match(r"(gradient_tape/)?tower_(\d+)/", op.name)
        return int(found.group(2)) if found else None

    def handle(op):  # a variable's handle, or its read: the parameters every tower shares
        return op.type in ("Placeholder", "ReadVariableOp") and op.outputs[0].dtype in (
            tf.resource,
            *[v.dtype for v in estimator.model_fn.trainable_variables],
        )

    return [
        {
            "name": op.name,
            "tower": tower(op),
            "device": op.device,
            "type": op.type,
            "shared": handle(op),
            "reads": sorted({tower(i.op) for i in op.inputs if not handle(i.op)} - {None}),
        }
        for op in graph.get_operations()
    ]
