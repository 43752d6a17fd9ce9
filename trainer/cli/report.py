"""The end of a run: the summary lines a person reads, the results file a script reads.

``cli`` hands each schedule's result here: ``{'global_step', 'model_dir', 'metrics':
{eval_set: {metric: value}}, 'best', 'seconds'}``, or for predict an iterator of
per-example predictions, which is written as one JSON line each.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

import trainer
from trainer import logs, summaries, whole_files


def best(exporter, stopping) -> dict[str, dict]:
    """The best evaluation by the best-export and the early-stopping metric, where set."""
    found = {}
    if exporter is not None and exporter.kept:
        top = exporter.kept[0]
        path = os.path.join(exporter.directory, str(top["step"]))
        found["export"] = {"metric": exporter.metric, **top, "path": path}
    if stopping is not None and stopping.best is not None:
        found["early_stopping"] = {
            "metric": stopping.metric,
            "value": stopping.best,
            "step": stopping.best_step,
        }
    return found


def write(result: dict, schedule: str, results_path: str | None, clock: dict) -> None:
    """Prints the summary and writes ``results_path``; ``clock`` is time spent before the run.

    ``clock`` holds seconds by part (imports, config) and, for a sweep's later trial,
    ``since``: the moment its time counts from (else the process's start).
    """
    if schedule == "predict":
        count = whole_files.write_atomically(
            results_path,
            (
                json.dumps({k: _jsonable(v) for k, v in example.items()}) + "\n"
                for example in result["predictions"]
            ),
        )
        print(f"Wrote {count} predictions to {results_path}")
        return
    if "seconds" in result:
        result["seconds"] = _time_breakdown(result["seconds"], clock)
    print("\n".join(summary(result)))
    if results_path:
        whole_files.write_json(results_path, result)
        print(f"{'results':<12} {results_path}")


def summary(result: dict) -> list[str]:
    """The end-of-run lines: step and time, a table of the final metrics, where things are."""
    lines = [f"step {result['global_step']}"]
    if "seconds" in result:
        seconds = result["seconds"]
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items() if k != "wall")
        lines[0] += f" reached in {seconds['wall']:.1f}s ({parts})"
    return lines + _metrics_table(result["metrics"]) + _where(result)


def _metrics_table(metrics: dict[str, dict[str, float]]) -> list[str]:
    """One row per eval set, one column per metric, every name apart however long."""
    if not metrics:
        return []
    names = list(dict.fromkeys(k for values in metrics.values() for k in values))
    width = max(10, *(len(n) for n in metrics))
    cell = [max(12, len(n) + 2) for n in names]
    lines = [
        f"{'eval set':<{width}}" + "".join(f"{n:>{w}}" for n, w in zip(names, cell, strict=True))
    ]
    for eval_set, values in metrics.items():
        cells = "".join(
            f"{values[n]:>{w}.4g}" if n in values else " " * w
            for n, w in zip(names, cell, strict=True)
        )
        lines.append(f"{eval_set:<{width}}{cells}")
    return lines


def _where(result: dict) -> list[str]:
    """Where the best result, the export, the model_dir, its logs and TensorBoard are."""
    model_dir = result["model_dir"]
    where = []
    for kind, found in result.get("best", {}).items():
        text = f"{found['metric']} {found['value']:.4g} at step {found['step']}"
        where.append(("best", text + (f" ({found['path']})" if kind == "export" else "")))
    if "export_dir" in result:
        where.append(("exported", result["export_dir"]))
        where.append(("serve it", f"saved_model_cli show --dir {result['export_dir']} --all"))
        for export_format, record in result.get("exports", {}).items():
            where.append((export_format, os.path.join(result["export_dir"], record["file"])))
    where.append(("model_dir", model_dir))
    for label, name in (("metrics", summaries.METRICS), ("log", logs.LOG_NAME)):
        if os.path.exists(os.path.join(model_dir, name)):
            where.append((label, os.path.join(model_dir, name)))
    where.append(("tensorboard", f"tensorboard --logdir {model_dir}"))
    return [f"{label:<12} {text}" for label, text in where]


def _time_breakdown(estimator_seconds: dict[str, float], clock: dict) -> dict[str, float]:
    """Wall time from process start, split into imports, config, the Estimator's parts."""
    wall = time.perf_counter() - clock.get("since", trainer.STARTED)
    parts = {**{k: v for k, v in clock.items() if k != "since"}, **estimator_seconds}
    return {"wall": wall, **parts, "other": max(wall - sum(parts.values()), 0.0)}


def _jsonable(value):
    value = np.asarray(value)
    if value.dtype.kind in "SO":  # strings: text, its bytes decoded (a cut character replaced)
        value = np.vectorize(_decoded, otypes=[object])(value)
    return value.item() if value.ndim == 0 else value.tolist()


def _decoded(value):
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
