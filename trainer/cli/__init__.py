"""The command line: ``python -m trainer``, from its flags to one exit code.

``flags`` (the flags, parsed before TensorFlow loads), ``experiment`` (one gin-described
run: config parsed, the Estimator made, the schedule run, one-line errors), ``sweep``
(a grid of trials), ``report`` (the end-of-run summary and results file), ``gin_config``
and ``gin_errors`` (gin's configurables, parsing and mistakes in one line),
``config_diff`` (two configs compared binding by binding) and ``exit_codes``.
"""
