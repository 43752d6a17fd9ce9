"""Training over several devices and machines: the scale-out half of the framework.

``placement.Placement`` is what the rest of the framework asks: where a step runs and
how its batch and gradients are shared. Below it: ``devices`` (which devices, and the
settings they cannot run), ``towers`` (one batch split over this process's devices),
``strategies`` (tf.distribute's mirrored and multi-worker strategies), ``workers``
(several machines writing one model_dir), ``cluster`` (where the workers are:
TF_CONFIG or SLURM), ``rendezvous`` (workers meeting before TensorFlow joins them),
``watchdog`` (a worker that stops making progress), ``launcher`` (``--workers N`` on
one machine) and ``preemption`` (signals turned into a checkpoint and a clean stop).
"""
