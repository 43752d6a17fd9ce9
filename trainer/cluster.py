"""Where the workers of a ``multi_worker`` run are: TF_CONFIG, else SLURM's job step.

``TF_CONFIG`` names the cluster and this worker, as TensorFlow reads it. Started by
``srun`` without one, each task finds the cluster in SLURM's variables (TensorFlow's
``SlurmClusterResolver``: the step's nodes, its tasks per node, this task's rank)
and writes it as TF_CONFIG, so that the rest of the run reads one description.
"""

from __future__ import annotations

import json
import os

import tensorflow as tf
from absl import logging

from trainer.errors import UserError

SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NODELIST")  # a task of a job step has them


def find() -> tuple[str, str]:
    """This worker's name and address: ``('worker 1 of 2', '10.0.0.2:2222')``.

    TF_CONFIG is set from SLURM's job step first when it is unset.

    Raises:
      UserError: no cluster is described, or TF_CONFIG is malformed; one line each.
    """
    if not os.environ.get("TF_CONFIG"):
        if not all(name in os.environ for name in SLURM_VARIABLES):
            raise UserError(
                "distribution 'multi_worker' needs its cluster: TF_CONFIG is not set and "
                f"this is not a task of a SLURM job step ({' and '.join(SLURM_VARIABLES)} "
                "are not set); set TF_CONFIG on each worker (see README, 'Several "
                "machines'), or start the workers with srun"
            )
        os.environ["TF_CONFIG"] = slurm_tf_config()
        logging.info("TF_CONFIG from SLURM's job step: %s", os.environ["TF_CONFIG"])
    found = _check_tf_config()
    _bypass_proxies(json.loads(os.environ["TF_CONFIG"])["cluster"])
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


def slurm_tf_config(port: int = 8888) -> str:
    """The TF_CONFIG that SLURM's variables describe: a worker per task, ports from ``port``."""
    gpus = len(tf.config.list_physical_devices("GPU"))
    # With GPUs the resolver shares them out over a node's tasks; without, it is told
    # of enough not to refuse, and sets nothing.
    shares = {"gpus_per_node": gpus} if gpus else {"gpus_per_node": 1 << 16, "gpus_per_task": 1}
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=port, auto_set_gpu=gpus > 0, **shares
    )
    try:
        spec = resolver.cluster_spec().as_dict()
    except (RuntimeError, ValueError, KeyError) as error:
        raise UserError(f"SLURM's variables do not describe a cluster: {error}") from None
    task = {"type": resolver.task_type, "index": resolver.task_id}
    return json.dumps({"cluster": spec, "task": task})


def _check_tf_config() -> tuple[str, str]:
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
    count = len(cluster["worker"]) + len(cluster.get("chief", []))
    return f"{task_type} {index} of {count}", cluster[task_type][index]


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
