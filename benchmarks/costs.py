"""What one training step costs on N GPUs under towers and under all-reduce: a model.

Used by ``benchmarks/devices.py``, which prints it beside what it measures here.

Per step every device computes the gradient of its share of the batch; then:

* **towers** (``towers.Towers``, the Effective TensorFlow ``make_parallel``): every
  other tower sends its gradient to the first device, which adds them up, applies
  them, and every tower reads the new variables from it. The first device receives
  (n - 1) G and sends (n - 1) G for a gradient of G bytes: its link carries it all.
* **all-reduce** (``mirrored``, ``multi_worker``; NCCL's ring): each device sends and
  receives 2 (n - 1) / n G and updates its own copy of the variables.

Across machines the busiest link is a machine's network card: the ring crosses it
with 2 (N - 1) / N G each way (N devices in all); gathering on one device would bring
(N - per_machine) G through the first machine's card.

Compute per step: training FLOPs of one example (3x the forward pass's multiply-adds
x 2) x examples per device, at a fraction ``UTILIZATION`` of the GPU's dense bf16
peak. Communication is not overlapped with compute (Keras's optimizer reduces after
the backward pass), so a step takes compute + bytes / bandwidth. A fixed cost per
reduction (NCCL's latency, tens of microseconds) is left out: it is alike for both.
"""

from __future__ import annotations

import dataclasses
import math

LINKS = {  # bytes/s each way of one device's link
    "NVLink 4": 450e9,  # H100 SXM: 900 GB/s both ways
    "PCIe 4 x16": 25e9,
    "100 Gb/s Ethernet": 12.5e9,
}
GPUS = {"A100": 312e12, "H100": 989e12}  # dense bf16 FLOP/s
UTILIZATION = 0.4  # of peak, a good large-model step
PER_DEVICE_BATCH = 128
LAYOUTS = [(2, 1), (8, 1), (8, 4)]  # (GPUs per machine, machines)


@dataclasses.dataclass(frozen=True)
class Network:
    """What a model brings to the model of a step: gradient bytes and FLOPs."""

    name: str
    parameters: int
    forward_flops: int  # per example

    @property
    def gradient_bytes(self) -> int:
        return 4 * self.parameters  # float32 gradients, also under mixed precision

    @property
    def train_flops(self) -> int:
        return 3 * self.forward_flops  # forward, and a backward pass of twice its cost


def describe(name: str, model_fn, image_shape: tuple[int, ...]) -> Network:
    """Parameters and forward FLOPs of a ModelFn, read from its traced graph."""
    import tensorflow as tf

    from trainer import Mode

    features = {"image": tf.TensorSpec([1, *image_shape], tf.float32)}
    labels = {"label": tf.TensorSpec([1], tf.int64)}
    graph = (
        tf.function(lambda feats, labs: model_fn(feats, labs, Mode.EVAL).loss)
        .get_concrete_function(features, labels)
        .graph
    )
    flops = 0
    for op in graph.get_operations():
        if op.type == "Conv2D":  # 2 x output elements x kernel height x width x input channels
            kernel = op.inputs[1].shape
            flops += 2 * math.prod(op.outputs[0].shape) * kernel[0] * kernel[1] * kernel[2]
        elif op.type == "MatMul":
            a = op.inputs[0].shape
            inner = a[0] if op.get_attr("transpose_a") else a[1]
            flops += 2 * math.prod(op.outputs[0].shape) * inner
    parameters = sum(math.prod(v.shape) for v in model_fn.trainable_variables)
    return Network(name, int(parameters), int(flops))


def networks() -> list[Network]:
    """The guide's: the ImageNet AlexNet (experiments/alexnet_imagenet.gin), ResNet-50
    (experiments/imagenet_resnet50.gin) and the MLP."""
    from models.alexnet import AlexNet
    from models.mlp import MLP
    from models.resnet import ResNet

    alexnet = AlexNet(
        num_classes=1000,
        conv_filters=[96, 256, 384, 384, 256],
        kernel_size=[11, 5, 3, 3, 3],
        strides=[4, 1, 1, 1, 1],
        pool_size=[3, 3, 0, 0, 3],
        pool_strides=2,
        dense_units=[4096, 4096],
    )
    return [
        describe("AlexNet (ImageNet)", alexnet, (224, 224, 3)),
        describe("ResNet-50 (ImageNet)", ResNet(depth=50, num_classes=1000), (224, 224, 3)),
        describe("MLP 784-512-512-10", MLP(hidden_units=[512, 512]), (28, 28, 1)),
    ]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's model on one layout, link and GPU; times in seconds."""

    compute: float
    towers_bytes: float  # through the busiest link, each way
    ring_bytes: float
    towers: float  # communication time
    ring: float

    def efficiency(self, comm: float) -> float:
        """The share of the step spent computing."""
        return self.compute / (self.compute + comm)


def step(network: Network, per_machine: int, machines: int, link: float, gpu: float) -> Step:
    """The model of a step: see the module's docstring."""
    g = network.gradient_bytes
    n = per_machine * machines
    compute = PER_DEVICE_BATCH * network.train_flops / (gpu * UTILIZATION)
    towers = (n - 1) * g if machines == 1 else (n - per_machine) * g
    ring = 2 * (n - 1) / n * g
    return Step(compute, towers, ring, towers / link, ring / link)


def table(networks: list[Network]) -> list[str]:
    """The guide's table: per layout and link, bytes and time of towers and all-reduce.

    Within one machine the link is NVLink or PCIe; across machines the network card.
    """
    lines = [
        "| model | GPUs | link | busiest link per step, towers / all-reduce | "
        "communication, towers / all-reduce | H100 step efficiency, towers / all-reduce |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for network in networks:
        for per_machine, machines in LAYOUTS:
            links = ["NVLink 4", "PCIe 4 x16"] if machines == 1 else ["100 Gb/s Ethernet"]
            for link in links:
                s = step(network, per_machine, machines, LINKS[link], GPUS["H100"])
                where = f"{per_machine}" if machines == 1 else f"{per_machine} x {machines}"
                lines.append(
                    f"| {network.name} | {where} | {link} | "
                    f"{_bytes(s.towers_bytes)} / {_bytes(s.ring_bytes)} | "
                    f"{_time(s.towers)} / {_time(s.ring)} | "
                    f"{s.efficiency(s.towers):.0%} / {s.efficiency(s.ring):.0%} |"
                )
    return lines


def compute_lines(networks: list[Network]) -> list[str]:
    """The compute side: FLOPs and the step's compute time per GPU."""
    lines = []
    for network in networks:
        times = ", ".join(
            f"{gpu} {_time(PER_DEVICE_BATCH * network.train_flops / (peak * UTILIZATION))}"
            for gpu, peak in GPUS.items()
        )
        lines.append(
            f"{network.name}: {network.parameters / 1e6:.2f}M parameters "
            f"({_bytes(network.gradient_bytes)} of gradient), "
            f"{network.train_flops / 1e9:.3g} GFLOP to train one example; "
            f"compute of {PER_DEVICE_BATCH} examples per GPU: {times}"
        )
    return lines


def _bytes(count: float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def _time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"
