"""Pipeline schedules as data, and the executor: every schedule, several pipeline depths,
gives the gradients of one process running the whole batch."""

from __future__ import annotations

import pytest
import torch

from labsupport import LaunchError, launch
from labsupport.models import GPT, GPTConfig, random_tokens
from labsupport.parallel import pipeline_parallel as pp
from labsupport.parallel import schedules as S
from labsupport.parallel import simulator
from labsupport.parallel.parallel_state import Mesh

MB, T = 2, 8  # sequences per micro-batch, tokens per sequence
# float32: a pipeline sums each parameter's gradient over micro-batches in the same
# order as one process over the whole batch, but the per-micro-batch mean and the /m
# are separate roundings: differences ~1e-7 relative; gradients are O(0.01-1).
TOL = {"rtol": 1e-5, "atol": 1e-6}


def config(layers: int, tied: bool = True, **options) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=T, n_layer=layers, n_head=2, n_embd=16,
                     tie_weights=tied, **options)  # fmt: skip


def gpt(layers: int, tied: bool = True, **options) -> GPT:
    torch.manual_seed(0)
    return GPT(config(layers, tied, **options))


def micro_batches(m: int):
    idx, targets = random_tokens(m * MB, T, 64, seed=5)
    return list(idx.split(MB)), list(targets.split(MB))


def reference_grads(layers: int, m: int, tied: bool, **options) -> dict:
    model = gpt(layers, tied, **options)
    idx, targets = micro_batches(m)
    model(torch.cat(idx), torch.cat(targets))[1].backward()
    return {n: p.grad for n, p in model.named_parameters()}


def stage_grads(chunks: dict, model) -> dict:
    """The gradients this rank's chunks hold, by the GPT's parameter names (the last
    stage's copy of a tied embedding under its own name, ``lm_head.weight``)."""
    names = {id(q): n for n, q in model.named_parameters()}
    return {
        names.get(id(q), n): q.grad.clone()
        for stage in chunks.values()
        for n, q in stage.named_parameters()
        if q.grad is not None
    }


def pipeline_grads(name: str, layers: int, m: int, v: int, tied: bool, **options) -> dict:
    import torch.distributed as dist

    p, rank = dist.get_world_size(), dist.get_rank()
    groups = Mesh(dp=1, tp=1, pp=p).process_groups()
    model = gpt(layers, tied, **options)
    chunks = pp.stage_modules(model, p, rank, v, S.style(name))
    actions = S.build(name, p, m, v)[rank]
    idx, targets = micro_batches(m)
    out = pp.run(chunks, actions, idx, targets, (MB, T, 16), groups["pp"], groups.get("embedding"),
                 style=S.style(name))  # fmt: skip
    return {
        "grads": stage_grads(chunks, model),
        "losses": out["losses"],
        "peak": out["peak_microbatches"],
    }


CASES = [
    ("gpipe", 2, 3, 1), ("gpipe", 3, 1, 1), ("gpipe", 4, 5, 1),
    ("1f1b", 2, 1, 1), ("1f1b", 3, 5, 1), ("1f1b", 4, 2, 1), ("1f1b", 4, 6, 1),
    ("naive", 3, 2, 1), ("interleaved", 2, 4, 2), ("interleaved", 3, 3, 2),
    ("looped-bfs", 3, 2, 2), ("looped-bfs", 2, 3, 3),
]  # fmt: skip


def assert_one_process(results, layers: int, m: int) -> None:
    """The ranks' gradients, put together, are one process's for the whole batch."""
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
    assert sorted(k for r in results for k in r["losses"]) == list(range(m))


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_every_schedule_gives_the_gradients_of_one_process(name, p, m, v):
    layers = p * v
    assert_one_process(launch(pipeline_grads, p, args=(name, layers, m, v, True), timeout=180),
                       layers, m)  # fmt: skip


def zero_bubble_grads(cases: list) -> list:
    return [pipeline_grads(name, 2 * dist_size(), m, 2 if name in S.V_SHAPED else 1, True)
            for name, m in cases]  # fmt: skip


def dist_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


@pytest.mark.parametrize("p", [2, 3])
def test_zero_bubble_schedules_give_the_gradients_of_one_process(p):
    # m < p, m = p, the V's fewest (2p - 1 for ZB-V, 2p for DualPipeV) and an odd m; the
    # V puts the tied embedding and its copy on rank 0 (added there, no message), ZB-H1's
    # first stage has no input gradient (its W is the whole backward)
    cases = [("zb-h1", 1), ("zb-h1", p + 1), ("zbv", p - 1), ("zbv", 2 * p - 1),
             ("dualpipev", 2 * p), ("dualpipev", 2 * p + 1)]  # fmt: skip
    per_rank = launch(zero_bubble_grads, p, args=(cases,), timeout=300)
    for i, (_, m) in enumerate(cases):
        assert_one_process([r[i] for r in per_rank], 2 * p, m)


def test_activations_held_gpipe_all_1f1b_at_most_p():
    gp = launch(pipeline_grads, 4, args=("gpipe", 4, 8, 1, False), timeout=180)
    ofob = launch(pipeline_grads, 4, args=("1f1b", 4, 8, 1, False), timeout=180)
    assert [r["peak"] for r in gp] == [8, 8, 8, 8]
    assert [r["peak"] for r in ofob] == [4, 3, 2, 1]  # p - rank micro-batches in flight


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b", "interleaved", "looped-bfs"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_schedules_never_deadlock_and_have_the_formulas_bubble(name, p, m):
    v = 2 if name in ("interleaved", "looped-bfs") else 1
    try:
        lists = S.build(name, p, m, v)
    except ValueError as exc:
        assert name == "interleaved" and (m % p or p < 2), exc
        return
    timeline = simulator.simulate(lists)
    for rank in timeline:
        done = sorted(a for a, _ in rank)
        want = sorted(S.Action(k, mb, c) for k in ("forward", "backward")
                      for mb in range(m) for c in range(v))  # fmt: skip
        assert done == want
    bubble = simulator.measured_bubble(timeline)
    expected = (p - 1) / p if name == "naive" else S.bubble_fraction(p, m, v)["of_total"]
    if name == "looped-bfs" and m < p:  # too few micro-batches to keep p ranks busy
        assert bubble > expected
    else:
        assert bubble == pytest.approx(expected, abs=1e-12)


FEWEST = {"zb-h1": lambda p: p, "zbv": lambda p: 2 * p - 1, "dualpipev": lambda p: 2 * p}


def assert_dependencies(timeline, p: int, v: int, style: str, durations: dict) -> None:
    """Every micro-batch goes forward through every stage and back, once: a stage's
    forward after the previous stage's, its B (or full backward) after the next stage's
    and after its own forward, its W after its B."""
    done = {}  # (what, micro-batch, stage) -> (start, end)
    for rank, events in enumerate(timeline):
        for a, start in events:
            what = {"forward": "F", "backward": "B", "backward_input": "B"}.get(a.kind, "W")
            key = (what, a.microbatch, S.stage_of(p, rank, a.chunk, style))
            assert key not in done, key
            done[key] = (start, start + durations[a.kind])
            if a.kind == "backward":
                done["W", *key[1:]] = (start + durations[a.kind], start + durations[a.kind])
    m = 1 + max(k for _, k, _ in done)
    assert set(done) == {(w, k, s) for w in "FBW" for k in range(m) for s in range(p * v)}
    for _, k, s in done:
        assert done["F", k, s][0] >= (done["F", k, s - 1][1] if s else 0)
        after = done["B", k, s + 1][1] if s < p * v - 1 else 0
        assert done["B", k, s][0] >= max(after, done["F", k, s][1])
        assert done["W", k, s][0] >= done["B", k, s][1]


@pytest.mark.parametrize("name", S.ZERO_BUBBLE)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_zero_bubble_schedules_run_and_have_the_papers_bubble(name, p):
    from labsupport.parallel import zero_bubble

    v, style = (2, "v") if name in S.V_SHAPED else (1, "loop")
    for m in range(1, 4 * p + 2):
        if name == "dualpipev" and m < 2 * p:
            with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
                S.build(name, p, m, v)
            continue
        timeline = simulator.simulate(S.build(name, p, m, v), style, simulator.SPLIT)
        assert_dependencies(timeline, p, v, style, simulator.SPLIT)
        bubble = simulator.measured_bubble(timeline, simulator.SPLIT)
        want = zero_bubble.bubble_fraction(name, p, m)
        if m >= FEWEST[name](p):
            assert bubble == pytest.approx(want, abs=1e-12), m
        else:  # too few micro-batches to fill the pipeline
            assert bubble >= want - 1e-12, m
        if name == "zbv" and m >= FEWEST[name](p):  # no rank waits inside its own span
            for events in timeline:
                starts = [t for _, t in events]
                ends = [t + simulator.SPLIT[a.kind] for a, t in events]
                assert max(ends) - min(starts) == sum(simulator.SPLIT[a.kind] for a, _ in events)


def test_the_simulator_finds_a_deadlock_and_lists_that_do_not_match():
    A = S.Action
    # rank 0 waits for the gradient of micro-batch 0 before it sends its activation: a cycle
    first = [A("recv_grad", 0, 0), A("backward", 0, 0), A("forward", 0, 0), A("send_act", 0, 0)]
    last = [A("recv_act", 0, 0), A("forward", 0, 0), A("backward", 0, 0), A("send_grad", 0, 0)]
    with pytest.raises(simulator.Deadlock, match="deadlocks: rank 0 waits for .*recv_grad") as info:
        simulator.simulate([first, last])
    # where each rank stopped: its action number, the computation and its time slot
    assert info.value.stuck == [(0, 1, A("backward", 0, 0), 0), (1, 1, A("forward", 0, 0), 0)]
    assert "(its action 1, backward 0, at slot 0)" in str(info.value)
    # the two ranks post their messages in different orders: gloo and NCCL would pair
    # micro-batch 1's activation with micro-batch 0's receive, silently
    first = [A("forward", 0, 0), A("forward", 1, 0), A("send_act", 1, 0), A("send_act", 0, 0)]
    last = [A("recv_act", 0, 0), A("recv_act", 1, 0), A("forward", 0, 0), A("forward", 1, 0)]
    with pytest.raises(RuntimeError, match="do not match"):
        simulator.simulate([first, last])
    first = [A("forward", 0, 0), A("send_act", 0, 0), A("forward", 1, 0), A("send_act", 1, 0)]
    assert len(simulator.simulate([first, last])[1]) == 2  # in the same order: they run
    with pytest.raises(RuntimeError, match="do not match: rank 0 posts 1 more"):
        simulator.simulate([[*first, A("forward", 2, 0), A("send_act", 2, 0)], last])
    mixed = [S.gpipe(2, 2, rank=0), S.one_f_one_b(2, 2, rank=1)]  # lab 11's example
    with pytest.raises(RuntimeError, match="do not match"):
        simulator.simulate(mixed)


def test_a_schedule_that_cannot_run_is_refused_before_any_message():
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        S.build("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="every stage needs at least one block"):
        pp.partition(3, 4)
    with pytest.raises(LaunchError, match="every stage needs at least one block"):
        launch(pipeline_grads, 4, args=("gpipe", 3, 2, 1, True), timeout=60)


TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "looped-bfs": "ScheduleLoopedBFS",
         "zb-h1": "ScheduleInterleavedZeroBubble",  # ZB-H1 with one chunk per rank
         "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}  # fmt: skip
KINDS = {"FORWARD": "forward", "FULL_BACKWARD": "backward",
         "BACKWARD_INPUT": "backward_input", "BACKWARD_WEIGHT": "backward_weight"}  # fmt: skip


def torch_pipelining_grads(name: str, layers: int, m: int, v: int) -> dict:
    """torch's schedule ``name`` on the same stages: the gradients, and this rank's
    computations in torch's order (an overlapped forward and backward as the two)."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    p, rank = dist.get_world_size(), dist.get_rank()
    model = gpt(layers, tied=False)
    style = S.style(name)
    chunks = pp.stage_modules(model, p, rank, v, style)  # a stage is a module torch runs as is
    stages = [
        pipelining.PipelineStage(
            chunks[c], S.stage_of(p, rank, c, style), p * v, torch.device("cpu")
        )
        for c in range(v)
    ]
    kind = getattr(pipelining, TORCH[name])
    multi = name not in ("gpipe", "1f1b")
    schedule = kind(stages if multi else stages[0], m, loss_fn=pp.cross_entropy)
    idx, targets = micro_batches(m)
    first, last = (any(getattr(s, end) for s in chunks.values()) for end in ("first", "last"))
    args = (torch.cat(idx),) if first else ()
    kwargs = {"target": torch.cat(targets)} if last else {}
    schedule.step(*args, **kwargs)
    order = []
    for a in getattr(schedule, "pipeline_order", {}).get(rank, []):
        for b in (a.sub_actions or (a,)) if a is not None else ():
            if b.computation_type.name not in KINDS:  # torch's gradient reduction
                continue
            chunk = next(c for c in range(v) if S.stage_of(p, rank, c, style) == b.stage_index)
            order.append(S.Action(KINDS[b.computation_type.name], b.microbatch_index, chunk))
    return {"grads": stage_grads(chunks, model), "order": order}


@pytest.mark.parametrize(("name", "p", "m", "v"), [
    ("gpipe", 2, 4, 1), ("1f1b", 3, 4, 1), ("interleaved", 2, 4, 2), ("looped-bfs", 2, 3, 2),
    ("zb-h1", 3, 5, 1), ("zbv", 2, 5, 2), ("dualpipev", 3, 7, 2)])  # fmt: skip
def test_the_same_gradients_as_torch_distributed_pipelining(name, p, m, v):
    layers = p * v
    ours = launch(pipeline_grads, p, args=(name, layers, m, v, False), timeout=180)
    theirs = launch(torch_pipelining_grads, p, args=(name, layers, m, v), timeout=180)
    for rank, (mine, torch_rank) in enumerate(zip(ours, theirs, strict=True)):
        assert mine["grads"].keys() == torch_rank["grads"].keys()
        for n in torch_rank["grads"]:
            torch.testing.assert_close(mine["grads"][n], torch_rank["grads"][n], **TOL, msg=n)
        if name in (*S.ZERO_BUBBLE, "looped-bfs"):  # the same computations, in torch's order
            computes = [a for a in S.build(name, p, m, v)[rank] if a.kind not in S.COMM]
            assert computes == torch_rank["order"], rank


# --------------------------------------------------------------------------- stages


def test_a_stage_owns_exactly_its_modules_and_the_model_is_left_as_it_was():
    model = gpt(4, tied=True)
    before = {n: (q, q.detach().clone()) for n, q in model.named_parameters()}
    stages = [pp.stage_modules(model, 4, rank)[0] for rank in range(4)]
    assert model.lm_head.weight is model.wte.weight and not hasattr(model, "tied")
    for n, q in model.named_parameters():
        assert q is before[n][0] and torch.equal(q, before[n][1]), n
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    assert all(n.startswith("h.1.") for n in names[1]) and names[1][0] == "h.1.ln_1.weight"
    assert names[0][:2] == ["embedding.wte.weight", "embedding.wpe.weight"]
    assert names[3][-3:] == ["ln_f.weight", "ln_f.bias", "lm_head.weight"]
    for middle in stages[1:3]:
        assert all(isinstance(getattr(middle, piece), torch.nn.Identity)
                   for piece in ("embedding", "ln_f", "lm_head"))  # fmt: skip
    # every parameter of the model on exactly one stage; the last stage's copy apart
    owned = [id(q) for s in stages for q in s.parameters()]
    copy = stages[3].lm_head.weight
    assert copy is not model.wte.weight and torch.equal(copy, model.wte.weight)
    assert sorted(owned) == sorted([id(q) for q in model.parameters()] + [id(copy)])
    assert [s.tied for s in stages] == [True, False, False, True]


def test_a_stage_keeps_no_other_stage_alive():
    import gc
    import weakref

    model = gpt(4, tied=False)
    first_block, whole = weakref.ref(model.h[0]), weakref.ref(model)
    last = pp.stage_modules(model, 4, 3)[0]
    del model
    gc.collect()
    assert first_block() is None and whole() is None
    assert last(torch.zeros(MB, T, 16)).shape == (MB, T, 64)  # logits


def test_one_stage_holds_the_whole_model_with_its_tie():
    model = gpt(2, tied=True)
    (stage,) = pp.stage_modules(model, 1, 0).values()
    assert stage.lm_head.weight is stage.embedding.wte.weight and not stage.tied
    idx, targets = micro_batches(1)
    want = model(idx[0], targets[0])[1]
    assert torch.equal(pp.cross_entropy(stage(idx[0]), targets[0]), want)


def test_a_tied_embedding_without_its_group_is_a_clear_error():
    def run_without_group():
        import torch.distributed as dist

        rank = dist.get_rank()
        chunks = pp.stage_modules(gpt(2, tied=True), 2, rank)
        idx, targets = micro_batches(2)
        pp.run(chunks, S.build("1f1b", 2, 2)[rank], idx, targets, (MB, T, 16))

    with pytest.raises(LaunchError, match="pass embedding_group="):
        launch(run_without_group, 2, timeout=60)


def test_full_recomputation_runs_in_the_stages_and_gives_the_same_gradients():
    from labsupport.measure.memory import saved_tensors

    saved = {}
    for policy in ("none", "full"):
        stage = pp.stage_modules(gpt(4, recompute=policy), 2, 1)[0]
        x = torch.randn(MB, T, 16, requires_grad=True)
        with saved_tensors(exclude=stage) as counted:
            logits = stage(x)
        saved[policy] = counted.nbytes
        del logits
    # recomputing, a block keeps its input only; the last stage's head keeps its own
    assert saved["full"] < saved["none"] / 3
    results = launch(pipeline_grads, 2, args=("1f1b", 4, 3, 1, True), kwargs={"recompute": "full"},
                     timeout=180)  # fmt: skip
    want = reference_grads(4, 3, True)
    for r in results:
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, want["wte.weight" if n == "lm_head.weight" else n],
                                       **TOL, msg=n)  # fmt: skip


def test_stages_of_unequal_cost_run_at_the_slowest_ones_pace():
    """Durations per rank: 1F1B's step is (m + p - 1) ticks of the slowest stage when all
    stages but one are fast, and the bubble formula holds when all are equal."""
    p, m = 4, 8
    lists = S.build("1f1b", p, m)

    def cost(slow):
        return lambda rank, a: (3 if rank == slow else 1) * (1 if a.kind == "forward" else 2)

    even = simulator.simulate(lists, durations=lambda rank, a: 1 if a.kind == "forward" else 2)
    assert simulator.span(even, lambda rank, a: 1 if a.kind == "forward" else 2) == 3 * (m + p - 1)
    for slow in range(p):
        timeline = simulator.simulate(lists, durations=cost(slow))
        assert simulator.span(timeline, cost(slow)) >= 9 * m  # the slow rank's own work
        assert simulator.span(timeline, cost(slow)) < 3 * 3 * (m + p - 1)
