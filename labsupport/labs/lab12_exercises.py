"""Lab 12's mechanism exercises: Megatron's conjugate operators *f* and *g* as autograd
functions, then the column→row parallel MLP built with them, both checked on 2 and 4
real ranks against the dense MLP of the course GPT and the library's tensor-parallel
layers, forward and backward.

*f* and *g* are Megatron-LM's ``copy_to_tensor_model_parallel_region`` and
``reduce_from_tensor_model_parallel_region`` (``megatron/core/tensor_parallel/
mappings.py``; Shoeybi et al. 2019, section 3, figure 3). The learner's code runs only
on the ranks, under a timeout: a collective that not every rank calls comes back as a
verdict instead of hanging the notebook. What the ranks computed comes back as tensors,
and the verdict is built here, with :func:`~labsupport.labs.cells.expect_close`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.labs.cells import exercise, expect_close, launch_answer
from labsupport.labs.lab12_tensor_parallel import BATCH, BLOCK_GPT, TOL
from labsupport.models import tiny_gpt
from labsupport.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    reduce_from_tensor_model_parallel_region,
)

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


def settle(step: str) -> None:
    """Wait, on the rendezvous store, until every rank has reached ``step``. A collective
    that some ranks skipped then waits for its peers for ever, as on NCCL (a hang that
    :func:`launch_answer` reports), instead of pairing, on gloo, with the others' next
    collective of another size (and aborting the rank)."""
    store = dist.distributed_c10d._get_default_store()
    if store.add(step, 1) == dist.get_world_size():
        store.set(f"{step}/all", "1")
    store.wait([f"{step}/all"])


def column_row(f, g, x, fc_weight, fc_bias, proj_weight, proj_bias):
    """The column→row parallel MLP with operators ``f`` and ``g``: ``f``, this rank's
    output features of ``c_fc``, GELU, its input features of ``c_proj``, ``g``, the bias
    once (Megatron's ``ParallelMLP``)."""
    h = F.gelu(F.linear(f(x), fc_weight, fc_bias))
    return g(F.linear(h, proj_weight)) + proj_bias


def _cut(mlp, t: int, rank: int, grad: bool = False) -> dict:
    """This rank's shards of the dense MLP's weights (or of their gradients): the rows of
    ``c_fc`` for its output features, the columns of ``c_proj`` for its input features,
    ``c_proj``'s bias whole (added once, after *g*)."""
    of = (lambda p: p.grad) if grad else (lambda p: p.detach())  # noqa: E731
    return {
        "fc_weight": of(mlp.c_fc.weight).chunk(t)[rank],
        "fc_bias": of(mlp.c_fc.bias).chunk(t)[rank],
        "proj_weight": of(mlp.c_proj.weight).chunk(t, dim=1)[rank],
        "proj_bias": of(mlp.c_proj.bias),
    }


def _shards(mlp, t: int, rank: int) -> dict:
    """This rank's shards, as leaves that take gradients."""
    return {n: w.clone().requires_grad_(True) for n, w in _cut(mlp, t, rank).items()}


def _run(mlp_fn, x, shards) -> dict:
    """Output and gradients of ``mlp_fn`` on the loss ``sum(y²)``, by :data:`NAMES`."""
    x = x.clone().requires_grad_(True)
    y = mlp_fn(x, *shards.values())
    torch.as_tensor(y).square().sum().backward()
    grads = {"x": x.grad} | {n: w.grad for n, w in shards.items()}
    return {"output": y.detach()} | {
        n: torch.zeros(0) if g is None else g for n, g in grads.items()
    }


def _library(x, shards) -> dict:
    """The same shards in the library's ``ColumnParallelLinear`` and ``RowParallelLinear``."""
    width, hidden = x.size(-1), shards["fc_weight"].size(0) * dist.get_world_size()
    column, row = ColumnParallelLinear(width, hidden), RowParallelLinear(hidden, width)
    with torch.no_grad():
        for layer, w, b in ((column, "fc_weight", "fc_bias"), (row, "proj_weight", "proj_bias")):
            layer.weight.copy_(shards[w])
            layer.bias.copy_(shards[b])
    run = _run(lambda x, *_: row(F.gelu(column(x))), x, {})
    return run | {
        "fc_weight": column.weight.grad,
        "fc_bias": column.bias.grad,
        "proj_weight": row.weight.grad,
        "proj_bias": row.bias.grad,
    }


def _operators(f, g) -> dict:
    """``f`` and ``g`` alone, on a tensor and a gradient that differ from rank to rank."""
    rank = dist.get_rank()
    x = (torch.arange(6.0).reshape(2, 3) + 1) * (rank + 1)
    found = {}
    for name, op in (("f", f), ("g", g)):
        leaf = x.clone().requires_grad_(True)
        out = op(leaf)
        grad = torch.full_like(x, 0.5) * (rank + 2)
        torch.as_tensor(out).backward(grad)
        settle(f"operator {name}")
        found[name] = {"output": out.detach(), "input gradient": leaf.grad, "x": x, "grad": grad}
    return found


def mlp_case(f=None, g=None, mlp=None) -> dict:
    """On every rank: the dense MLP of the course GPT's first block, the learner's
    parallel MLP (``mlp``, or :func:`column_row` with the learner's ``f`` and ``g``) and
    the library's on this rank's shards; with ``f`` and ``g``, also the two alone."""
    t, rank = dist.get_world_size(), dist.get_rank()
    dense = tiny_gpt(0, **BLOCK_GPT).h[0].mlp
    with torch.no_grad():  # biases of their own (the GPT starts them at zero): a bias
        for bias in (dense.c_fc.bias, dense.c_proj.bias):  # added t times must show
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(BATCH, 4, BLOCK_GPT["n_embd"], generator=torch.Generator().manual_seed(1))
    x_dense = x.clone().requires_grad_(True)
    dense(x_dense).square().sum().backward()
    want = {"output": dense(x).detach(), "x": x_dense.grad} | _cut(dense, t, rank, grad=True)
    found = {"rank": rank, "t": t, "dense": want, "bias": dense.c_proj.bias.detach()}
    found["units"] = _operators(f, g) if f is not None else None
    answer = mlp or (lambda *a: column_row(f, g, *a))
    found["got"] = _run(answer, x, _shards(dense, t, rank))
    settle("the learner's MLP")
    found["library"] = _library(x, _shards(dense, t, rank))
    partial = _shards(dense, t, rank)  # what a rank computes before g sums
    with torch.no_grad():
        h = F.gelu(F.linear(x, partial["fc_weight"], partial["fc_bias"]))
        swapped = F.gelu(F.linear(t * x, partial["fc_weight"], partial["fc_bias"]))
        found["partial"] = F.linear(h, partial["proj_weight"]) + partial["proj_bias"]
        found["swapped"] = F.linear(swapped, partial["proj_weight"]) + partial["proj_bias"]
    no_f = lambda *a: column_row(lambda x: x, reduce_from_tensor_model_parallel_region, *a)  # noqa: E731
    found["input gradient without f"] = _run(no_f, x, _shards(dense, t, rank))["x"]
    return found


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
    input gradient and weight-shard gradients equal ``against``'s ("dense" or
    "library"); the verdict says whether the forward pass was right, and ``hints``
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
    parallel MLP on this rank's shards, against the dense MLP and the library's
    ``ColumnParallelLinear`` → ``RowParallelLinear`` on 2 and 4 ranks."""
    for t in SIZES:
        results = launch_answer(mlp_case, t, HANG, timeout, kwargs={"mlp": fn})
        compare(results, "dense", {})
        compare(results, "library", {}, " (against the library's layers)")
    return (
        "on 2 and 4 ranks, your parallel MLP gives the dense MLP's output, input gradient "
        "and every weight shard's gradient, as the library's ColumnParallelLinear → "
        "RowParallelLinear do"
    )
