"""What the tests share: the command runner, the helper processes, the parity matrix.

Tests import from here; no test imports another test module or the conftest,
whose fixtures pytest hands them. The ``*_runs.py`` scripts and ``lean_start`` run in
the subprocesses tests start (logical CPU devices must be made before TensorFlow runs
an op, and workers are processes of their own).
"""
