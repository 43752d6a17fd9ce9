"""``--sweep``: one command trains a grid of trials and ends with one table.

``--sweep 'Adam.learning_rate = [1e-3, 1e-2]'`` (repeated, for a grid) makes one
trial per value, or per combination. A trial is the command itself with its
bindings added after the ``--gin_param`` ones, in a model_dir of its own under
``--model_dir`` named by them (``learning_rate=0.001``), so that TensorBoard shows
the trials side by side and its HParams tab compares them. Every trial's config is
parsed before the first one starts: a mistake in any is refused at once.

Trials run one after another in this process, TensorFlow started once, each seeded
as a run of its own would be. A trial runs as a command of its own instead when it
would change what a process sets once (its devices, its distribution, op
determinism), and under ``--workers`` (its workers). A finished trial writes
``trial.json``: rerunning the same command skips it and resumes the one that was
stopped. A trial that diverges is a result, not the end of the sweep; a mistake, a
crash or a signal ends it (exit code as for one run).
"""

from __future__ import annotations

import dataclasses
import gc
import io
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tokenize
from collections.abc import Callable

import gin
import keras

from trainer import logs, settings, summaries, whole_files
from trainer.cli import gin_config
from trainer.distributed import launcher
from trainer.errors import TrainingDiverged, UserError

TRIAL_FILE = "trial.json"  # a finished trial's results, in its model_dir
# Settings a process applies once, before its first op: a trial that sweeps one runs
# as a command of its own.
PROCESS_SETTINGS = (
    "Devices.count",
    "Devices.distribution",
    "experiment.deterministic",
)
_BINDING = re.compile(r"^\s*([\w./]+\.\w+)\s*=\s*(.*?)\s*$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One point of the grid: ``(('Adam.learning_rate', '1e-3'), ...)``."""

    bindings: tuple[tuple[str, str], ...]
    name: str  # its directory under the sweep's model_dir

    @property
    def params(self) -> list[str]:
        """Its bindings as ``--gin_param`` texts."""
        return [f"{name} = {value}" for name, value in self.bindings]


def grid(sweeps: list[str]) -> list[Trial]:
    """Every combination of the ``--sweep`` values, the first flag's varying slowest."""
    axes: dict[str, list[str]] = {}
    for text in sweeps:
        match = _BINDING.match(text)
        if not match:
            raise UserError(
                f"--sweep {text!r}: give one binding with a list of values, e.g. "
                "--sweep 'Adam.learning_rate = [1e-3, 1e-2]'"
            )
        name, values = match.groups()
        if name in axes:
            raise UserError(f"--sweep {name} is given twice: list all its values in one --sweep")
        axes[name] = _items(name, values)
    shown = _short_names(list(axes))
    trials = []
    for values in itertools.product(*axes.values()):
        bindings = tuple(zip(axes, values, strict=True))
        name = ",".join(f"{_path_safe(shown[n])}={_path_safe(v)}" for n, v in bindings)
        trials.append(Trial(bindings, name))
    return trials


def _items(name: str, text: str) -> list[str]:
    """The gin text of each item of the list ``text``: ``'[1, [2, 3]]'`` -> ``['1', '[2, 3]']``."""
    unmatched = UserError(
        f"--sweep {name} = {text}: its brackets or quotes do not match; write the values as "
        f"one list, e.g. --sweep '{name} = [1, 2]'"
    )
    try:
        tokens = [
            t
            for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER)
        ]
    except (tokenize.TokenError, SyntaxError):
        raise unmatched from None
    if not tokens or tokens[0].string != "[":
        raise UserError(
            f"--sweep {name} = {text}: give its values as a list, e.g. "
            f"--sweep '{name} = [{text or 1}, ...]'"
        )
    lines = text.splitlines(keepends=True)
    offset = [sum(len(line) for line in lines[:row]) for row in range(len(lines) + 1)]

    def at(position: tuple[int, int]) -> int:
        return offset[position[0] - 1] + position[1]

    items, depth, start = [], 0, at(tokens[0].end)
    for token in tokens:
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        if depth < 0 or (depth == 0) != (token is tokens[-1]):  # the list ends at the end
            raise unmatched
        if depth == 0 or (depth == 1 and token.string == ","):
            items.append(text[start : at(token.start)].strip())
            start = at(token.end)
    items = [item for item in items if item]
    if not items:
        raise UserError(f"--sweep {name} = {text}: the list is empty; give it values to try")
    return items


def _short_names(names: list[str]) -> dict[str, str]:
    """Each swept binding's parameter name, or its whole name where two share one."""
    params = [name.rsplit(".", 1)[1] for name in names]
    return {n: p if params.count(p) == 1 else n for n, p in zip(names, params, strict=True)}


def _path_safe(value: str) -> str:
    """A value's gin text as part of a directory name: ``'[512, 512]'`` -> ``'[512,512]'``."""
    return re.sub(r"[^\w.,=+\-\[\]()@%]", "", value.replace("/", "_")) or "_"


# ---------------------------------------------------------------- running


@dataclasses.dataclass
class Sweep:
    """The trials of one command, and how to run each.

    ``run_here(params, model_dir, results)`` runs one trial in this process and
    returns ``(message, exit code, prefix)`` if it failed; ``argv`` is the command's
    own arguments, from which a trial that runs as a command is made.
    """

    trials: list[Trial]
    files: list[str]
    params: list[str]
    model_dir: str
    argv: list[str]
    run_here: Callable[[list[str], str, str], tuple[str, int, str] | None]
    separate: bool = False  # run every trial as a command of its own

    def run(self, results: str | None = None) -> tuple[str, int, str] | None:
        """Checks every trial, runs those not finished, prints the table.

        Returns (message, exit code, prefix) if a trial failed other than by
        diverging; ``results`` is where the table goes as JSON, if given.
        """
        max_steps, ranking = self._check()
        rows = []
        for number, trial in enumerate(self.trials, 1):
            directory = os.path.join(self.model_dir, trial.name)
            done = _finished(directory, max_steps[trial])
            where = f"trial {number} of {len(self.trials)}: {trial.name}"
            if done:
                print(f"{where}: finished before ({directory}), not run again", flush=True)
            else:
                print(f"{where} ({directory})", flush=True)
                failure = self._run_one(trial, directory)
                if failure and failure[1] != TrainingDiverged.exit_code:
                    return failure
                if failure:
                    print(f"{where}: diverged: {failure[0]}", file=sys.stderr, flush=True)
                done = _record(directory, trial, max_steps[trial], failure)
            rows.append(done)
        lines, rows = table(rows, *ranking, self.model_dir)
        print("\n".join(lines))
        if results:
            metric, higher = ranking
            whole_files.write_json(results, {"metric": metric, "higher": higher, "trials": rows})
            print(f"{'results':<12} {results}")
        return None

    def _check(self) -> tuple[dict[Trial, int], tuple[str, bool]]:
        """Parses every trial's config; returns their max_steps, and what ranks them."""
        max_steps = {}
        for trial in self.trials:
            gin.clear_config()
            try:
                gin_config.parse(self.files, self.params, trial.params)
            except UserError as error:
                raise UserError(f"trial {trial.name}: {error}") from None
            for name, value in trial.bindings:  # gin reads a macro only when it is used
                for macro in re.findall(r"%([\w./]+)", value):
                    if gin_config.query(f"%{macro}", None) is None:
                        raise UserError(
                            f"--sweep {name}: %{macro} is used but never given a value: "
                            f"add '{macro} = ...' to a .gin file"
                        )
            max_steps[trial] = gin_config.query("experiment.max_steps", None)
            if any(name in PROCESS_SETTINGS for name, _ in trial.bindings):
                self.separate = True
        if gin_config.query("Devices.distribution", None) == "multi_worker":
            self.separate = True
        return max_steps, _ranking()

    def _run_one(self, trial: Trial, directory: str) -> tuple[str, int, str] | None:
        results = os.path.join(directory, TRIAL_FILE)
        params = [*self.params, *trial.params]
        if not self.separate:
            gin.clear_config()
            try:
                return self.run_here(params, directory, results)
            finally:
                logs.end_log()  # the next trial's log goes to its own model_dir
                keras.backend.clear_session()  # the trial's graphs and names go with it
                gc.collect()
        argv = launcher.without_flags(self.argv, ["sweep", "model_dir", "results"])
        argv += ["--model_dir", directory, "--results", results]
        argv += [arg for p in trial.params for arg in ("--gin_param", p)]
        code = _run_command(argv)
        if code == 0:
            return None
        if code == TrainingDiverged.exit_code:
            log = os.path.join(directory, "trainer.log")
            return (f"its loss or weights became NaN or Inf (see {log})", code, "error")
        return (f"trial {trial.name} ended with exit code {code}", code, "error")


def _ranking() -> tuple[str, bool]:
    """The metric trials are ranked by, and whether higher is better.

    The one the best export is chosen by, else early stopping's, else the eval loss.
    """
    for group in (settings.BestExport, settings.EarlyStop):
        name = gin_config.query(f"{group.__name__}.metric", None)
        if name:
            return name, gin_config.query(f"{group.__name__}.higher", group().higher)
    return "loss", False


def _finished(directory: str, max_steps: int | None) -> dict | None:
    """A trial's record, if it ran to this command's max_steps (or diverged) before."""
    try:
        with open(os.path.join(directory, TRIAL_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if record.get("max_steps") == max_steps and "trial" in record else None


def _record(directory: str, trial: Trial, max_steps: int, failure) -> dict:
    """Completes the trial's results file (written by the run) so a rerun skips it."""
    path = os.path.join(directory, TRIAL_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):  # it diverged: its run wrote no results
        record = {"model_dir": directory, "metrics": {}}
    record.update(trial=trial.name, bindings=dict(trial.bindings), max_steps=max_steps)
    record["diverged"] = failure[0] if failure else None
    record["history"] = _history(directory)
    whole_files.write_json(path, record)
    return record


def _history(directory: str) -> list[dict]:
    """The trial's evaluations (of its first eval set), or its training logs if none."""
    try:
        with open(os.path.join(directory, summaries.METRICS)) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []
    evaluated = [line for line in lines if line.get("writer", "").startswith("eval")]
    if evaluated:
        first = evaluated[0]["writer"]
        return [line for line in evaluated if line["writer"] == first]
    return [line for line in lines if line.get("writer") == "train"]


def table(rows: list[dict], metric: str, higher: bool, model_dir: str):
    """One line per trial, best first: its final metrics and its best ``metric``.

    Returns the lines and the rows in their order.
    """

    def best(row: dict) -> tuple[float, int] | None:
        found = [(h[metric], h["step"]) for h in row["history"] if _number(h.get(metric))]
        if not found:
            return None
        return (max if higher else min)(found, key=lambda value_step: value_step[0])

    def rank(row: dict) -> float:
        found = best(row)
        if row["diverged"] or found is None:
            return math.inf
        return -found[0] if higher else found[0]

    rows = sorted(rows, key=rank)
    names = list(dict.fromkeys(k for r in rows for k in (r["history"] or [{}])[-1]))
    names = [n for n in names if n not in ("step", "time", "writer")]
    width = max(5, *(len(r["trial"]) for r in rows))
    cells = [max(10, len(n) + 2) for n in names]
    writer = next((r["history"][0]["writer"] for r in rows if r["history"]), "train")
    by = f"training {metric}" if writer == "train" else f"{metric} on {writer[5:]!r}"
    header = f"{'trial':<{width}}{'step':>8}" + "".join(
        f"{n:>{c}}" for n, c in zip(names, cells, strict=True)
    )
    lines = [
        f"sweep: {len(rows)} trials in {model_dir}, best first by {by}",
        header + f"{'best ' + metric:>{len(metric) + 7}}{'at step':>9}",
    ]
    for row in rows:
        last = row["history"][-1] if row["history"] else {}
        line = f"{row['trial']:<{width}}{row.get('global_step', last.get('step', 0)):>8}"
        line += "".join(
            f"{last[n]:>{c}.4g}" if _number(last.get(n)) else " " * c
            for n, c in zip(names, cells, strict=True)
        )
        found = best(row)
        if row["diverged"]:
            line += f"  diverged: {row['diverged'].split(';')[0]}"
        elif found:
            line += f"{found[0]:>{len(metric) + 7}.4g}{found[1]:>9}"
        lines.append(line)
    return lines, rows


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _run_command(argv: list[str]) -> int:
    """``python -m trainer argv``, signals passed on to it; its exit code as a shell's."""
    child = subprocess.Popen(
        [sys.executable, "-m", "trainer", *argv],
        start_new_session=True,  # signals reach it once, from here
        preexec_fn=launcher.end_with_parent,
    )
    received: list[int] = []
    forward = launcher.forward_signals([child], received)
    previous = {s: signal.signal(s, forward) for s in launcher.PASSED_ON}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code
