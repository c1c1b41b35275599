"""Context parallelism against one process: ring, all-gather and Ulysses attention equal
``scaled_dot_product_attention`` on the whole sequence, output and the gradients of Q, K
and V, on 2, 3 and 4 ranks, causal and not, zig-zag and contiguous, grouped-query too; the
bytes each rank sends and the score blocks it computes against the formulas; activations
per rank 1/cp of one process's; the course GPT trained cp 2 x dp 2 equal to one process;
sizes that do not divide named in the error. One launch per world size: the cases run
inside it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport import launch
from labsupport.comm import p2p, traced
from labsupport.estimate import context_parallel as est
from labsupport.measure.memory import SavedBytes
from labsupport.models import GPT, GPTConfig, random_tokens
from labsupport.parallel import blockwise_attention as blockwise
from labsupport.parallel import context_parallel as cp
from labsupport.parallel import context_parallel_model as cpm
from labsupport.parallel import context_parallel_variants as cpv
from labsupport.parallel.hybrid import train_single

B, HEADS, D = 2, 12, 4  # 12 heads divide over 2, 3 and 4 ranks (Ulysses needs it)
GPT_CONFIG = {"vocab_size": 64, "block_size": 24, "n_layer": 2, "n_head": 4, "n_embd": 32}


def qkv(seq_len: int, heads: int = HEADS, kv_heads: int = HEADS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, seq_len, D, generator=g) for n in (heads, kv_heads, kv_heads, heads)]


def one_case(variant: str, causal: bool, layout: str, kv_heads: int = HEADS, seq_len: int = 24):
    """This rank's output and gradients against SDPA's, and what it sent and computed."""
    q, k, v, dout = qkv(seq_len, kv_heads=kv_heads)
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    gqa = kv_heads != HEADS
    want = F.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=gqa)
    want.backward(dout)
    mine = [cp.shard_sequence(t, 2, layout=layout).requires_grad_(True) for t in (q, k, v)]
    counted = {}
    with p2p.count_traffic() as sent, traced.trace_collectives() as calls:
        with blockwise.count_work() as work:
            out = cpm.context_parallel_attention(
                *mine, causal=causal, layout=layout, variant=variant
            )
        counted["forward"] = sent.bytes_sent + cpv.bytes_per_rank(calls)
        out.backward(cp.shard_sequence(dout, 2, layout=layout))
    counted["total"] = sent.bytes_sent + cpv.bytes_per_rank(calls)
    counted["messages"] = len(sent.messages) or len(calls.calls)
    pairs = [(out, want)] + [(a.grad, b.grad) for a, b in zip(mine, whole, strict=True)]
    gathered = cp.gather_sequence(out.detach(), 2, layout=layout)  # the whole, in order
    return {
        "gathered": (gathered, want.detach()),
        "case": (variant, causal, layout, kv_heads),
        "pairs": [(got, cp.shard_sequence(w.detach(), 2, layout=layout)) for got, w in pairs],
        "bytes": counted,
        "work": work.scores("forward") / (seq_len // (2 * dist.get_world_size())) ** 2,
    }


def all_cases() -> list:
    cases = []
    for variant in cpm.VARIANTS:
        for causal in (True, False):
            for layout in ("zigzag", "contiguous"):
                cases.append(one_case(variant, causal, layout))
        cases.append(one_case(variant, True, "zigzag", kv_heads=dist.get_world_size()))
    return cases


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_variant_equals_sdpa_and_sends_the_formulas_bytes(world):
    ranks = launch(all_cases, world, timeout=600)
    for case in range(len(ranks[0])):
        variant, causal, layout, kv_heads = ranks[0][case]["case"]
        for rank in ranks:
            for name, (got, want) in zip(
                ["out", "dq", "dk", "dv"], rank[case]["pairs"], strict=True
            ):
                torch.testing.assert_close(got, want, msg=f"{rank[case]['case']} {name}")
            torch.testing.assert_close(*rank[case]["gathered"])
            formula = est.bytes_per_rank(variant, B, 24, HEADS, kv_heads, D, world)
            assert rank[case]["bytes"]["forward"] == formula["forward"]
            assert rank[case]["bytes"]["total"] == formula["total"]
            assert rank[case]["bytes"]["messages"] == formula["messages"]
        if variant != "ulysses":  # the blockwise kernels count their score blocks
            work = [rank[case]["work"] for rank in ranks]
            assert work == est.score_blocks(world, layout, causal)
            balanced = layout == "zigzag" or not causal
            assert est.imbalance(work) == (1.0 if balanced else 2 * world / (world + 1))


def sizes_that_do_not_divide() -> list[str]:
    errors = []
    q, k, v, _ = qkv(25, heads=4, kv_heads=4)
    for call in (
        lambda: cp.shard_sequence(q, 2),
        lambda: cpv.ulysses_attention(*(t[..., :24, :] for t in (q, k, v))),
        lambda: cp.ring_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :]),
        lambda: cp.ring_attention(q[:, :3, :6], k[..., :6, :], v[..., :6, :]),
        lambda: cpm.ContextParallelGPT(GPT(GPTConfig(**GPT_CONFIG, dropout=0.1))),
        lambda: cpm.context_parallel_attention(q, k, v, variant="tree"),
    ):
        try:
            call()
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_sizes_that_do_not_divide_are_named_in_the_error():
    errors = launch(sizes_that_do_not_divide, 3, timeout=120)[0]
    assert "a sequence of 25 tokens does not split into 6 equal chunks" in errors[0]
    assert "4 query heads and 4 K/V heads over 3 ranks" in errors[1]
    assert "holds 7 tokens, which do not split into its 2 chunks" in errors[2]
    assert "3 query heads do not share 4 K/V heads" in errors[3]
    assert "dropout=0.0" in errors[4]
    assert "variant must be one of ring, all_gather, ulysses" in errors[5]


def saved_bytes(model, idx, targets) -> tuple[int, int]:
    """Bytes autograd saves in a forward pass: the whole model's, and its blocks'."""
    whole, blocks = SavedBytes(exclude=model), SavedBytes(exclude=model)
    with whole.saving():
        model(idx, targets)
    gpt = getattr(model, "gpt", model)
    handles = blocks.watch(gpt.h)
    model(idx, targets)
    for handle in handles:
        handle.remove()
    return whole.nbytes, blocks.nbytes


def activations_and_training() -> dict:
    """Saved bytes of the GPT's forward on this rank's tokens (cp over the world), and
    the GPT trained cp 2 x dp 2 with each variant."""
    torch.manual_seed(0)
    model = cpm.ContextParallelGPT(GPT(GPTConfig(**GPT_CONFIG)))
    idx, targets = (cp.shard_sequence(t, 1) for t in random_tokens(B, 24, 64, seed=5))
    saved = saved_bytes(model, idx, targets)
    runs = {v: cpm.train(GPT_CONFIG, 2, 2, 3, 4, 1e-2, variant=v)["losses"] for v in cpm.VARIANTS}
    return {"saved": saved, "losses": runs}


def test_activations_are_one_cp_th_and_training_equals_one_process():
    ranks = launch(activations_and_training, 4, timeout=600)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**GPT_CONFIG))
    whole, blocks = saved_bytes(gpt, *random_tokens(B, 24, 64, seed=5))
    assert [r["saved"][1] * 4 for r in ranks] == [blocks] * 4  # the blocks: exactly 1/cp
    # the whole model too, but for the one 4-byte scalar the loss keeps on every rank
    assert [r["saved"][0] * 4 for r in ranks] == [whole + 3 * 4] * 4
    want = train_single(GPT_CONFIG, 3, 4, lr=1e-2)
    for r in ranks:
        for variant, losses in r["losses"].items():
            assert losses == pytest.approx(want, rel=1e-5), variant


# --------------------------------------------------------------------------- one process


def test_merging_blocks_gives_the_softmax_over_all_keys():
    q, k, v, dout = qkv(16, heads=2, kv_heads=1)
    scale = D**-0.5
    halves = [
        blockwise.attention_block(q, k[..., s, :], v[..., s, :], scale)
        for s in (slice(0, 6), slice(6, 16))
    ]
    out, lse = blockwise.merge_attention(halves[0][0], halves[0][1], halves[1][0], halves[1][1])
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) * scale
    torch.testing.assert_close(lse, scores.logsumexp(-1))


@pytest.mark.parametrize("diagonal", [False, True])
def test_a_blocks_backward_is_autograds(diagonal):
    q, k, v, dout = (t.double() for t in qkv(8, heads=4, kv_heads=2))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=diagonal, enable_gqa=True)
    out.backward(dout)
    _, lse = blockwise.attention_block(q, k, v, D**-0.5, diagonal)
    delta = (dout * out.detach()).sum(-1)
    got = blockwise.attention_block_backward(dout, q, k, v, delta, lse, D**-0.5, diagonal)
    for g, leaf in zip(got, leaves, strict=True):
        torch.testing.assert_close(g, leaf.grad)


def test_layouts():
    assert cp.Layout.zigzag(4).chunks == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert cp.Layout.zigzag(2).positions(1, 8).tolist() == [2, 3, 4, 5]
    assert cp.Layout.contiguous(3).positions(2, 9).tolist() == [6, 7, 8]
    with pytest.raises(ValueError, match="each chunk to one rank"):
        cp.Layout(((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="as many chunks"):
        cp.Layout(((0,), (1, 2)))
    with pytest.raises(ValueError, match="layout is for 2 ranks, the group has 4"):
        cp.make_layout(cp.Layout.zigzag(2), 4)
    with pytest.raises(ValueError, match="layout must be"):
        cp.make_layout("striped", 2)


def test_formulas():
    # the ring and the all-gather send the same bytes; Ulysses less as cp grows (MHA)
    ring = est.bytes_per_rank("ring", 1, 1024, 8, 8, 64, 8)
    gather = est.bytes_per_rank("all_gather", 1, 1024, 8, 8, 64, 8)
    ulysses = est.bytes_per_rank("ulysses", 1, 1024, 8, 8, 64, 8)
    assert ring["total"] == gather["total"] == 3 * 7 * 2 * 128 * 8 * 64 * 4
    assert ring["messages"] == 21 and gather["messages"] == 3 and ulysses["messages"] == 8
    assert ring["total"] / ulysses["total"] == pytest.approx(0.75 * 8)
    assert est.bytes_per_rank("ring", 1, 64, 4, 4, 8, 1) == {
        "forward": 0,
        "backward": 0,
        "total": 0,
        "messages": 0,
    }
    assert est.score_blocks(4, "contiguous") == [4, 8, 12, 16]
    assert est.score_blocks(4, "zigzag") == [9] * 4
    assert est.imbalance(est.score_blocks(4, "contiguous")) == 1.6
    # every layout computes the needed half of the s x s scores, plus its diagonal blocks
    for cp_size in (2, 3, 4):
        units = (2 * cp_size) ** 2
        assert sum(est.score_blocks(cp_size, "zigzag")) >= units / 2
    # Liu et al.'s block: F/B, H100 dense bf16 over NVLink 4's 450 GB/s
    assert math.isclose(est.min_block_tokens(989e12, 450e9), 2197.8, rel_tol=1e-4)
    # with cp the activations per GPU shrink by exactly cp (selective recomputation)
    one = est.activation_per_gpu(131072, 1, 16384, 128, 1, tp=8)
    assert est.activation_per_gpu(131072, 1, 16384, 128, 1, tp=8, cp=16) * 16 == pytest.approx(one)
    assert one == pytest.approx(34 * 131072 * 16384 / 8)


def test_the_gpt_keeps_its_behaviour_without_a_strategy():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**GPT_CONFIG))
    idx = random_tokens(B, 24, 64)[0]
    x = gpt.embed(idx)
    torch.testing.assert_close(gpt.embed(idx, pos=torch.arange(24)), x, rtol=0, atol=0)
    assert all(block.attn.attention_fn is None for block in gpt.h)
