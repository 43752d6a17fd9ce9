"""A real one-node SLURM for the tests: Debian's slurmctld, slurmd and munge.

``.ci/run`` installs the packages; ``LocalSlurm`` writes a configuration to a
temporary directory (its own ports, state and logs, so that two can run at once on one
machine) and starts the two daemons in the foreground, stopped when the fixture ends.
Where it cannot start (not root, the packages missing) the tests that need it are
skipped, saying why.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")

CONFIG = """\
ClusterName=trainer-tests
SlurmctldHost={host}
SlurmctldPort={controller_port}
SlurmdPort={node_port}
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SchedulerParameters=defer_batch
KillWait=30
NodeName={host} CPUs=2 RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def unavailable() -> str | None:
    """Why a local SLURM cannot start here, or None."""
    missing = [name for name in DAEMONS if not shutil.which(name)]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing; .ci/run installs it)"
    if os.geteuid() != 0:
        return "a local SLURM's daemons run as root here, and this is not root"
    return None


class LocalSlurm:
    """slurmctld and slurmd of one node, configured under ``root``; ``env`` for clients."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname()
        ports = _free_ports(2)
        for name in ("state", "spool"):
            (root / name).mkdir(parents=True, exist_ok=True)
        self.config = root / "slurm.conf"
        self.config.write_text(
            CONFIG.format(host=self.host, controller_port=ports[0], node_port=ports[1], root=root)
        )
        self.env = {**os.environ, "SLURM_CONF": str(self.config)}
        self.env.pop("TF_CONFIG", None)
        self.daemons: list[subprocess.Popen] = []

    def start(self, timeout: float = 60) -> None:
        """Starts munge (if it is not running) and the two daemons; waits for an idle node."""
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode:
            os.makedirs("/run/munge", exist_ok=True)  # its socket's directory
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["munged", "--force"], check=True, capture_output=True)
        for daemon in ("slurmctld", "slurmd"):
            self.daemons.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", str(self.config)],
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + timeout
        while self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() != "idle":
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the local SLURM did not start: see {self.root}/*.log")
            time.sleep(0.5)

    def run(self, *command: str, check: bool = True, **options) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, srun, scontrol...) against this cluster."""
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, check=check, **options
        )

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields: JobState, Restarts, ExitCode..."""
        shown = self.run("scontrol", "show", "job", job_id, "-o").stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
