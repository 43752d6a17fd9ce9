"""Commands as a user types them: in a copy of the repository as a fresh clone has it,
from its root, given to bash as text, with the user's environment."""

import os
import shutil
import subprocess
import sys

from tests.support.commands import REPO


def copy_clone(root):
    """Copies the repository's files as a fresh clone has them (no output/, no data/,
    no built site) to ``root``; returns it."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    for name in listed.stdout.splitlines():
        source = os.path.join(REPO, name)
        if os.path.isfile(source):
            os.makedirs(root / os.path.dirname(name), exist_ok=True)
            shutil.copy2(source, root / name)
    return root


def user_env():
    """The user's environment: python3 is this interpreter, nothing downloads."""
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user has it: unset
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    # A download (a TFDS experiment without its data) fails at once, online or not.
    env.update(HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9")
    env.update(http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")
    return env


def sh(command, cwd, timeout=600):
    """Runs ``command`` as a user types it, in ``cwd``; returns the CompletedProcess."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(proc):
    """``proc``, once it is known to have exited 0 (else its output's tail, failing)."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc
