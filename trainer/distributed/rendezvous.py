"""Where the workers of a ``multi_worker`` run meet before TensorFlow joins them.

TensorFlow waits for a cluster in C++, as long as it takes, holding Python's lock: a
worker started alone would wait forever, deaf to SIGINT and SIGTERM. So the workers
meet here first, in Python. Each listens at its own TF_CONFIG address and calls on
every other one; a call trades one line of JSON (the caller's cluster and place in
it, answered with the callee's), so that a worker given another cluster is refused
on both sides, in one line, before anything starts. A peer whose lobby has closed
already answers from TensorFlow's server, which is as good: it is up. Once every
peer has answered the lobby closes, and TensorFlow, joining them, finds every worker
there. Signals are answered as the caller has them answered all along (the CLI: one
line), and a peer that never comes is named after ``timeout_seconds``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

from trainer.errors import PeerLost, UserError

POLL_SECONDS = 0.2  # how often an absent peer is called again


def meet(addresses: list[str], mine: int, cluster: dict, timeout_seconds: float, name: str):
    """Returns once every other worker listens; refuses a differing cluster or a late peer.

    Args:
      addresses: every worker's ``host:port``, the chief first.
      mine: this worker's place in ``addresses``.
      cluster: this worker's TF_CONFIG cluster, which every peer must have too.
      timeout_seconds: how long to wait for the others.
      name: this worker's name (``'worker 1 of 2'``), for the messages.

    Raises:
      UserError: this worker's port is taken, or a peer has another cluster.
      PeerLost: a worker did not start in time; the message names it.
    """
    card = json.dumps({"cluster": cluster, "index": mine}, sort_keys=True)
    with _listening(addresses[mine], name, card) as heard:
        waiting = {i: a for i, a in enumerate(addresses) if i != mine}
        deadline = time.monotonic() + timeout_seconds
        while waiting and time.monotonic() < deadline:
            for index, address in list(waiting.items()):
                answer = _call(address, card)
                if answer is not None:
                    heard.append(answer)
                    del waiting[index]
            _check_same(cluster, mine, heard)
            if waiting:
                time.sleep(POLL_SECONDS)
    if waiting:
        absent = ", ".join(f"worker {i} ({a})" for i, a in waiting.items())
        raise PeerLost(
            f"{name}: {absent} did not start in {timeout_seconds:g}s "
            "(Devices.startup_timeout): start every worker of TF_CONFIG's cluster with "
            "the same command, or allow longer"
        )


def _check_same(cluster: dict, mine: int, heard: list) -> None:
    """Refuses a peer's card whose cluster differs from this worker's."""
    mine_text = json.dumps(cluster, sort_keys=True)
    for card in list(heard):
        theirs = card.get("cluster") if isinstance(card, dict) else None
        if theirs is None:  # TensorFlow's server answered: the peer is past its lobby
            continue
        theirs_text = json.dumps(theirs, sort_keys=True)
        if theirs_text != mine_text:
            raise UserError(
                f"TF_CONFIG's cluster differs between workers: worker {mine} has "
                f"{mine_text}, worker {card.get('index')} has {theirs_text}; give every "
                "worker the same cluster (only task.index differs)"
            )


def _call(address: str, card: str) -> dict | None:
    """The peer's card, ``{}`` if something else listens there, None if nothing does."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2) as peer:
            peer.sendall(card.encode() + b"\n")
            return _card(peer)
    except OSError:  # not listening yet, or not yet in the DNS
        return None


def _card(peer: socket.socket) -> dict:
    """One line of JSON read from ``peer``; ``{}`` for anything else (a gRPC server)."""
    data = b""
    with contextlib.suppress(OSError):
        while b"\n" not in data and len(data) < 1 << 16:
            chunk = peer.recv(4096)
            if not chunk:
                break
            data += chunk
    try:
        card = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return {}
    return card if isinstance(card, dict) else {}


@contextlib.contextmanager
def _listening(address: str, name: str, card: str):
    """Answers calls at ``address``'s port with ``card`` while inside; yields cards heard."""
    port = int(address.rpartition(":")[2])
    try:
        if socket.has_dualstack_ipv6():
            server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            server = socket.create_server(("", port))
    except OSError:
        raise UserError(
            f"could not listen on {address}, {name}'s address in TF_CONFIG: is another "
            "worker using the same task index, or another program the same port?"
        ) from None
    heard: list = []
    stop = threading.Event()

    def answer() -> None:
        server.settimeout(POLL_SECONDS)
        while not stop.is_set():
            try:
                peer, _ = server.accept()
            except OSError:  # the time-out, to look at ``stop``
                continue
            with peer:
                peer.settimeout(2)
                with contextlib.suppress(OSError):
                    heard.append(_card(peer))
                    peer.sendall(card.encode() + b"\n")

    answering = threading.Thread(target=answer, name="lobby", daemon=True)
    answering.start()
    try:
        yield heard
    finally:
        stop.set()
        answering.join()
        server.close()
