"""The efficiency model's fit: two parameters, fitted once on four published runs,
checked on every other.

:func:`fit` chooses :class:`~labsupport.estimate.compute.Efficiency`'s ``gemm`` and
``passes`` to minimise the mean squared log error of the predicted
throughput over the rows of :data:`labsupport.estimate.runs.TRAINING` (four rows of
Narayanan et al.'s table 1, 1.7 B to 1 T parameters), by a coordinate search in log space
from a fixed start (deterministic, standard library only). The result, rounded, is
:data:`labsupport.estimate.compute.FITTED`, the one set the planner uses for every row,
layout and device. :func:`table` gives each row's error, in sample and out of sample;
:func:`sensitivity` how much a prediction moves when one parameter moves by 10 %.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from labsupport.estimate.compute import FITTED, Efficiency
from labsupport.estimate.planner import evaluate
from labsupport.estimate.runs import runs

START = Efficiency(gemm=0.7, passes=4.0)


def predict(row: dict, eff: Efficiency = FITTED) -> dict:
    """The planner's throughput for ``row``, counted as its source counts it, and the
    full evaluation."""
    found = evaluate(row["model"], row["cluster"], row["layout"], row["global_batch"], eff)
    key = "tflops" if row["counted"] == "with recomputation" else "model_tflops"
    return {"tflops": found[key], "evaluation": found}


def loss(eff: Efficiency, rows: list[dict]) -> float:
    """Mean squared log error of the predicted throughput over ``rows``."""
    return sum(math.log(predict(r, eff)["tflops"] / r["tflops"]) ** 2 for r in rows) / len(rows)


def fit(rows: list[dict] | None = None, start: Efficiency = START) -> Efficiency:
    """The parameters that minimise :func:`loss` on ``rows`` (default: the training rows):
    each parameter in turn multiplied and divided by a factor, a move kept when it lowers
    the loss, the factor's square root taken when none does, until it is below 1.0005.
    ``gemm`` stays at most 1."""
    rows = rows if rows is not None else [r for r in runs() if r["split"] == "train"]
    best, best_loss, factor = start, loss(start, rows), 2.0
    names = [f.name for f in fields(Efficiency)]
    while factor > 1.0005:
        moved = False
        for name in names:
            for scale in (factor, 1 / factor):
                value = getattr(best, name) * scale
                if name == "gemm" and value > 1:
                    continue
                trial = replace(best, **{name: value})
                trial_loss = loss(trial, rows)
                if trial_loss < best_loss - 1e-12:
                    best, best_loss, moved = trial, trial_loss, True
        if not moved:
            factor = math.sqrt(factor)
    return best


def table(eff: Efficiency = FITTED) -> list[dict]:
    """Every run: ``name``, ``split``, ``predicted`` and ``published`` TFLOP/s per GPU,
    ``error`` (predicted over published, minus 1), ``fits`` and ``memory`` (bytes)."""
    out = []
    for r in runs():
        found = predict(r, eff)
        out.append(
            {
                "name": r["name"],
                "split": r["split"],
                "predicted": found["tflops"],
                "published": r["tflops"],
                "error": found["tflops"] / r["tflops"] - 1,
                "fits": found["evaluation"]["fits"],
                "memory": found["evaluation"]["memory"],
                "counted": r["counted"],
                "assumed": r["assumed"],
            }
        )
    return out


def summary(rows: list[dict]) -> dict:
    """Mean and largest absolute error of :func:`table`'s rows, by split."""
    found = {}
    for split in ("train", "test"):
        errors = [abs(r["error"]) for r in rows if r["split"] == split]
        found[split] = {"rows": len(errors), "mean": sum(errors) / len(errors), "max": max(errors)}
    return found


def sensitivity(names: list[str], eff: Efficiency = FITTED, change: float = 0.10) -> list:
    """For each row called in ``names``: the relative change of its prediction when each
    parameter is multiplied by ``1 - change`` and ``1 + change`` (the others fixed)."""
    out = []
    for r in (r for r in runs() if r["name"] in names):
        base = predict(r, eff)["tflops"]
        row = {"name": r["name"]}
        for f in fields(Efficiency):
            for sign in (-1, 1):
                moved = replace(eff, **{f.name: getattr(eff, f.name) * (1 + sign * change)})
                row[(f.name, sign)] = predict(r, moved)["tflops"] / base - 1
        out.append(row)
    return out
