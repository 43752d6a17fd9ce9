"""Turns SIGTERM and SIGINT into a request to checkpoint and stop at the next step boundary."""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def watch_signals():
    """Yields a list that receives the name of each SIGTERM/SIGINT while inside.

    The training loop checks the list between compiled blocks, saves and stops. A
    second signal while the first is pending interrupts at once (KeyboardInterrupt).
    Outside the main thread signals cannot be caught; the list then stays empty.
    """
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        del frame
        if received:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
        received.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield received
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
