"""Pipeline schedules as data, and the executor: every schedule, several pipeline depths,
gives the gradients of one process running the whole batch."""

from __future__ import annotations

import pytest
import torch

from labsupport import LaunchError, launch
from labsupport.models import GPT, GPTConfig, random_tokens
from labsupport.parallel import pipeline_parallel as pp
from labsupport.parallel import schedules as S

MB, T = 2, 8  # sequences per micro-batch, tokens per sequence
# float32: a pipeline sums each parameter's gradient over micro-batches in the same
# order as one process over the whole batch, but the per-micro-batch mean and the /m
# are separate roundings: differences ~1e-7 relative; gradients are O(0.01-1).
TOL = {"rtol": 1e-5, "atol": 1e-6}


def config(layers: int, tied: bool = True) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=T, n_layer=layers, n_head=2, n_embd=16,
                     tie_weights=tied)  # fmt: skip


def gpt(layers: int, tied: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(config(layers, tied))


def micro_batches(m: int):
    idx, targets = random_tokens(m * MB, T, 64, seed=5)
    return list(idx.split(MB)), list(targets.split(MB))


def reference_grads(layers: int, m: int, tied: bool) -> dict:
    model = gpt(layers, tied)
    idx, targets = micro_batches(m)
    model(torch.cat(idx), torch.cat(targets))[1].backward()
    return {n: p.grad for n, p in model.named_parameters()}


def stage_grads(chunks: dict) -> dict:
    """The gradients this rank's chunks hold, by the GPT's parameter names."""
    grads = {}
    for stage in chunks.values():
        owned = {id(q) for q in stage.parameters()}
        for n, q in stage.gpt[0].named_parameters():
            if id(q) in owned and q.grad is not None:
                grads[n] = q.grad.clone()
    return grads


def pipeline_grads(name: str, layers: int, m: int, v: int, tied: bool) -> dict:
    import torch.distributed as dist

    p, rank = dist.get_world_size(), dist.get_rank()
    chunks = pp.stage_modules(gpt(layers, tied), p, rank, v)
    actions = S.build(name, p, m, v)[rank]
    idx, targets = micro_batches(m)
    out = pp.run(chunks, actions, idx, targets, (MB, T, 16), v=v)
    return {"grads": stage_grads(chunks), "losses": out["losses"], "peak": out["peak_microbatches"]}


CASES = [
    ("gpipe", 2, 3, 1), ("gpipe", 3, 1, 1), ("gpipe", 4, 5, 1),
    ("1f1b", 2, 1, 1), ("1f1b", 3, 5, 1), ("1f1b", 4, 2, 1), ("1f1b", 4, 6, 1),
    ("naive", 3, 2, 1), ("interleaved", 2, 4, 2), ("interleaved", 3, 3, 2),
]  # fmt: skip


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_every_schedule_gives_the_gradients_of_one_process(name, p, m, v):
    layers = p * v
    results = launch(pipeline_grads, p, args=(name, layers, m, v, True), timeout=180)
    got = {}
    for r in results:
        for n, g in r["grads"].items():
            if n == "lm_head.weight":  # the last stage's copy of the tied embedding
                n = "wte.weight"
            if n in got:  # both copies of the tied matrix end with the same gradient
                torch.testing.assert_close(got[n], g, **TOL)
            got[n] = g
    want = reference_grads(layers, m, True)
    want.pop("lm_head.weight", None)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=n)
    assert sorted(results[-1]["losses"]) == list(range(m))


def test_activations_held_gpipe_all_1f1b_at_most_p():
    gp = launch(pipeline_grads, 4, args=("gpipe", 4, 8, 1, False), timeout=180)
    ofob = launch(pipeline_grads, 4, args=("1f1b", 4, 8, 1, False), timeout=180)
    assert [r["peak"] for r in gp] == [8, 8, 8, 8]
    assert [r["peak"] for r in ofob] == [4, 3, 2, 1]  # p - rank micro-batches in flight


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_schedules_never_deadlock_and_have_the_formulas_bubble(name, p, m):
    v = 2 if name == "interleaved" else 1
    try:
        lists = S.build(name, p, m, v)
    except ValueError as exc:
        assert name == "interleaved" and (m % p or p < 2), exc
        return
    timeline = S.simulate(lists, v)
    for rank in timeline:
        done = sorted(a for a, _ in rank)
        want = sorted(S.Action(k, mb, c) for k in ("forward", "backward")
                      for mb in range(m) for c in range(v))  # fmt: skip
        assert done == want
    bubble = S.measured_bubble(timeline)
    expected = (p - 1) / p if name == "naive" else S.bubble_fraction(p, m, v)["of_total"]
    assert bubble == pytest.approx(expected, abs=1e-12)


def test_the_simulator_finds_a_deadlock():
    # both ranks send first and receive after, in separate batches: a cycle
    a = [S.Action("send_grad", 0, 0), S.Action("forward", 0, 0), S.Action("recv_act", 0, 0)]
    b = [S.Action("send_act", 1, 0), S.Action("forward", 0, 0), S.Action("recv_grad", 1, 0)]
    with pytest.raises(RuntimeError, match="deadlocks"):
        S.simulate([b, a])


def test_a_schedule_that_cannot_run_is_refused_before_any_message():
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        S.build("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="every stage needs at least one block"):
        pp.partition(3, 4)
    with pytest.raises(LaunchError, match="every stage needs at least one block"):
        launch(pipeline_grads, 4, args=("gpipe", 3, 2, 1, True), timeout=60)


class Logits(torch.nn.Module):
    """A stage for torch.distributed.pipelining: the last one returns logits, not a loss."""

    def __init__(self, stage: pp.Stage):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        gpt = self.stage.gpt[0]
        if self.stage.first:
            x = gpt.embed(x)
        for block in self.stage.blocks:
            x = gpt.run_block(block, x)
        return gpt.head(x)[0] if self.stage.last else x


def torch_pipelining_grads(name: str, layers: int, m: int, v: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    p, rank = dist.get_world_size(), dist.get_rank()
    chunks = pp.stage_modules(gpt(layers, tied=False), p, rank, v)
    stages = [
        pipelining.PipelineStage(Logits(chunks[c]), c * p + rank, p * v, torch.device("cpu"))
        for c in range(v)
    ]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))

    kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}.get(name)
    if kind is None:
        schedule = pipelining.ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    else:
        schedule = kind(stages[0], m, loss_fn=loss_fn)
    idx, targets = micro_batches(m)
    first, last = rank == 0, rank == p - 1
    args = (torch.cat(idx),) if first else ()
    kwargs = {"target": torch.cat(targets)} if last else {}
    schedule.step(*args, **kwargs)
    return stage_grads(chunks)


@pytest.mark.parametrize(("name", "p", "m", "v"), [("gpipe", 2, 4, 1), ("1f1b", 3, 4, 1),
                                                   ("interleaved", 2, 4, 2)])  # fmt: skip
def test_the_same_gradients_as_torch_distributed_pipelining(name, p, m, v):
    layers = p * v
    ours = launch(pipeline_grads, p, args=(name, layers, m, v, False), timeout=180)
    theirs = launch(torch_pipelining_grads, p, args=(name, layers, m, v), timeout=180)
    for mine, torch_rank in zip(ours, theirs, strict=True):
        assert mine["grads"].keys() == torch_rank.keys()
        for n in torch_rank:
            torch.testing.assert_close(mine["grads"][n], torch_rank[n], **TOL, msg=n)
