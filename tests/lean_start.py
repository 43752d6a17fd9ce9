"""Imports TensorFlow as ``python -m trainer`` does, for the helper processes tests start.

``import lean_start`` first thing in tests/*_runs.py: the command line's quiet import
(``console.quiet_start(command_line=True)``), which holds back the
packages Keras imports only in case, so each helper starts as fast as a command.
``trainer/console.py`` is loaded on its own: importing it as ``trainer.console``
would run ``trainer/__init__``, which imports TensorFlow without the hold-back.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "lean_start_console", os.path.join(os.path.dirname(__file__), "..", "trainer", "console.py")
)
_console = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_console)
_console.quiet_start(command_line=True)
