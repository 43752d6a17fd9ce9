"""Imports TensorFlow as ``python -m trainer`` does, for the helper processes tests start.

``import lean_start`` first thing in tests/*_runs.py: the command line's quiet import
(``console.quiet_start(command_line=True)``), which holds back the packages Keras
imports only in case and hides what is left at exit from the garbage collector, so
each helper starts and ends as fast as a command. ``import trainer``
imports nothing yet, so the console module is imported as any other.
"""

from trainer import console

console.quiet_start(command_line=True)
