"""Lab 11, past 1F1B: the zero-bubble schedules, breadth-first against depth-first, and
the same steps run by ``torch.distributed.pipelining``'s own schedules.

The schedules are in :mod:`labsupport.parallel.schedules` and
:mod:`labsupport.parallel.zero_bubble`, the split backward in
:mod:`labsupport.parallel.split_backward`; the steps on real ranks are
:func:`labsupport.labs.lab11_pipeline.pipeline_steps`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labsupport.labs.lab11_pipeline import _stage_gradients, pipeline_steps
from labsupport.labs.lab11_stages import build, micro_batches
from labsupport.launch.runtime import device
from labsupport.parallel import pipeline_parallel as pp
from labsupport.parallel import schedules
from labsupport.parallel.parallel_state import Mesh

#: torch.distributed.pipelining's class for each of the course's schedules.
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def torch_pipelining_step(schedule: str, m: int) -> dict:
    """One step of the lab's GPT with ``torch.distributed.pipelining``'s own schedule
    (run on every rank): each rank wraps its stages in ``PipelineStage``, the schedule
    splits the batch into ``m`` micro-batches and runs them, the loss divided by ``m``
    as the course's executor does. torch leaves tied weights to the user: the two copies'
    gradients are added as the course's executor adds them. Returns this rank's
    gradients by the model's names, as :func:`pipeline_steps` does."""
    from torch.distributed import pipelining

    p, rank = dist.get_world_size(), dist.get_rank()
    style = schedules.style(schedule)
    v = 2 if style == "v" else 1
    model = build().to(device())
    chunks = pp.stage_modules(model, p, rank, v, style)
    stages = [
        pipelining.PipelineStage(chunks[c], schedules.stage_of(p, rank, c, style), p * v, device())
        for c in range(v)
    ]
    kind = getattr(pipelining, TORCH_SCHEDULES[schedule])
    step = kind(stages if v > 1 or schedule == "zb-h1" else stages[0], m, loss_fn=pp.cross_entropy)
    inputs, targets = micro_batches(m)
    first = any(s.first for s in chunks.values())
    last = any(s.last for s in chunks.values())
    step.step(
        *([torch.cat(inputs).to(device())] if first else []),
        **({"target": torch.cat(targets).to(device())} if last else {}),
    )
    pp.all_reduce_tied(chunks, Mesh(dp=1, tp=1, pp=p).process_groups().get("embedding"))
    return {"rank": rank, "gradients": _stage_gradients(chunks, model)}


def zero_bubble_steps(cases: list, torch_case: tuple, **wait) -> dict:
    """This rank's :func:`~labsupport.labs.lab11_pipeline.pipeline_steps` for ``cases``
    (timed, gradients kept), then torch's schedule on ``torch_case`` (``(name, m)``): two
    experiments in one launch (run on every rank)."""
    ours = pipeline_steps(cases, gradients=True, **wait)
    return {"ours": ours, "torch": torch_pipelining_step(*torch_case)}


def chunk_runs(actions: list) -> int:
    """Stretches of consecutive computations on the same chunk in a rank's list: how many
    times FSDP would gather a chunk's weights in a step if it freed them between."""
    chunks = [a.chunk for a in actions if a.kind not in schedules.COMM]
    return 1 + sum(a != b for a, b in zip(chunks, chunks[1:], strict=False))
