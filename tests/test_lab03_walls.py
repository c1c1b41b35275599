"""Lab 3, the three walls: the lab's GPT measured against the formulas (FLOPs of a step,
activations saved per layer), a data-parallel step on real ranks, the explorer, and
the exercises' checkers."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport import launch
from labsupport.comm.cost import ring_all_reduce_bytes
from labsupport.estimate.flops import transformer_training_flops
from labsupport.estimate.memory import activation_memory
from labsupport.estimate.params import gpt_params
from labsupport.labs import lab03_walls
from labsupport.models.gpt import RECOMPUTE

# The lab's GPT as it is, and one whose every size differs (3 layers, 2 heads, 32 wide).
CONFIGS = {"lab": {}, "odd": {"vocab_size": 100, "block_size": 16, "n_layer": 3, "n_head": 2,
                              "n_embd": 32, "dropout": 0.2}}  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_flop_count_of_a_step_matches_the_formula(config, recompute):
    model = lab03_walls.build(seed=1, recompute=recompute, **config)
    idx, targets = lab03_walls.batch(model, 3, seed=2)
    c = model.config
    want = transformer_training_flops(
        3 * c.block_size, c.n_layer, c.n_embd, c.block_size, c.vocab_size, recompute
    )
    assert lab03_walls.step_flops(model, idx, targets) == want
    assert all(p.grad is None for p in model.parameters()), "step_flops leaves no gradient"


@pytest.mark.parametrize(("dtype", "nbytes"), [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
def test_saved_tensors_match_the_formula(config, recompute, dtype, nbytes):
    """On CPU, dropout keeps its mask in the activations' dtype; layer norm also saves a
    mean and a reciprocal standard deviation per token (2 of them, 2 values each)."""
    batch = 3
    model = lab03_walls.build(recompute=recompute, **config).to(dtype)
    idx, _ = lab03_walls.batch(model, batch, seed=0)
    c = model.config
    want = activation_memory(c.block_size, batch, c.n_embd, c.n_head, 1, recompute,
                             bytes_per_value=nbytes, mask_bytes=nbytes)  # fmt: skip
    layer_norm_stats = 0 if recompute == "full" else 4 * c.block_size * batch * nbytes
    assert lab03_walls.activation_bytes(model, idx) == [want + layer_norm_stats] * c.n_layer


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_step_on_real_ranks(world):
    config = {"dropout": 0.0}
    results = launch(lab03_walls.data_parallel_step, world,
                     kwargs={"config": config, "batch_per_rank": 2})  # fmt: skip
    c = lab03_walls.build(**config).config
    params = gpt_params(c.vocab_size, c.block_size, c.n_embd, c.n_layer)
    for r in results:
        assert r["numel"] == params
        assert r["bytes_sent"] == ring_all_reduce_bytes(4 * params, world)
        assert r["messages"] == 2 * (world - 1)
        assert r["max_diff_vs_torch"] < 1e-5
    # the averaged gradient is the gradient of the whole batch on one process
    model = lab03_walls.build(**config)
    batches = [lab03_walls.batch(model, 2, seed=1 + r) for r in range(world)]
    idx = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    model(idx, targets)[1].backward()
    whole = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(results[0]["mean_gradient"], whole, atol=1e-6, rtol=1e-5)
    assert all(r["mean_gradient"] is None for r in results[1:])


def test_explorer_starts_on_the_default_setting():
    box = lab03_walls.explorer()
    values = {c.description: c.value for c in box.children[:-2]}
    assert values["GPUs (H100)"] == 16384 and values["parameters (B)"] == pytest.approx(405)
    assert box.kwargs["sharded"] is False
    assert "the memory wall binds" in box.children[-1].value
    box.children[4].value = True  # shard the states: the communication wall binds
    assert "the communication wall binds" in box.children[-1].value


# --------------------------------------------------------------------------- exercises


def test_checkers_accept_right_answers_and_reject_wrong_ones(capsys):
    def days(n, d, g, peak, mfu):
        return 6 * n * d / (g * peak * mfu) / 86400

    lab03_walls.check_training_days(days)
    with pytest.raises(AssertionError, match="seconds"):
        lab03_walls.check_training_days(lambda *a: days(*a) * 86400)
    with pytest.raises(AssertionError, match="forward pass only"):
        lab03_walls.check_training_days(lambda *a: days(*a) / 3)

    lab03_walls.check_min_gpus(lambda n, m: math.ceil(16 * n / m))
    with pytest.raises(AssertionError):
        lab03_walls.check_min_gpus(lambda n, m: math.ceil(2 * n / m))
    with pytest.raises(AssertionError):
        lab03_walls.check_min_gpus(lambda n, m: int(16 * n / m))

    lab03_walls.check_crossover(lambda b, f, bw: 1 + 1.5 * b * bw / f)
    with pytest.raises(AssertionError):
        lab03_walls.check_crossover(lambda b, f, bw: 1.5 * b * bw / f)
    with pytest.raises(AssertionError):
        lab03_walls.check_crossover(lambda b, f, bw: 1 + 3 * b * bw / f)
    assert capsys.readouterr().out.count("Correct") == 3
