"""Lab 12, tensor parallelism: the lab's comparisons on real ranks, the activation bytes a
block keeps against Korthikanti et al.'s formula, and the exercises' checkers. (The layers
themselves are tested in tests/test_parallel_tensor.py, the modelled costs per layer in
tests/test_estimate.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from notebook_solutions import solution, stub
from test_lab07_collectives import checks

from labsupport import launch
from labsupport.estimate.memory import activation_memory
from labsupport.labs import lab12_exercises as exercises
from labsupport.labs import lab12_memory as memory
from labsupport.labs import lab12_mlp_runs as runs
from labsupport.labs import lab12_tensor_parallel as lab
from labsupport.parallel import tensor_parallel as tp

LAB = "12-tensor-parallel.ipynb"


@pytest.mark.parametrize("t", [2, 4])
def test_a_linear_layer_split_both_ways_equals_the_dense_one(t):
    results = launch(lab.split_linear, t)
    for r in results:
        assert r["column = dense"] and r["row = dense"]
        assert r["column collectives"] == ["all_gather"] and r["row collectives"] == ["all_reduce"]
    assert [r["column features"] for r in results][-1] == (12 - 12 // t, 12)


@pytest.mark.parametrize(("part", "sp"), [("mlp", False), ("attention", False), ("block", True)])
def test_the_parallel_halves_and_block_equal_the_dense_ones(part, sp):
    for r in launch(lab.compare_block, 2, kwargs={"part": part, "sequence_parallel": sp}):
        assert r["output"] and r["input gradient"] and r["weight gradients"]
        calls = 2 if part == "block" else 1
        if sp:
            assert r["forward"] == ["all_gather", "reduce_scatter"] * calls
        else:
            assert r["forward"] == ["all_reduce"] * calls == r["backward"]
        assert r["bytes"] == lab.collective_bytes_formula(lab.BATCH, 8, 32, 2) * calls / 2


def test_compare_block_refuses_an_unknown_part():
    with pytest.raises(ValueError, match="part must be"):
        lab._halves(None, None, "head")


def test_the_whole_gpt_pads_its_vocabulary():
    for r in launch(lab.gpt_losses, 4, args=(65,)):
        assert r["loss = dense"] and r["padded vocabulary"] == 68


@pytest.mark.parametrize("regather", [False, True])
def test_saved_bytes_against_the_formula(regather):
    for rank in launch(memory.saved_bytes, 4, kwargs={"regather": regather}):
        for r in rank:
            t, sp = r["t"], r["sequence_parallel"]
            # the course's column layers keep the gathered input: 2 s b h (1 - 1/t) more
            extra = 0 if regather or not sp else int(2 * 32 * 2 * 32 * (1 - 1 / t) * 4)
            assert r["bytes"] == memory.formula_bytes(t, sp) + extra


def regathered_gradients() -> bool:
    """GatheredLinear's gradients are those of gather-then-linear."""
    import torch

    t, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(2, 8, 6)
    weight = torch.randn(4, 6, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    shard = full.chunk(t, 1)[rank].clone().requires_grad_(True)
    memory.GatheredLinear.apply(shard, weight, bias, None).square().sum().backward()
    want_x = full.clone().requires_grad_(True)
    w2, b2 = (
        weight.detach().clone().requires_grad_(True),
        bias.detach().clone().requires_grad_(True),
    )
    F.linear(want_x, w2, b2).square().sum().backward()
    # each rank computed the weight's gradient over all tokens: the same on every rank
    return (
        torch.allclose(shard.grad, want_x.grad.chunk(t, 1)[rank] * t, **lab.TOL)
        and torch.allclose(weight.grad, w2.grad, **lab.TOL)
        and torch.allclose(bias.grad, b2.grad, **lab.TOL)
    )


def test_gathered_linear_gives_the_gradients_of_a_gather_then_a_linear():
    # every rank computes the same loss over all tokens, so the reduce-scatter of the
    # input's gradient sums t equal copies: t times one rank's share
    assert all(launch(regathered_gradients, 2))


def test_formula_bytes_is_korthikantis_count_plus_layer_norm_statistics():
    c = memory.MEMORY_GPT
    s, h, a = c["block_size"], c["n_embd"], c["n_head"]
    sbh = s * memory.BATCH * h
    # fp32 values and masks: 34 -> 16 tensors of 4 bytes + 2 masks of 4 bytes = 72
    want = sbh * 72 + a * s * s * memory.BATCH * 12 + 4 * s * memory.BATCH * 4
    assert memory.formula_bytes(1, False) == want
    assert memory.formula_bytes(4, True) * 4 == want


# --------------------------------------------------------------------------- exercises


def test_check_tp_bytes(capsys):
    mistakes = [
        (lambda b, s, h, t, p: 2 * 2 * (t - 1) / t * b * s * h * p, "half: a block runs 4"),
        (lambda b, s, h, t, p: 4 * b * s * h * p, "whole tensor once"),
        (lambda b, s, h, t, p: 8 * b * s * h * p, "whole tensor twice"),
        (lambda b, s, h, t, p: 2 * (t - 1) / t * b * s * h * p, "one all-reduce's worth"),
        (lambda b, s, h, t, p: 3, "times the bytes"),
    ]
    checks(capsys, lab.check_tp_bytes, LAB, "tp_bytes", "the bytes of tensor", mistakes)


def partial_only(x, weight, bias):
    t, rank = dist.get_world_size(), dist.get_rank()
    return F.linear(x.chunk(t, -1)[rank], weight.chunk(t, 1)[rank]) + bias


def bias_everywhere(x, weight, bias):
    t, rank = dist.get_world_size(), dist.get_rank()
    y = F.linear(x.chunk(t, -1)[rank], weight.chunk(t, 1)[rank], bias)
    dist.all_reduce(y)
    return y


def test_check_row_parallel(capsys):
    mistakes = [
        (partial_only, "partial sum: all-reduce them"),
        (bias_everywhere, "bias is added on every rank"),
        (lambda x, weight, bias: x, "shape is not the dense layer's"),
    ]
    verified = "a row-parallel linear layer"
    checks(capsys, lab.check_row_parallel, LAB, "row_parallel", verified, mistakes)


def test_check_sp_activations(capsys):
    mistakes = [
        (lambda s, b, h, a, t: activation_memory(s, b, h, a, 1, tensor_parallel=t), "alone"),
        (lambda s, b, h, a, t: activation_memory(s, b, h, a, 1), "divide by the t ranks"),
        (lambda s, b, h, a, t: 34 * s * b * h / t, "attention scores"),
        (lambda s, b, h, a, t: None, "return a number"),
    ]
    verified = "activation bytes per layer"
    checks(capsys, lab.check_sp_activations, LAB, "sp_activation_bytes", verified, mistakes)


# --------------------------------------------------------------------------- f, g, the MLP
# Each wrong answer is the worked solution with one thing changed, written out whole.


class AveragesTheGradient(torch.autograd.Function):
    """f whose backward averages, as data parallelism does, instead of adding."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class ForgetsTheSum(torch.autograd.Function):
    """g whose forward returns this rank's partial sum."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class SumsOnRankZero(torch.autograd.Function):
    """g that all-reduces on rank 0 only: rank 0 waits for the others for ever."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        if dist.get_rank() == 0:
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_check_f_and_g(capsys):
    f, g = solution(LAB, "f"), solution(LAB, "g")
    assert exercises.check_f_and_g(f, g)
    assert capsys.readouterr().out.startswith("Correct: on 2 and 4 ranks, the column→row MLP")
    mistakes = [
        ((g, f), "on 2 ranks .*, the forward pass is wrong: rank 0: the MLP's output differs "
         r"at \[0, 0, 0\] .*\(f and g look swapped: your f all-reduces in the forward pass"),
        ((f, ForgetsTheSum.apply), "the forward pass is wrong: rank 0: the MLP's output .*"
         r"\(your g's forward returns this rank's partial sum"),
        ((AveragesTheGradient.apply, g), "the forward pass is right, but the backward pass is "
         r"not: rank 0: the gradient of the input x differs .*\(your f's backward averages"),
    ]  # fmt: skip
    for (wrong_f, wrong_g), message in mistakes:
        with pytest.raises(AssertionError, match=message):
            exercises.check_f_and_g(wrong_f, wrong_g)
    with pytest.raises(AssertionError, match="did not all finish within 10 s") as info:
        exercises.check_f_and_g(f, SumsOnRankZero.apply, timeout=10)
    assert "called on some ranks only" in str(info.value)
    assert not exercises.check_f_and_g(stub("f"), g)
    assert capsys.readouterr().out.startswith("Not attempted yet: write f()")


def swaps_f_and_g(x, fc_weight, fc_bias, proj_weight, proj_bias):
    h = F.gelu(F.linear(tp.reduce_from_tensor_model_parallel_region(x), fc_weight, fc_bias))
    return tp.copy_to_tensor_model_parallel_region(F.linear(h, proj_weight)) + proj_bias


def forgets_f(x, fc_weight, fc_bias, proj_weight, proj_bias):
    h = F.gelu(F.linear(x, fc_weight, fc_bias))
    return tp.reduce_from_tensor_model_parallel_region(F.linear(h, proj_weight)) + proj_bias


def adds_the_bias_before_g(x, fc_weight, fc_bias, proj_weight, proj_bias):
    h = F.gelu(F.linear(tp.copy_to_tensor_model_parallel_region(x), fc_weight, fc_bias))
    return tp.reduce_from_tensor_model_parallel_region(F.linear(h, proj_weight, proj_bias))


def sums_on_rank_zero(x, fc_weight, fc_bias, proj_weight, proj_bias):
    h = F.gelu(F.linear(tp.copy_to_tensor_model_parallel_region(x), fc_weight, fc_bias))
    y = F.linear(h, proj_weight)
    if dist.get_rank() == 0:
        y = tp.reduce_from_tensor_model_parallel_region(y)
    return y + proj_bias


def test_the_mlp_exercises_references_are_the_dense_mlps_split():
    """The library's layers and torch's ColwiseParallel → RowwiseParallel, which the
    checker holds the learner's MLP against, give the dense MLP's output and gradients
    (each weight's gradient cut as the shards are), on 2 ranks."""
    for r in launch(runs.mlp_case, 2, kwargs={"mlp": forgets_f}):
        for against in ("library", "torch"):
            for name, want in r["dense"].items():
                assert r[against][name].shape == want.shape, (against, name)
                assert torch.allclose(r[against][name], want, **lab.TOL), (against, name)
        assert not torch.allclose(r["got"]["x"], r["dense"]["x"], **lab.TOL)


def test_check_parallel_mlp(capsys):
    mistakes = [
        (swaps_f_and_g, r"the forward pass is wrong: rank 0: the MLP's output differs at "
         r"\[0, 0, 0\] .*have f and g swapped places\?"),
        (forgets_f, "the forward pass is right, but the backward pass is not: rank 0: the "
         "gradient of the input x differs .*this rank's share of the input's gradient"),
        (adds_the_bias_before_g, "c_proj's bias is added on every rank before the sum"),
    ]  # fmt: skip
    verified = "on 2 and 4 ranks, your parallel MLP gives the dense MLP's output"
    checks(capsys, exercises.check_parallel_mlp, LAB, "parallel_mlp", verified, mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 10 s"):
        exercises.check_parallel_mlp(sums_on_rank_zero, timeout=10)
