"""``python -m trainer`` without paying for TensorFlow's import each time: forked commands.

A row of the mistake table is one command that ends in its one line after a second,
but a fresh ``python -m trainer`` spends 2 CPU-seconds importing TensorFlow first:
69 rows, 150 of the suite's CPU-seconds. ``Commands`` starts one process that imports
what the command line imports, exactly as it does (``console.quiet_start``), then
runs nothing; each command is a fork of it that runs ``trainer``'s ``__main__`` with
its own arguments, working directory, stdin, stdout and stderr, and exits as the
command would: its exit handlers run, its exit code is the status.

What a fresh process has that a fork does not: TensorFlow's start-up lines, which
``quiet_start`` holds back anyway. Everything the command does after its imports
(gin, flags, checkpoints, files, its one line) is the command's own. The first
command of ``tests/test_cli.py`` and the README's commands run as fresh processes.

One server per pytest process (xdist worker), started at the first command; a
command that does not end within its timeout is killed, as ``subprocess.run`` does.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap

from tests.support.commands import ENV, REPO

# What each command's server imports before it forks: what the command imports, but
# never the module it runs (whose flags are defined as it runs).
IMPORTS = {
    "trainer": """
    from trainer import console
    from trainer.cli import flags  # noqa: F401 - the command line's flags, defined once
    console.quiet_start(command_line=True)
    from trainer.cli import experiment  # noqa: F401
    """,
    "datasets.prepare": """
    from trainer import console
    console.quiet_start(command_line=True)
    import tensorflow_datasets  # noqa: F401
    from datasets import text  # noqa: F401
    from datasets.records import shards
    """,
}

# The server: imports as the command line does, then forks once per request line.
SERVER = textwrap.dedent(
    """
    import json, os, runpy, sys
    {imports}
    requests = os.fdopen(0, "r")
    replies = os.fdopen(os.dup(1), "w")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            break
        print(pid, file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), file=replies, flush=True)
    else:
        sys.exit(0)
    requests.close(), replies.close()
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        opened = os.open(request[name], os.O_RDONLY if fd == 0 else os.O_WRONLY)
        if opened != fd:
            os.dup2(opened, fd)
            os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
    sys.argv = [{module!r}, *request["args"]]
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
    """
)


class Commands:
    """Runs ``python -m MODULE ARGS`` as forks of one process that has imported it.

    ``module``: ``trainer`` or ``datasets.prepare`` (``IMPORTS``).
    """

    def __init__(self, module: str = "trainer"):
        self.module = module
        self._server, self._read = None, b""

    def run(self, *args, cwd=REPO, env=None, timeout=300) -> subprocess.CompletedProcess:
        """As ``commands.run_cli`` (``env`` added to this process's, with ENV's path)."""
        server = self._started()
        full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **ENV, **(env or {}))
        with tempfile.TemporaryDirectory() as directory:
            out, err = os.path.join(directory, "out"), os.path.join(directory, "err")
            for path in (out, err):
                open(path, "w").close()
            request = {"args": list(map(str, args)), "cwd": str(cwd), "env": full_env}
            request.update(stdin=os.devnull, stdout=out, stderr=err)
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            pid = int(self._reply(server, 60))
            try:
                code = int(self._reply(server, timeout))
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                self._reply(server, 60)
                raise
            with open(out) as o, open(err) as e:
                return subprocess.CompletedProcess(args, code, o.read(), e.read())

    def _started(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, "-c", self._program()],
                cwd=REPO,
                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **ENV),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._read = b""
        return self._server

    def _program(self) -> str:
        imports = textwrap.dedent(IMPORTS[self.module]).strip()
        return SERVER.replace("{imports}", imports).replace("{module!r}", repr(self.module))

    def _reply(self, server: subprocess.Popen, timeout: float) -> str:
        """The server's next line, read unbuffered so that select sees what is pending."""
        while b"\n" not in self._read:
            ready, _, _ = select.select([server.stdout], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"python -m {self.module} (forked)", timeout)
            data = os.read(server.stdout.fileno(), 4096)
            if not data:
                raise RuntimeError(f"the forking server of python -m {self.module} ended")
            self._read += data
        line, self._read = self._read.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        """Ends the server (its stdin closed: it exits 0)."""
        if self._server is not None:
            self._server.stdin.close()
            self._server.wait(30)
            self._server = None
