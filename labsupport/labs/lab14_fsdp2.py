"""Lab 14, FSDP2 in practice, and prefetching in the course's own ZeRO-3.

:func:`fsdp2_practice` runs the knobs of ``torch.distributed.fsdp.fully_shard`` on the
lab's GPT (:mod:`labsupport.labs.lab14_zero`), each against plain Adam or against its
own default: HSDP on a 2-D mesh (``(Replicate(), Shard(0))``: shard inside a group,
replicate across groups), ``reshard_after_forward`` as ``True``, ``False`` and an
``int``, ``MixedPrecisionPolicy`` (bf16 compute, fp32 reduction),
``set_requires_gradient_sync`` for gradient accumulation, and explicit prefetching
(``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``).
``CPUOffloadPolicy`` needs an accelerator to offload from, and is not run here.

:func:`zero3_prefetch` measures :class:`labsupport.parallel.zero.ZeRO`'s stage 3 with
``prefetch`` 0, 1 and 2: the most bytes of gathered weights it holds at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labsupport.comm.metrics import mean_over_ranks
from labsupport.labs.lab14_zero import (
    LAB_GPT,
    LR,
    STEPS,
    adam_on_shares,
    build,
    cpu_params,
    my_share,
)
from labsupport.launch.runtime import device
from labsupport.models import tiny_gpt
from labsupport.parallel.zero import ZeRO

#: HSDP's mesh on 4 ranks: 2 groups of 2 (on a cluster: the GPUs of a node shard, the
#: nodes replicate).
HSDP_MESH = (2, 2)


def _sharded(model, **options):
    """``fully_shard`` on every block, then on the root, as the lab's FSDP2 run does."""
    from torch.distributed.fsdp import fully_shard

    for block in model.h:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def _train(model, steps: int = STEPS) -> dict:
    _, losses = adam_on_shares(model, steps)
    params = {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _block_bytes(model) -> int:
    """Bytes of the blocks' parameters this rank holds as registered now (a DTensor's
    local shard, or the whole tensor)."""
    local = [getattr(p, "_local_tensor", p) for p in model.h.parameters()]
    return sum(t.nbytes for t in local)


def fsdp2_practice() -> dict:
    """Each knob on this rank (run on 4 ranks): what it changes, and the training it
    gives; then :func:`zero3_prefetch`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {"rank": dist.get_rank()}
    mesh = init_device_mesh(device().type, HSDP_MESH, mesh_dim_names=("replicate", "shard"))
    hsdp = _sharded(build(), mesh=mesh)
    weight = hsdp.h[0].mlp.c_fc.weight
    out["hsdp"] = {
        "placements": str(tuple(weight.placements)),
        "local": tuple(weight.to_local().shape),
        "whole": tuple(weight.shape),
    } | _train(hsdp)

    out["after forward"], out["whole blocks"] = {}, _block_bytes(build())
    for reshard in (True, False, 2):
        model = _sharded(build(), reshard_after_forward=reshard)
        loss = model(*my_share(0))[1]
        out["after forward"][str(reshard)] = _block_bytes(model)
        loss.backward()

    seen = []
    model = build()
    model.h[0].mlp.c_fc.register_forward_pre_hook(
        lambda m, args: seen.append((str(m.weight.dtype), str(args[0].dtype)))
    )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _sharded(model, mp_policy=policy)
    loss = model(*my_share(0))[1]
    loss.backward()
    weight = model.h[0].mlp.c_fc.weight
    out["mixed"] = {
        "compute": seen[0],
        "stored": str(weight.dtype),
        "gradient": str(weight.grad.dtype),
        "loss": mean_over_ranks(loss),
        "fp32 loss": mean_over_ranks(build()(*my_share(0))[1]),
    }

    model = _sharded(build())  # two micro-batches, the first one's gradients kept unreduced
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    idx, targets = my_share(0)
    parts = [slice(0, 1), slice(1, idx.size(0))]
    for i, part in enumerate(parts):
        model.set_requires_gradient_sync(i == len(parts) - 1)
        weight = (part.stop - part.start) / idx.size(0)  # the mean over this rank's share
        (model(idx[part], targets[part])[1] * weight).backward()
    opt.step()
    out["accumulated"] = {
        n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()
    }

    model = _sharded(build())
    blocks = list(model.h)
    for here, after in zip(blocks, blocks[1:], strict=False):
        here.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([here])
    out["prefetch"] = _train(model)
    out["zero3"] = zero3_prefetch()  # in the same launch
    return out


def zero3_prefetch(ks=(0, 1, 2), layers: int = 4) -> dict:
    """The course's ZeRO-3 on a ``layers``-block GPT, one step with ``prefetch=k`` for each
    ``k``: the most bytes of gathered weights held at once (run on every rank), each
    unit's padded bytes (the blocks, then the root), the loss and the parameters."""
    out = {}
    for k in ks:
        model = tiny_gpt(0, **(LAB_GPT | {"n_layer": layers})).to(device())
        zero = ZeRO(model, 3, prefetch=k, lr=LR)
        loss = model(*my_share(0))[1]
        loss.backward()
        zero.step()
        for _, unit in zero.units:
            unit.gather()
        out[k] = {
            "peak": zero.gathered_peak,
            "units": [unit.padded * unit.full.element_size() for _, unit in zero.units],
            "loss": mean_over_ranks(loss),
            "params": cpu_params(model),
        }
    return out
