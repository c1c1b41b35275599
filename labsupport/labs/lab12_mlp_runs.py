"""Lab 12's exercises, what the ranks run: the dense MLP of the course GPT's first block,
the learner's parallel MLP (or the checker's, with the learner's *f* and *g*), the
library's ``ColumnParallelLinear`` → ``RowParallelLinear`` and torch's ``ColwiseParallel``
→ ``RowwiseParallel`` (``torch.distributed.tensor.parallel``) on the same shards, each
one's output and gradients returned as tensors for :mod:`labsupport.labs.lab12_exercises`
to compare.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.labs.lab12_tensor_parallel import BATCH, BLOCK_GPT
from labsupport.launch.runtime import device
from labsupport.models import tiny_gpt
from labsupport.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    reduce_from_tensor_model_parallel_region,
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
    column = ColumnParallelLinear(width, hidden).to(device())
    row = RowParallelLinear(hidden, width).to(device())
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


def _torch(x, dense) -> dict:
    """The MLP ``dense`` (no gradients yet) split by torch's tensor parallelism: ``c_fc``
    ``ColwiseParallel``, ``c_proj`` ``RowwiseParallel``, over a mesh of the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    plan = {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    mlp = parallelize_module(dense, mesh, plan)  # in place: its weights become DTensors
    run = _run(lambda x, *_: mlp(x), x, {})
    return run | {
        "fc_weight": mlp.c_fc.weight.grad.to_local(),
        "fc_bias": mlp.c_fc.bias.grad.to_local(),
        "proj_weight": mlp.c_proj.weight.grad.to_local(),
        "proj_bias": mlp.c_proj.bias.grad.to_local(),
    }


def _operators(f, g) -> dict:
    """``f`` and ``g`` alone, on a tensor and a gradient that differ from rank to rank."""
    rank = dist.get_rank()
    x = (torch.arange(6.0, device=device()).reshape(2, 3) + 1) * (rank + 1)
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
    dense, seed = tiny_gpt(0, **BLOCK_GPT).h[0].mlp, torch.Generator().manual_seed(2)
    with torch.no_grad():  # biases of their own (the GPT starts them at zero): a bias
        for bias in (dense.c_fc.bias, dense.c_proj.bias):  # added t times must show
            bias.copy_(torch.randn(bias.shape, generator=seed))
    dense = dense.to(device())
    untrained = copy.deepcopy(dense)  # no gradients yet, for torch's
    x = torch.randn(BATCH, 4, BLOCK_GPT["n_embd"], generator=torch.Generator().manual_seed(1))
    x = x.to(device())
    x_dense = x.clone().requires_grad_(True)
    dense(x_dense).square().sum().backward()
    want = {"output": dense(x).detach(), "x": x_dense.grad} | _cut(dense, t, rank, grad=True)
    found = {"rank": rank, "t": t, "dense": want, "bias": dense.c_proj.bias.detach()}
    found["units"] = _operators(f, g) if f is not None else None
    answer = mlp or (lambda *a: column_row(f, g, *a))
    found["got"] = _run(answer, x, _shards(dense, t, rank))
    settle("the learner's MLP")
    found["library"] = _library(x, _shards(dense, t, rank))
    found["torch"] = _torch(x, untrained)
    partial = _shards(dense, t, rank)  # what a rank computes before g sums
    with torch.no_grad():
        h = F.gelu(F.linear(x, partial["fc_weight"], partial["fc_bias"]))
        swapped = F.gelu(F.linear(t * x, partial["fc_weight"], partial["fc_bias"]))
        found["partial"] = F.linear(h, partial["proj_weight"]) + partial["proj_bias"]
        found["swapped"] = F.linear(swapped, partial["proj_weight"]) + partial["proj_bias"]
    no_f = lambda *a: column_row(lambda x: x, reduce_from_tensor_model_parallel_region, *a)  # noqa: E731
    found["input gradient without f"] = _run(no_f, x, _shards(dense, t, rank))["x"]
    return _on_cpu(found)


def _on_cpu(found):
    """``found`` with every tensor on the CPU, for the notebook's process."""
    if isinstance(found, dict):
        return {k: _on_cpu(v) for k, v in found.items()}
    return found.detach().cpu() if isinstance(found, torch.Tensor) else found
