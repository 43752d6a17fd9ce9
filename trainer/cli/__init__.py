"""The command line: ``python -m trainer``, from its flags to one exit code.

``flags`` (the flags, parsed before TensorFlow loads), ``experiment`` (one gin-described
run: config parsed, the Estimator made, the schedule run, one-line errors), ``sweep``
(a grid of trials), ``report`` (the end-of-run summary and results file), ``gin_config``
and ``gin_errors`` (gin's configurables, parsing and mistakes in one line). Nothing
outside it imports it (``tests/test_house.py``): the exit codes and the comparison of
two configs, which the library and the workers use too, live beside them
(``trainer/exit_codes.py``, ``trainer/config_diff.py``).
"""
