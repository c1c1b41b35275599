"""Lab 14: the lab's training with PyTorch's FSDP2 and with DeepSpeed's ZeRO, to hold
against :mod:`labsupport.parallel.zero` and plain Adam (:mod:`labsupport.labs.lab14_zero`).

* FSDP2: ``fully_shard`` on every transformer block and on the root, over a 1-D device
  mesh of the data-parallel ranks (PyTorch's ZeRO-3); then the whole state dict gathered
  on rank 0, as a checkpoint in one file would be, its bytes counted on every rank.
* DeepSpeed: ``deepspeed.initialize`` with ZeRO stage 1, 2 or 3, its ``"Adam"`` with
  ``torch_adam`` (``torch.optim.Adam``) and ``adam_w_mode`` off: DeepSpeed's "Adam" is
  AdamW unless told otherwise, and torch's AdamW decays weights by 0.01 by default. On a
  CPU, ``DS_ACCELERATOR=cpu`` selects DeepSpeed's CPU accelerator; it runs its
  collectives over the gloo process group ``labsupport.launch`` made. Its first use
  compiles a small C++ extension (``deepspeed_shm_comm``, about a minute, cached in
  ``~/.cache/torch_extensions``): :func:`deepspeed_warmup` builds it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import torch
import torch.distributed as dist

from labsupport.comm.metrics import mean_over_ranks
from labsupport.labs.lab14_zero import (
    BATCH,
    LR,
    STAGES,
    STEPS,
    adam_on_shares,
    build,
    cpu_params,
    my_share,
)
from labsupport.launch.progress import status
from labsupport.launch.runtime import device
from labsupport.parallel.deepspeed_setup import (
    BUILDING_SHM_COMM,
    shm_comm_needs_building,
    use_deepspeed_accelerator,
)


def train_fsdp2(steps: int = STEPS) -> dict:
    """FSDP2 on every rank: the loss of each step, the whole parameters after training,
    and the bytes of the full state dict (model and Adam) this rank holds after
    gathering it on rank 0 with its tensors offloaded to the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build()
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, losses = adam_on_shares(model, steps)
    sharded = sum(p.to_local().nbytes for p in model.parameters())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optimizer = get_state_dict(model, opt, options=options)
    full = sum(t.nbytes for t in _tensors(weights)) + sum(t.nbytes for t in _tensors(optimizer))
    params = {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}
    return {
        "rank": dist.get_rank(),
        "losses": losses,
        "params": params,
        "sharded_weight_bytes": sharded,
        "full_state_dict_bytes": full,
    }


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


def _import_deepspeed():
    """DeepSpeed, quietly: the accelerator of :func:`~labsupport.parallel.deepspeed_setup.
    use_deepspeed_accelerator`, its log muted."""
    use_deepspeed_accelerator()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        import deepspeed
    deepspeed.utils.logging.logger.setLevel(logging.ERROR)
    return deepspeed


def _quiet_ranks() -> None:
    """Mute the deprecation warnings DeepSpeed's collectives raise on every call."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="deepspeed")


def deepspeed_config(stage: int, world: int) -> dict:
    """The DeepSpeed configuration of the lab's run on ``world`` ranks: the whole batch
    split over them, one micro-batch each, torch's Adam (not AdamW), ZeRO ``stage``, fp32."""
    return {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def train_deepspeed(stages=STAGES, steps: int = STEPS) -> dict:
    """DeepSpeed ZeRO at each of ``stages`` in turn (run on every rank): ``{stage:
    {"losses", "params"}}``, the whole parameters gathered from ZeRO-3's shards."""
    deepspeed = _import_deepspeed()
    _quiet_ranks()
    runs = {}
    for stage in stages:
        model = build()
        with contextlib.redirect_stdout(io.StringIO()):
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=deepspeed_config(stage, dist.get_world_size()),
            )
        losses = []
        for step in range(steps):
            loss = engine(*my_share(step))[1]
            engine.backward(loss)
            engine.step()
            losses.append(mean_over_ranks(loss))
        gathered = (
            deepspeed.zero.GatheredParameters(list(model.parameters()))
            if stage == 3
            else contextlib.nullcontext()
        )
        with gathered:
            runs[stage] = {"losses": losses, "params": cpu_params(model)}
        engine.destroy()
    return runs


def deepspeed_warmup() -> str:
    """Import DeepSpeed and build (or load from its cache) the C++ extension its
    communication backend compiles on first use; returns DeepSpeed's version. While it
    builds (the first time only), rank 0 says so in the launch's live area, which keeps
    nothing of it: the cell's record is the same whether it was built or not."""
    deepspeed = _import_deepspeed()
    _quiet_ranks()
    if dist.get_rank() == 0 and shm_comm_needs_building():
        status(BUILDING_SHM_COMM)
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed.__version__


def deepspeed_zero2_estimate(num_params: float, gpus_per_node: int, nodes: int) -> int:
    """DeepSpeed's own estimate of one GPU's bytes of model states under ZeRO-2 without
    offload (``estimate_zero2_model_states_mem_needs`` in ``runtime/zero/
    stage_1_and_2.py``): ``2 Ψ + 18 Ψ / N``, its 18 counting fp16 and fp32 gradients."""
    _import_deepspeed()
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(
        num_params, gpus_per_node, nodes, cpu_offload=False
    )
    return gpu
