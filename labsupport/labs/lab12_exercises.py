"""Lab 12's mechanism exercises: Megatron's conjugate operators *f* and *g* as autograd
functions, then the column→row parallel MLP built with them, both checked on 2 and 4
real ranks against the dense MLP of the course GPT, the library's tensor-parallel
layers and torch's (``ColwiseParallel`` → ``RowwiseParallel``), forward and backward.

*f* and *g* are Megatron-LM's ``copy_to_tensor_model_parallel_region`` and
``reduce_from_tensor_model_parallel_region`` (``megatron/core/tensor_parallel/
mappings.py``; Shoeybi et al. 2019, section 3, figure 3). The learner's code runs only
on the ranks, under a timeout: a collective that not every rank calls comes back as a
verdict instead of hanging the notebook. What the ranks computed
(:mod:`labsupport.labs.lab12_mlp_runs`) comes back as tensors, and the verdict is built
here, with :func:`~labsupport.labs.cells.expect_close`.
"""

from __future__ import annotations

import torch

from labsupport.labs.cells import exercise, expect_close, launch_answer
from labsupport.labs.lab12_mlp_runs import mlp_case
from labsupport.labs.lab12_tensor_parallel import TOL

SIZES = (2, 4)
#: The MLP's tensors, as the verdicts name them: this rank's shards of the weights.
NAMES = {
    "output": "the MLP's output",
    "x": "the gradient of the input x",
    "fc_weight": "the gradient of this rank's rows of c_fc.weight",
    "fc_bias": "the gradient of this rank's slice of c_fc.bias",
    "proj_weight": "the gradient of this rank's columns of c_proj.weight",
    "proj_bias": "the gradient of c_proj.bias",
}
HANG = (
    "A collective is called on some ranks only, or in a different order on different "
    "ranks: every rank must run the same all-reduces, in the same order (no `if rank "
    "== 0:` around one)."
)


# --------------------------------------------------------------------------- verdicts


def _same(a, b) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), **TOL))


#: What an operator's wrong result usually means: (operator, what, looks like) -> hint.
MISTAKES = {
    ("f", "output", "sum"): "your f all-reduces in the forward pass, where every rank "
    "already holds the same whole input",
    ("f", "output", "mean"): "your f averages in the forward pass, where every rank already "
    "holds the same whole input",
    ("f", "input gradient", "own"): "your f's backward passes the gradient through: each "
    "rank's is only its share of the input's gradient, and nothing adds the shares",
    ("f", "input gradient", "mean"): "your f's backward averages the ranks' gradients (data "
    "parallelism's habit): they are shares of one gradient, so they add up, with no 1/t",
    ("g", "output", "own"): "your g's forward returns this rank's partial sum: nothing adds "
    "the ranks' partial sums",
    ("g", "output", "mean"): "your g's forward averages the ranks' partial sums: they are "
    "parts of one sum, with no 1/t",
    ("g", "input gradient", "sum"): "your g's backward all-reduces a gradient that is already "
    "whole on every rank, counting it t times",
    ("g", "input gradient", "mean"): "your g's backward averages a gradient that is already "
    "whole on every rank",
}


#: What each operator alone must give: (result, from which input, looks like for f, for g).
CHECKS = (
    ("output", "x", {"f": "own", "g": "sum"}),
    ("input gradient", "grad", {"f": "sum", "g": "own"}),
)


def operator_mistakes(results: list[dict]) -> dict:
    """``{"forward": [hints], "backward": [hints]}``: what the learner's *f* and *g*
    do wrong alone, each result named by what it looks like (this rank's own tensor, the
    sum over the ranks, or their mean)."""
    found = {"forward": [], "backward": []}
    if results[0]["units"] is None:
        return found
    t = len(results)
    for op in ("f", "g"):
        for what, given, right in CHECKS:
            total = sum(r["units"][op][given] for r in results)
            looks = {"own": None, "sum": total, "mean": total / t}
            for r in results:
                looks["own"] = r["units"][op][given]
                got = r["units"][op][what]
                if _same(got, looks[right[op]]):
                    continue
                like = next((k for k, v in looks.items() if _same(got, v)), None)
                hint = MISTAKES.get((op, what, like), f"your {op} gives the wrong {what}")
                found["forward" if what == "output" else "backward"].append(hint)
                break
    if found["forward"] == [MISTAKES["f", "output", "sum"], MISTAKES["g", "output", "own"]]:
        found["forward"] = ["f and g look swapped: " + "; ".join(found["forward"])]
    return found


PASSES = {
    "forward": "the forward pass is wrong",
    "backward": "the forward pass is right, but the backward pass is not",
}


def compare(results: list[dict], against: str, hints: dict, what: str = "") -> None:
    """An ``AssertionError`` naming the rank and the tensor unless every rank's output,
    input gradient and weight-shard gradients equal ``against``'s ("dense", "library" or
    "torch"); the verdict says whether the forward pass was right, and ``hints``
    ``{"forward": [...], "backward": [...]}`` say what usually causes it."""
    t = len(results)
    for stage, names in (("forward", ["output"]), ("backward", list(NAMES)[1:])):
        for r in results:
            for name in names:
                hint = "; ".join(hints.get(stage) or []) or _shape_hint(r, name)
                try:
                    expect_close(r["got"][name], r[against][name], NAMES[name], r["rank"], hint,
                                 **TOL)  # fmt: skip
                except AssertionError as exc:
                    passes = PASSES[stage]
                    raise AssertionError(f"on {t} ranks{what}, {passes}: {exc}") from None


def _shape_hint(r: dict, name: str) -> str:
    """What a wrong MLP output or input gradient looks like (without the operators)."""
    got, t = r["got"][name], r["t"]
    if name == "output":
        if _same(got, r["partial"]):
            return "it is this rank's partial sum: no all-reduce adds the ranks' partial sums"
        if _same(got, r["swapped"]):
            return (
                "the input is summed over the ranks in the forward pass and the partial sums "
                "are not: have f and g swapped places?"
            )
        if _same(got, r["dense"]["output"] + (t - 1) * r["bias"]):
            return "c_proj's bias is added on every rank before the sum: add it once, after"
    if name == "x" and _same(got, r["input gradient without f"]):
        return (
            "it is this rank's share of the input's gradient: nothing adds the ranks' shares "
            "in the backward pass"
        )
    return ""


# --------------------------------------------------------------------------- exercises


@exercise
def check_f_and_g(f, g, timeout: float = 120) -> str:
    """Exercise 4: ``f(x)`` and ``g(x)``, Megatron's conjugate operators as autograd
    functions, inside the checker's column→row MLP on 2 and 4 ranks, then alone."""
    for t in SIZES:
        results = launch_answer(mlp_case, t, HANG, timeout, kwargs={"f": f, "g": g})
        mistakes = operator_mistakes(results)
        compare(results, "dense", mistakes, " (the MLP of f, c_fc, GELU, c_proj, g)")
        for stage, hints in mistakes.items():
            if hints:  # right inside the MLP, wrong alone
                raise AssertionError(
                    f"on {t} ranks the MLP is right, but alone, on tensors that differ from "
                    f"rank to rank, {'; '.join(hints)} ({stage} pass)"
                )
    return (
        "on 2 and 4 ranks, the column→row MLP built with your f and g gives the dense MLP's "
        "output, input gradient and every weight shard's gradient"
    )


@exercise
def check_parallel_mlp(fn, timeout: float = 120) -> str:
    """Exercise 5: ``fn(x, fc_weight, fc_bias, proj_weight, proj_bias)``, the column→row
    parallel MLP on this rank's shards, against the dense MLP, the library's
    ``ColumnParallelLinear`` → ``RowParallelLinear`` and torch's ``ColwiseParallel`` →
    ``RowwiseParallel`` on 2 and 4 ranks."""
    for t in SIZES:
        results = launch_answer(mlp_case, t, HANG, timeout, kwargs={"mlp": fn})
        compare(results, "dense", {})
        compare(results, "library", {}, " (against the library's layers)")
        compare(results, "torch", {}, " (against torch's ColwiseParallel → RowwiseParallel)")
    return (
        "on 2 and 4 ranks, your parallel MLP gives the dense MLP's output, input gradient "
        "and every weight shard's gradient, as the library's ColumnParallelLinear → "
        "RowParallelLinear and torch's ColwiseParallel → RowwiseParallel do"
    )
