"""Lab 10's mechanism exercise: the learner's DDP gradient hook and end-of-backward wait,
run inside :class:`~labsupport.labs.lab10_reducer.Reducer` on real ranks (2 ranks: the
course GPT with its tied weight; 3 ranks: two branches that different ranks take), and
checked against PyTorch's ``DistributedDataParallel`` and the course's: the gradients, and
the order in which the all-reduces started (each from the hook that completed its bucket,
asynchronously, in bucket order) against the gradient hooks, as recorded by
:func:`~labsupport.labs.lab10_reducer.watched_all_reduce`.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from labsupport.labs.cells import exercise, expect_close, launch_answer
from labsupport.labs.lab10_reducer import OUT_OF_ORDER, Reducer, watched_all_reduce
from labsupport.launch.errors import LaunchError
from labsupport.launch.runtime import device
from labsupport.models import random_tokens, tiny_gpt
from labsupport.parallel.data_parallel import DistributedDataParallel

# --------------------------------------------------------------------------- the cases


class Branch(nn.Module):
    """Two branches between a first and a last layer, ``a`` where ``use_a``, ``b``
    elsewhere: rank 0 takes one, the other ranks the other, as a router might send them
    (with a 2,176-byte cap, ``a``'s weight is a bucket alone)."""

    def __init__(self):
        super().__init__()
        self.first, self.a = nn.Linear(16, 32), nn.Linear(32, 32)
        self.b, self.last = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x, use_a: bool):
        h = torch.tanh(self.first(x))
        h = h + torch.tanh((self.a if use_a else self.b)(h))
        return self.last(h).pow(2).mean()


def _gpt_case(rank: int):
    torch.manual_seed(0)
    model = tiny_gpt(0, vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    return model, random_tokens(2, 8, 32, seed=rank), lambda out: out[1]


def _branch_case(rank: int):
    torch.manual_seed(0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    return Branch(), (x, rank == 0), lambda out: out


#: name: (what it covers, ranks, builder, bucket cap in bytes, find_unused_parameters).
CASES = {
    "gpt": ("the course GPT, its output layer tied to its embedding", 2, _gpt_case, 8192, False),
    "branch": ("two branches, rank 0 taking one, the rest the other", 3, _branch_case, 2176, True),
}


def _grads(module: nn.Module) -> dict:
    return {
        n: None if p.grad is None else p.grad.detach().cpu() for n, p in module.named_parameters()
    }


def _on_device(inputs):
    return tuple(t.to(device()) if isinstance(t, torch.Tensor) else t for t in inputs)


def hook_case(name: str, autograd_hook, finalize_backward) -> dict:
    """On every rank: one backward pass of case ``name`` through PyTorch's DDP, the
    course's, and no DDP (this rank's own gradients), then through a :class:`Reducer`
    that runs the learner's two functions, watched (last, so that a rank left waiting
    waits in the learner's code). Returns the gradients of each by parameter name, the
    events in order, and each parameter's bucket."""
    _, _, build, cap, unused = CASES[name]
    rank, out = dist.get_rank(), {}
    for kind, wrap in (
        ("torch", nn.parallel.DistributedDataParallel),
        ("ours", DistributedDataParallel),
        ("local", None),
    ):
        model, inputs, loss_of = build(rank)
        module = model.to(device())
        if wrap is not None:
            module = wrap(module, bucket_cap_mb=cap / 2**20, find_unused_parameters=unused)
        loss_of(module(*_on_device(inputs))).backward()
        out[kind] = _grads(model)
    model, inputs, loss_of = build(rank)
    reducer = Reducer(model.to(device()), cap, autograd_hook, finalize_backward)
    with watched_all_reduce(reducer):
        try:
            loss_of(reducer(*_on_device(inputs))).backward()
        except NotImplementedError:
            if ("finalize", None) not in reducer.events:
                raise  # the hook is the stub
            return {"finalize not written": True}
    reducer.events.append(("backward returned", None))
    out["learner"], out["events"] = _grads(model), reducer.events
    out["bucket"] = {reducer.names[id(p)]: b.index for b in reducer.buckets for p in b.params}
    return out


# --------------------------------------------------------------------------- the checker

HANG_HINT = (
    "A rank is waiting for an all-reduce that another rank never started: every rank must "
    "launch every bucket, in the same order. A parameter this rank's forward did not use "
    "comes to autograd_hook with .grad None: its bucket must still become complete."
)


def _hint(got, want, local, world: int) -> str:
    """The usual mistake behind gradients ``got`` where ``want`` was expected."""
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6)  # noqa: E731
    if close(got, want * world):
        return "it is the sum over the ranks: divide by the world size"
    if close(got, want / world):
        return "the average divided by the world size again: divide once"
    if close(got, local) or close(got, local / world):
        return (
            "this rank's own gradient, not the ranks' sum: an asynchronous all-reduce's "
            "result is in the bucket only after its work.wait(); copy back after it"
        )
    return "copy each gradient into bucket.view(param), and back from it after the wait"


def _check_gradients(r: dict, rank: int, label: str, world: int) -> None:
    for name, want in r["torch"].items():
        got, local = r["learner"][name], r["local"][name]
        if got is None:
            raise AssertionError(f"rank {rank}: {name} has no gradient ({label}): set .grad")
        local = torch.zeros_like(want) if local is None else local
        what = f"the gradient of {name} ({label}, {world} ranks)"
        hint = _hint(got, want, local, world) if got.shape == want.shape else ""
        expect_close(got, want, what, rank, hint, rtol=1e-4, atol=1e-6)  # torch's DDP
        expect_close(got, r["ours"][name], what, rank, hint, rtol=1e-4, atol=1e-6)


def _launches(events: list) -> list:
    return [(i, e) for i, e in enumerate(events) if e[0] == "all-reduce"]


def _check_counts(r: dict, rank: int, n: int) -> None:
    """Every bucket's buffer all-reduced once, and nothing else."""
    launches = _launches(r["events"])
    if any(e[1] is None for _, e in launches):
        raise AssertionError(
            f"rank {rank} all-reduced a tensor that is no bucket's buffer (a parameter's "
            ".grad?): all-reduce bucket.buffer, one all-reduce per bucket"
        )
    counts = [sum(e[1] == b for _, e in launches) for b in range(n)]
    if counts != [1] * n:
        never = [b for b, c in enumerate(counts) if c == 0]
        if never:
            raise AssertionError(
                f"rank {rank} never all-reduced bucket(s) {never} of {n}: launch a bucket's "
                "all-reduce once its pending count reaches 0"
            )
        raise AssertionError(f"rank {rank} all-reduced the buckets {counts} times: once each")


def _check_overlap(r: dict, rank: int, n: int) -> None:
    """Every bucket launched from the hook that completed it (with every bucket before
    it), asynchronously."""
    events = r["events"]
    launches = _launches(events)
    hooks = [i for i, e in enumerate(events) if e[0] == "hook"]
    pending = [sum(b == k for b in r["bucket"].values()) for k in range(n)]
    ready_at = {}  # bucket -> the hook event after which it and those before it are complete
    for i in hooks:
        pending[r["bucket"][events[i][1]]] -= 1
        for k in range(n):
            if k not in ready_at and not any(pending[: k + 1]):
                ready_at[k] = i
    for k in range(n):
        start = next(i for i, e in launches if e[1] == k)
        later = [h for h in hooks if h > ready_at[k]]
        if start > (later[0] if later else events.index(("finalize", None))):
            if all(i > hooks[-1] for i, _ in launches):
                raise AssertionError(
                    f"right gradients, but on rank {rank} all {n} all-reduces started after "
                    "backward's last gradient hook, so none of them overlaps the backward "
                    "pass: launch each bucket's all-reduce from autograd_hook, as soon as it "
                    "and the buckets before it are complete"
                )
            raise AssertionError(
                f"right gradients, but on rank {rank} bucket {k} was complete, with the "
                "buckets before it, and its all-reduce started only later: launch it from "
                "the hook that completes it"
            )
    if not all(e[2] for _, e in launches):
        raise AssertionError(
            f"right gradients, and the all-reduces start during backward, but on rank {rank} "
            "synchronously: dist.all_reduce without async_op=True returns only once the sum "
            "is there, and backward stops meanwhile. Launch with async_op=True, keep the work "
            "in bucket.work, and wait for it in finalize_backward"
        )


def _out_of_order(exc: LaunchError) -> str | None:
    root = exc.failures.get(exc.root_rank)
    found = re.search(OUT_OF_ORDER.format(r"(\d+)", r"(\d+)"), root.summary if root else "")
    if found is None:
        return None
    late, early = found.groups()
    return (
        f"rank {exc.root_rank} launched bucket {late}'s all-reduce before bucket {early}'s "
        "(its buckets complete in another order: a parameter its forward did not use comes "
        "first). The other ranks launch bucket 0 first, so their all-reduces would meet "
        "different buckets. Launch strictly in bucket order: reducer.next_bucket, while the "
        "next bucket is complete"
    )


@exercise
def check_ddp_hook(autograd_hook, finalize_backward, timeout: float = 120) -> str:
    """Exercise 4: ``autograd_hook(reducer, param)`` and ``finalize_backward(reducer)``
    inside :class:`Reducer` give PyTorch's DDP's gradients, and launch every bucket's
    all-reduce asynchronously, in bucket order, as soon as it is complete."""
    for name, (label, world, *_) in CASES.items():
        try:
            results = launch_answer(
                hook_case, world, HANG_HINT, timeout, args=(name, autograd_hook, finalize_backward)
            )
        except LaunchError as exc:
            verdict = _out_of_order(exc)
            if verdict is None:
                raise
            raise AssertionError(verdict) from None
        if results[0].get("finalize not written"):
            raise AssertionError("finalize_backward() still raises NotImplementedError: write it")
        n = 1 + max(results[0]["bucket"].values())
        for rank, r in enumerate(results):
            _check_counts(r, rank, n)
        for rank, r in enumerate(results):
            _check_gradients(r, rank, label, world)
        for rank, r in enumerate(results):
            _check_overlap(r, rank, n)
    return (
        "torch DDP's gradients on 2 and 3 ranks (a tied weight; branches the ranks take "
        "differently), every bucket all-reduced once, asynchronously, in bucket order, from "
        "the hook that completed it"
    )
