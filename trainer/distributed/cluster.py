"""Where the workers of a ``multi_worker`` run are: TF_CONFIG, else SLURM's job step.

``TF_CONFIG`` names the cluster and this worker, as TensorFlow reads it. Started by
``srun`` without one, each task finds the cluster in SLURM's variables (TensorFlow's
``SlurmClusterResolver``: the step's nodes, its tasks per node, this task's rank)
and writes it as TF_CONFIG, so that TensorFlow reads one description. The framework
reads TF_CONFIG here only: ``find`` parses and checks it once, and the ``Cluster`` it
returns is passed on (``strategies.make_strategy`` keeps the process's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

import tensorflow as tf
from absl import logging

from trainer.distributed import preemption, rendezvous
from trainer.errors import UserError

T = TypeVar("T")
STARTUP_TIMEOUT = 300  # seconds for every worker to join: Devices.startup_timeout

SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NODELIST")  # a task of a job step has them


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A multi-worker run's cluster and this worker's place in it, from TF_CONFIG.

    Attributes:
      spec: TF_CONFIG's ``cluster``: ``{'worker': ['host:port', ...]}`` (and a 'chief').
      addresses: every worker's address, the chief first, as the replicas are ordered.
      index: this worker's place in ``addresses``.
      name: this worker as the messages name it: ``'worker 1 of 2'``.
    """

    spec: dict
    addresses: tuple[str, ...]
    index: int
    name: str

    @property
    def address(self) -> str:
        """This worker's ``host:port``."""
        return self.addresses[self.index]

    @property
    def where(self) -> tuple[str, str]:
        """``('worker 1 of 2', '10.0.0.2:2222')``."""
        return self.name, self.address


def find() -> Cluster:
    """The cluster TF_CONFIG describes, and this worker in it; checked once, here.

    TF_CONFIG is set from SLURM's job step first when it is unset.

    Raises:
      UserError: no cluster is described, or TF_CONFIG is malformed; one line each.
    """
    if not os.environ.get("TF_CONFIG"):
        if not all(name in os.environ for name in SLURM_VARIABLES):
            raise UserError(
                "distribution 'multi_worker' needs its cluster: TF_CONFIG is not set and "
                f"this is not a task of a SLURM job step ({' and '.join(SLURM_VARIABLES)} "
                "are not set); set TF_CONFIG on each worker (see docs/guide/"
                "parallel.md, 'Several machines'), or start the workers with srun"
            )
        os.environ["TF_CONFIG"] = slurm_tf_config()
        logging.info("TF_CONFIG from SLURM's job step: %s", os.environ["TF_CONFIG"])
    found = _check_tf_config()
    _bypass_proxies(found.spec)
    return found


PROXIES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy")


def _bypass_proxies(spec: dict) -> None:
    """Keeps the workers' traffic off an HTTP proxy the environment names.

    gRPC follows ``http_proxy`` and its like: the workers would talk through the proxy,
    or hang where it cannot reach them. Their hosts are added to ``no_grpc_proxy``.
    """
    if not any(os.environ.get(name) for name in PROXIES):
        return
    hosts = sorted({address.rsplit(":", 1)[0] for tasks in spec.values() for address in tasks})
    kept = [h for h in os.environ.get("no_grpc_proxy", "").split(",") if h]
    os.environ["no_grpc_proxy"] = ",".join(dict.fromkeys([*kept, *hosts]))
    logging.info("An HTTP proxy is set: the workers reach each other without it (%s)", hosts)


PORT_BASE = 8888  # TensorFlow's resolver's, used outside a SLURM job
PORT_RANGE = (10000, 32000)  # below Linux's ephemeral ports (32768-60999)
PORTS_PER_JOB = 32  # a block per job: that many tasks per node at most


def slurm_tf_config() -> str:
    """The TF_CONFIG that SLURM's variables describe: a worker per task.

    Run before TensorFlow touches a device: with several tasks on a node each is given
    its share of the node's GPUs (``CUDA_VISIBLE_DEVICES``), which TensorFlow reads
    once, when it first lists them.
    """
    # Told of GPUs enough not to refuse, the resolver only names hosts and ports; the
    # GPUs are shared out below, where a node with fewer GPUs than tasks is one line.
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=slurm_port_base(), auto_set_gpu=False, gpus_per_node=1 << 16, gpus_per_task=1
    )
    try:
        spec = resolver.cluster_spec().as_dict()
    except (RuntimeError, ValueError, KeyError) as error:
        raise UserError(f"SLURM's variables do not describe a cluster: {error}") from None
    task = {"type": resolver.task_type, "index": resolver.task_id}
    addresses = spec[resolver.task_type]
    host = addresses[resolver.task_id].rpartition(":")[0]
    here = [i for i, address in enumerate(addresses) if address.rpartition(":")[0] == host]
    local = int(os.environ.get("SLURM_LOCALID", here.index(resolver.task_id)))
    _share_gpus(len(here), local, host)
    return json.dumps({"cluster": spec, "task": task})


def slurm_port_base() -> int:
    """The first port of this job step's workers on each node.

    The ports SLURM reserved for the step (``srun --resv-ports``) when it did; else
    a block of ``PORTS_PER_JOB`` chosen by the job id, so that two jobs sharing a node
    listen on different ports (unless their ids differ by a multiple of the 687
    blocks); TensorFlow's 8888 outside a job.
    """
    reserved = re.match(r"\d+", os.environ.get("SLURM_STEP_RESV_PORTS", ""))
    if reserved:
        return int(reserved.group())
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return PORT_BASE
    blocks = (PORT_RANGE[1] - PORT_RANGE[0]) // PORTS_PER_JOB
    return PORT_RANGE[0] + int(job) % blocks * PORTS_PER_JOB


def _share_gpus(tasks_here: int, local: int, host: str) -> None:
    """Gives the ``local``-th of a node's ``tasks_here`` tasks its share of the GPUs.

    Nothing changes for one task per node, or where SLURM gave each task its own
    GPUs (``--gpus-per-task``). The node's GPUs are those ``CUDA_VISIBLE_DEVICES``
    names (SLURM's ``--gres`` sets it for the job), else as many as SLURM or
    ``nvidia-smi`` counts.
    """
    if tasks_here == 1 or os.environ.get("SLURM_GPUS_PER_TASK"):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in (visible or "").split(",") if g.strip()]
    if visible is None:
        gpus = [str(i) for i in range(_count_gpus())]
    if not gpus:
        return
    share = len(gpus) // tasks_here
    if share == 0:
        raise UserError(
            f"{tasks_here} tasks of this job step share {len(gpus)} GPU(s) on {host}: "
            f"start at most {len(gpus)} per node (srun --ntasks-per-node={len(gpus)}), or "
            "give each task its own with --gpus-per-task"
        )
    mine = ",".join(gpus[local * share : (local + 1) * share])
    os.environ["CUDA_VISIBLE_DEVICES"] = mine
    logging.info("Task %d of %d on %s uses GPUs %s", local, tasks_here, host, mine)


def _count_gpus() -> int:
    """The node's GPUs as SLURM counts them, else ``nvidia-smi``; 0 without either."""
    counted = os.environ.get("SLURM_GPUS_ON_NODE", "")
    if counted.isdigit():
        return int(counted)
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def _check_tf_config() -> Cluster:
    """One line for a malformed TF_CONFIG, instead of a hang or a traceback; see ``find``.

    Every part is checked here, once: JSON, the cluster's jobs and addresses, the
    task's type and its index.
    """
    text = os.environ["TF_CONFIG"]
    shape = (
        'TF_CONFIG must be JSON like {"cluster": {"worker": ["host:port", ...]}, '
        '"task": {"type": "worker", "index": 0}}'
    )
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{shape}; it is not JSON ({error})") from None
    cluster = config.get("cluster") if isinstance(config, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        missing = "cluster" if not isinstance(cluster, dict) else "task"
        raise UserError(f"{shape}; its {missing!r} is missing or not an object")
    for job, addresses in cluster.items():
        _check_addresses(job, addresses)
    if not cluster.get("worker"):
        raise UserError(f"{shape}; its cluster has no 'worker' list")
    task_type, index = task.get("type", "worker"), task.get("index", 0)
    if task_type not in ("worker", "chief"):
        raise UserError(
            f"TF_CONFIG task type {task_type!r} is not one this trainer runs: give each "
            "machine 'worker' (or one 'chief'); an evaluator beside training is "
            "--schedule continuous_eval, run without TF_CONFIG"
        )
    if task_type not in cluster:
        raise UserError(f"TF_CONFIG task type {task_type!r} has no list in its cluster")
    if not isinstance(index, int) or isinstance(index, bool):
        raise UserError(
            f"TF_CONFIG task index must be a number, got {index!r} "
            f'({type(index).__name__}): write "index": {index if str(index).isdigit() else 0}'
        )
    if not 0 <= index < len(cluster[task_type]):
        count = len(cluster[task_type])
        raise UserError(f"TF_CONFIG task index {index} is outside its {count} {task_type}s")
    addresses = [*cluster.get("chief", []), *cluster["worker"]]
    place = index + (len(cluster.get("chief", [])) if task_type == "worker" else 0)
    name = f"{task_type} {index} of {len(addresses)}"
    return Cluster(cluster, tuple(addresses), place, name)


def _check_addresses(job: str, addresses) -> None:
    """Each address of a job's list is ``host:port``."""
    if not isinstance(addresses, list):
        raise UserError(
            f"TF_CONFIG cluster {job!r} must be a list of 'host:port', got {addresses!r}"
        )
    for address in addresses:
        host, _, port = str(address).rpartition(":")
        if not isinstance(address, str) or not host or not port.isdigit():
            raise UserError(
                f"TF_CONFIG cluster {job!r} has address {address!r}; give each as 'host:port'"
            )


def join(make: Callable[[], T], timeout_seconds: float, found: Cluster) -> T:
    """``make()``, which waits for every worker in C++, once they have met (``rendezvous``).

    There, within ``timeout_seconds``, SIGINT and SIGTERM are answered as the caller
    has them answered, and a worker that never comes is named (``PeerLost``). After
    ``make()`` the signal handlers are installed again: TensorFlow's preemption
    notifier takes SIGTERM over while the cluster forms.
    """
    rendezvous.meet(list(found.addresses), found.index, found.spec, timeout_seconds, found.name)
    handlers = {number: signal.getsignal(number) for number in preemption.SIGNALS}
    try:
        return make()
    finally:
        if threading.current_thread() is threading.main_thread():
            for number, handler in handlers.items():
                if handler is not None:
                    signal.signal(number, handler)
