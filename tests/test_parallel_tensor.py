"""Tensor parallelism against the dense model: every output and every gradient, on 2 and
4 ranks, with and without sequence parallelism; the collectives counted; the same as
DTensor's ColwiseParallel / RowwiseParallel; a whole output or input; the dropout generators."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import labsupport
from labsupport import LaunchError, launch
from labsupport.comm import traced
from labsupport.models import GPT, GPTConfig, random_tokens
from labsupport.parallel import tensor_parallel_model as tpm
from labsupport.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

# float32; the split sums (over t partial products of n_embd/t terms, then all-reduced)
# reorder additions of ~100 terms: relative differences ~1e-6 at most.
TOL = {"rtol": 1e-5, "atol": 1e-6}
B, T = 2, 8


def config(vocab: int = 64, heads: int = 4) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, block_size=T, n_layer=2, n_head=heads, n_embd=32)


def dense_gpt(vocab: int = 64, heads: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(config(vocab, heads))


def block_case(sequence_parallel: bool) -> dict:
    t, rank = dist.get_world_size(), dist.get_rank()
    gpt = dense_gpt()
    dense = gpt.h[0]
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1))
    x_dense = x.clone().requires_grad_(True)
    y_dense = dense(x_dense)
    y_dense.square().sum().backward()
    block = tpm.ParallelBlock(dense, gpt.config, sequence_parallel=sequence_parallel)
    x_local = (x.chunk(t, dim=1)[rank] if sequence_parallel else x).clone().requires_grad_(True)
    with traced.trace_collectives() as forward:
        y = block(x_local)
    with traced.trace_collectives() as backward:
        y.square().sum().backward()
    if sequence_parallel:
        tpm.all_reduce_sequence_parallel_grads(block)
    a, d = block, dense
    pairs = {
        "c_attn.weight": (a.c_attn.weight.grad, tpm._rows(d.attn.c_attn.weight.grad, t, rank, 3)),
        "c_attn.bias": (a.c_attn.bias.grad, tpm._rows(d.attn.c_attn.bias.grad, t, rank, 3)),
        "attn_proj.weight": (a.attn_proj.weight.grad, d.attn.c_proj.weight.grad.chunk(t, 1)[rank]),
        "attn_proj.bias": (a.attn_proj.bias.grad, d.attn.c_proj.bias.grad),
        "c_fc.weight": (a.c_fc.weight.grad, d.mlp.c_fc.weight.grad.chunk(t)[rank]),
        "mlp_proj.weight": (a.mlp_proj.weight.grad, d.mlp.c_proj.weight.grad.chunk(t, 1)[rank]),
        "ln_1.weight": (a.ln_1.weight.grad, d.ln_1.weight.grad),
        "ln_2.bias": (a.ln_2.bias.grad, d.ln_2.bias.grad),
        "mlp_proj.bias": (a.mlp_proj.bias.grad, d.mlp.c_proj.bias.grad),
    }
    want_x = x_dense.grad.chunk(t, dim=1)[rank] if sequence_parallel else x_dense.grad
    out = y.detach()
    want_y = y_dense.detach().chunk(t, dim=1)[rank] if sequence_parallel else y_dense.detach()
    return {
        "pairs": pairs,
        "input_grad": (x_local.grad, want_x),
        "output": (out, want_y),
        "forward": [name for name, _, _ in forward.calls],
        "backward": [name for name, _, _ in backward.calls],
        "bytes": traced.bytes_per_rank(forward) + traced.bytes_per_rank(backward),
    }


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_parallel_block_equals_the_dense_block(t, sequence_parallel):
    for r in launch(block_case, t, args=(sequence_parallel,), timeout=120):
        for name, (got, want) in r["pairs"].items():
            torch.testing.assert_close(got, want, **TOL, msg=name)
        torch.testing.assert_close(*r["input_grad"], **TOL)
        torch.testing.assert_close(*r["output"], **TOL)
        activation = B * T * 32 * 4  # bytes of one full (b, s, h) float32 activation
        if sequence_parallel:  # all-gather before each column layer, reduce-scatter after
            assert r["forward"] == ["all_gather", "reduce_scatter"] * 2
            assert sorted(r["backward"]) == sorted(["reduce_scatter", "all_gather"] * 2)
            assert r["bytes"] == pytest.approx(8 * (t - 1) / t * activation)
        else:  # g after attention and after the MLP; f's all-reduce before each, backward
            assert r["forward"] == ["all_reduce", "all_reduce"]
            assert r["backward"] == ["all_reduce", "all_reduce"]
            assert r["bytes"] == pytest.approx(4 * 2 * (t - 1) / t * activation)


def gpt_case(vocab: int) -> dict:
    gpt = dense_gpt(vocab)
    idx, targets = random_tokens(B, T, vocab, seed=3)
    loss_dense = gpt(idx, targets)[1]
    loss_dense.backward()
    model = tpm.ParallelGPT(gpt)
    loss = model(idx, targets)[1]
    loss.backward()
    t, rank = dist.get_world_size(), dist.get_rank()
    padded = torch.zeros(model.wte.padded, 32)
    padded[:vocab] = gpt.wte.weight.grad
    return {
        "loss": (loss.detach(), loss_dense.detach()),
        "wte": (model.wte.weight.grad, padded.chunk(t)[rank]),
        "wpe": (model.wpe.weight.grad, gpt.wpe.weight.grad),
        "ln_f": (model.ln_f.weight.grad, gpt.ln_f.weight.grad),
        "fc": (model.h[1].c_fc.weight.grad, gpt.h[1].mlp.c_fc.weight.grad.chunk(t)[rank]),
    }


@pytest.mark.parametrize(("t", "vocab"), [(2, 64), (2, 65), (4, 66)])
def test_the_parallel_gpt_gives_the_dense_loss_and_gradients(t, vocab):
    """65 and 66 do not divide by t: the vocabulary is padded, the padding never wins."""
    for r in launch(gpt_case, t, args=(vocab,), timeout=120):
        for name, (got, want) in r.items():
            torch.testing.assert_close(got, want, **TOL, msg=name)


def heads_do_not_divide():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=1, n_head=3, n_embd=30))
    tpm.ParallelBlock(gpt.h[0], gpt.config)


def test_sizes_that_do_not_divide_are_named_in_the_error():
    with pytest.raises(LaunchError, match="n_head = 3 does not divide over 2"):
        launch(heads_do_not_divide, 2, timeout=60)


def dtensor_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    t, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    ours = torch.nn.Sequential(ColumnParallelLinear(16, 64), torch.nn.GELU(),
                               RowParallelLinear(64, 16))  # fmt: skip
    with torch.no_grad():
        ours[0].weight.copy_(mlp[0].weight.chunk(t)[rank])
        ours[0].bias.copy_(mlp[0].bias.chunk(t)[rank])
        ours[2].weight.copy_(mlp[2].weight.chunk(t, dim=1)[rank])
        ours[2].bias.copy_(mlp[2].bias)
    mesh = init_device_mesh("cpu", (t,))
    theirs = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    return {
        "fc1": (ours[0].weight.grad, theirs[0].weight.grad.to_local()),
        "fc2": (ours[2].weight.grad, theirs[2].weight.grad.to_local()),
        "bias": (ours[2].bias.grad, theirs[2].bias.grad.full_tensor()),
    }


@pytest.mark.parametrize("t", [2, 4])
def test_column_then_row_equals_dtensor_colwise_then_rowwise(t):
    for r in launch(dtensor_case, t, timeout=120):
        for name, (got, want) in r.items():
            torch.testing.assert_close(got, want, **TOL, msg=name)


def dropout_masks(sequence_parallel: bool) -> dict:
    """This rank's draws inside ``rank_rng`` and from the shared generator after it."""
    torch.manual_seed(0)
    block = tpm.ParallelBlock(dense_gpt().h[0], config(), sequence_parallel=sequence_parallel)
    x = torch.ones(B, T, 32, device=labsupport.device())
    with block.rank_rng(x):
        own = torch.rand(8, device=x.device).cpu()
    with block._residual_rng(x):
        residual = torch.rand(8, device=x.device).cpu()
    return {"own": own, "residual": residual, "shared": torch.rand(8).cpu()}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_sharded_dropout_draws_per_rank_and_leaves_the_shared_generator_alone(sequence_parallel):
    a, b = launch(dropout_masks, 2, args=(sequence_parallel,), timeout=60)
    assert not torch.equal(a["own"], b["own"])  # per-rank seeds: different masks
    assert torch.equal(a["shared"], b["shared"])  # the shared generator stays in step
    # residual dropouts: per rank under sequence parallelism, shared (equal) without it
    assert torch.equal(a["residual"], b["residual"]) is not sequence_parallel


def split_io_case(option: str) -> dict:
    """``gather_output=True`` or ``input_is_parallel=False`` against the dense layer, with
    the whole input and output on every rank: forward, backward and the collectives."""
    t, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    dense = torch.nn.Linear(8, 12)
    if option == "gather_output":
        layer = ColumnParallelLinear(8, 12, gather_output=True)
        weight, bias = dense.weight.chunk(t)[rank], dense.bias.chunk(t)[rank]
    else:
        layer = RowParallelLinear(8, 12, input_is_parallel=False)
        weight, bias = dense.weight.chunk(t, dim=1)[rank], dense.bias
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    x_dense, x_local = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_dense = dense(x_dense)
    y_dense.square().sum().backward()
    with traced.trace_collectives() as forward:
        y = layer(x_local)
    with traced.trace_collectives() as backward:
        y.square().sum().backward()
    grads = dense.weight.grad, dense.bias.grad
    if option == "gather_output":
        want_weight, want_bias = grads[0].chunk(t)[rank], grads[1].chunk(t)[rank]
    else:
        want_weight, want_bias = grads[0].chunk(t, dim=1)[rank], grads[1]
    return {
        "pairs": {
            "output": (y.detach(), y_dense.detach()),
            "input grad": (x_local.grad, x_dense.grad),
            "weight grad": (layer.weight.grad, want_weight),
            "bias grad": (layer.bias.grad, want_bias),
        },
        "forward": [name for name, _, _ in forward.calls],
        "backward": [name for name, _, _ in backward.calls],
    }


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize(
    ("option", "forward", "backward"),
    [
        ("gather_output", ["all_gather"], ["all_reduce"]),  # f's all-reduce, backward
        ("input_is_parallel", ["all_reduce"], ["all_gather"]),
    ],
)
def test_a_whole_output_or_input_gives_the_dense_layer_forward_and_backward(
    t, option, forward, backward
):
    """Megatron's gather_from_ / scatter_to_tensor_model_parallel_region: the gathered
    output's gradient is sliced back, the split input's gradient all-gathered."""
    for r in launch(split_io_case, t, args=(option,), timeout=60):
        for name, (got, want) in r["pairs"].items():
            torch.testing.assert_close(got, want, **TOL, msg=name)
        assert (r["forward"], r["backward"]) == (forward, backward)


def dropout_streams() -> dict:
    """This rank's draws in the sharded regions of a two-block ParallelGPT (one per block,
    twice), the shared generator's draw after them, and rank 0's 1001st sharded draw."""
    torch.manual_seed(0)
    model = tpm.ParallelGPT(GPT(GPTConfig(**{**vars(config()), "dropout": 0.5}))).train()
    x = torch.ones(B, T, 32, device=labsupport.device())
    draws = []
    for _ in range(2):
        for block in model.h:
            with block.rank_rng(x):
                draws.append(torch.rand(8, device=x.device).cpu())
    shared = torch.rand(8, device=x.device).cpu()
    for _ in range(1000 - len(draws)):
        with model.h[0].rank_rng(x):
            torch.rand(8, device=x.device)
    with model.h[0].rank_rng(x):
        late = torch.rand(8, device=x.device).cpu()
    return {"draws": draws, "shared": shared, "late": late}


def test_sharded_dropout_draws_new_masks_in_every_layer_and_on_every_rank():
    a, b = launch(dropout_streams, 2, timeout=60)
    for r in (a, b):  # one stream per rank, shared by the blocks: no two draws alike
        assert len({tuple(d.tolist()) for d in r["draws"]}) == len(r["draws"])
    assert all(not torch.equal(x, y) for x, y in zip(a["draws"], b["draws"], strict=True))
    assert torch.equal(a["shared"], b["shared"])  # replicated regions: the same mask
    assert not torch.equal(a["late"], b["draws"][0])  # rank 0 never runs into rank 1's stream


def cpu_fork_leaves_cuda_alone() -> bool:
    def refuse(*args, **kwargs):
        raise AssertionError("the CPU fork touched CUDA")

    block = tpm.ParallelBlock(dense_gpt().h[0], config())
    names = ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "init")
    saved = {name: getattr(torch.cuda, name) for name in names}
    try:
        for name in names:
            setattr(torch.cuda, name, refuse)
        with block.rank_rng(torch.ones(2)):
            torch.rand(4)
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
    return not torch.cuda.is_initialized()


def test_the_rank_fork_on_the_cpu_never_touches_cuda():
    assert launch(cpu_fork_leaves_cuda_alone, 2, timeout=60) == [True, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_rank_fork_on_cuda_swaps_the_gpu_generator_and_gives_it_back():
    device = torch.device("cuda", torch.cuda.current_device())
    tracker, again = tpm.RankRNGTracker(7), tpm.RankRNGTracker(7)
    torch.cuda.manual_seed(0)
    before, cpu_before = torch.cuda.get_rng_state(device), torch.get_rng_state()
    with tracker.fork(device):
        first = torch.rand(8, device=device)
    with tracker.fork(device):
        second = torch.rand(8, device=device)
    assert torch.equal(torch.cuda.get_rng_state(device), before)  # the GPU's state given back
    assert torch.equal(torch.get_rng_state(), cpu_before)
    assert not torch.equal(first, second)  # the tracker's own state moved on
    with again.fork(device):
        assert torch.equal(torch.rand(8, device=device), first)  # from its seed alone


# --------------------------------------------------------------------------- GQA

GQA_CASES = [(8, 2), (8, 4), (4, 1)]  # (query heads, key-value heads), width 32


def gqa_dense(heads: int, kv_heads: int):
    from labsupport.parallel.tensor_parallel_gqa import GroupedQueryAttention

    torch.manual_seed(0)
    return GroupedQueryAttention(32, heads, kv_heads)


def gqa_case() -> list:
    """Every case on this rank: output, input gradient and weight gradients of the
    parallel attention, and the bytes of K and V it computed."""
    from labsupport.parallel import tensor_parallel_gqa as gqa

    out = []
    for heads, kv_heads in GQA_CASES:
        layer = gqa.ParallelGroupedQueryAttention(gqa_dense(heads, kv_heads))
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = layer(x)
        y.pow(2).sum().backward()
        gqa.all_reduce_replicated_kv_grads(layer)
        grads = {n: w.weight.grad for n, w in (("q", layer.wq), ("k", layer.wk),
                                                ("v", layer.wv), ("o", layer.wo))}  # fmt: skip
        out.append({"y": y.detach(), "dx": x.grad, "grads": grads, "replicas": layer.replicas,
                    "kv_bytes": layer.kv_bytes(2, 6, 4)})  # fmt: skip
    return out


@pytest.mark.parametrize("t", [2, 4])
def test_grouped_query_attention_split_by_heads_equals_the_dense_one(t):
    """Query heads split over t ranks; key-value heads split while t <= n_kv_heads, else
    replicated on t / n_kv_heads ranks, their gradients summed over the replicas."""
    ranks = launch(gqa_case, t, timeout=180)
    for i, (heads, kv_heads) in enumerate(GQA_CASES):
        dense = gqa_dense(heads, kv_heads)
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = dense(x)
        # the dense layer is torch's grouped-query attention
        q, k, v = (
            w(x).view(2, 6, -1, 32 // heads).transpose(1, 2) for w in (dense.wq, dense.wk, dense.wv)
        )
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)  # fmt: skip
        torch.testing.assert_close(dense.wo(sdpa.transpose(1, 2).reshape(2, 6, 32)), y)
        y.pow(2).sum().backward()
        head_rows, kv_rows = 32 // t, 32 // heads * max(1, kv_heads // t)
        replicas = max(1, t // kv_heads)
        for r, got in enumerate(rank[i] for rank in ranks):
            torch.testing.assert_close(got["y"], y.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["dx"], x.grad, rtol=1e-5, atol=1e-6)
            kv = (r // replicas if replicas > 1 else r) * kv_rows
            want = {"q": dense.wq.weight.grad[r * head_rows : (r + 1) * head_rows],
                    "k": dense.wk.weight.grad[kv : kv + kv_rows],
                    "v": dense.wv.weight.grad[kv : kv + kv_rows],
                    "o": dense.wo.weight.grad[:, r * head_rows : (r + 1) * head_rows]}  # fmt: skip
            for n in want:
                torch.testing.assert_close(got["grads"][n], want[n], rtol=1e-5, atol=1e-6, msg=n)
            assert got["replicas"] == replicas
            assert got["kv_bytes"] == 2 * 2 * 6 * kv_rows * 4  # K and V: kv_rows per token


# --------------------------------------------------------------------------- overlap


def overlap_case() -> dict:
    """The all-gather of the sequence then a column-parallel product, decomposed and
    overlapped, against the plain one: output, gradients, and the bytes each sends."""
    from labsupport.comm.p2p import count_traffic
    from labsupport.parallel.tensor_parallel import gather_from_sequence_parallel_region
    from labsupport.parallel.tensor_parallel_overlap import all_gather_matmul

    torch.manual_seed(dist.get_rank())
    x = torch.randn(2, 3, 16, requires_grad=True)
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(7), requires_grad=True)
    with count_traffic() as sent:
        y = all_gather_matmul(x, w)
    y.pow(2).sum().backward()
    got = (y.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with traced.trace_collectives() as trace:
        want = torch.nn.functional.linear(gather_from_sequence_parallel_region(x), w)
    want.pow(2).sum().backward()
    return {"got": got, "want": (want.detach(), x.grad, w.grad), "sent": sent.bytes_sent,
            "all-gather": traced.bytes_per_rank(trace)}  # fmt: skip


@pytest.mark.parametrize("t", [2, 3])
def test_the_overlapped_all_gather_matmul_equals_gather_then_linear(t):
    for r in launch(overlap_case, t, timeout=120):
        for got, want in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert r["sent"] == r["all-gather"] == (t - 1) * 2 * 3 * 16 * 4  # the same bytes
