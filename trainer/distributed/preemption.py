"""Turns SIGTERM, SIGINT and SIGUSR1 into a request to checkpoint and stop at a step boundary.

SIGUSR1 is SLURM's advance warning of a time limit (``#SBATCH --signal=USR1@90``):
the run saves and exits 75, so that the batch script can requeue the job.

Outside training (while TensorFlow loads, the workers join, the model is built) there
is nothing to save: ``outside_training`` ends the command there with one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from trainer import exit_codes

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


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

    with _handled(handler):
        yield received


class Interrupted(BaseException):
    """A signal of ``SIGNALS`` arrived outside training: the command ends, nothing to save."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        # As a shell reports a process ended by the signal; but the end of a time
        # limit is near: 75, for the job to be requeued (docs/guide/command-line.md's exit codes).
        self.exit_code = (
            exit_codes.PREEMPTED if signum == signal.SIGUSR1 else exit_codes.of_signal(signum)
        )


@contextlib.contextmanager
def outside_training():
    """Inside, SIGINT and SIGTERM raise ``Interrupted`` (``watch_signals`` takes over in training).

    The command then says one line instead of a traceback from whatever Python was
    doing (importing TensorFlow, most often).

    A handler runs between any two bytecodes, also in a weakref callback (importlib's
    module locks have one), whose exceptions Python prints as "Exception ignored in" and
    drops: the command went on, and a worker waited for peers that had stopped. Such an
    ``Interrupted`` is sent again once the callback has returned, or raised on leaving.
    It may also land in Python code that a C++ extension calls while it raises an error
    of its own (TensorFlow making the ``UnavailableError`` of a collective whose peer had
    just stopped on the same signal), which pybind11 then replaces with a RuntimeError:
    an error that leaves after the handler raised is that ``Interrupted``.
    """
    swallowed: list[Interrupted] = []
    raised: list[Interrupted] = []

    def handler(signum, frame):
        del frame
        swallowed.clear()
        raised.append(Interrupted(signum))
        raise raised[-1]

    def send_again():
        if swallowed:
            os.kill(os.getpid(), swallowed[0].signum)

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, Interrupted):
            return previous_hook(unraisable)
        swallowed[:] = [unraisable.exc_value]
        threading.Timer(0.01, send_again).start()  # from here it would land in this hook

    previous_hook, sys.unraisablehook = sys.unraisablehook, hook
    try:
        with _handled(handler):
            yield
    except Interrupted:
        raise
    except Exception as error:  # not SystemExit: an exit code chosen stays
        if raised:  # the handler's exception, replaced on its way out
            raise raised[0] from error
        raise
    finally:
        sys.unraisablehook = previous_hook
    if swallowed:
        raise swallowed.pop()


@contextlib.contextmanager
def _handled(handler):
    """``handler`` answers SIGTERM and SIGINT while inside; the previous ones after."""
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
