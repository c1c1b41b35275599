"""Lab 3, the three walls: the lab's GPT measured against the formulas (FLOPs of a step,
activations saved per layer), a data-parallel step on real ranks, the explorer, and
the exercises' checkers against the notebook's worked solutions and wrong answers."""

from __future__ import annotations

import math

import pytest
import torch
from notebook_solutions import solution, stub

from labsupport import launch
from labsupport.comm.cost import ring_all_reduce_bytes
from labsupport.estimate.flops import transformer_training_flops
from labsupport.estimate.memory import activation_memory
from labsupport.estimate.params import gpt_params
from labsupport.estimate.walls import describe_walls
from labsupport.labs import lab03_walls
from labsupport.models.gpt import RECOMPUTE

LAB = "03-walls.ipynb"

# The lab's GPT as it is, and one whose every size differs (3 layers, 2 heads, 32 wide).
ODD = {"vocab_size": 100, "block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 32}
CONFIGS = {"lab": {}, "odd": ODD | {"dropout": 0.2}}


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
    want = activation_memory(
        c.block_size,
        batch,
        c.n_embd,
        c.n_head,
        1,
        recompute,
        bytes_per_value=nbytes,
        mask_bytes=nbytes,
    )
    layer_norm_stats = 0 if recompute == "full" else 4 * c.block_size * batch * nbytes
    assert lab03_walls.activation_bytes(model, idx) == [want + layer_norm_stats] * c.n_layer


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_step_on_real_ranks(world):
    config = {"dropout": 0.0}
    kwargs = {"config": config, "batch_per_rank": 2}
    results = launch(lab03_walls.data_parallel_step, world, kwargs=kwargs)
    c = lab03_walls.build(**config).config
    params = gpt_params(c.vocab_size, c.block_size, c.n_embd, c.n_layer)
    for r in results:
        assert r["numel"] == params
        assert r["bytes_sent"] == ring_all_reduce_bytes(4 * params, world)
        assert r["messages"] == 2 * (world - 1)
        assert r["matches_torch"] is True
    # the averaged gradient is the gradient of the whole batch on one process, within the
    # rounding of a sum over the batch's tokens in another order
    model = lab03_walls.build(**config)
    batches = [lab03_walls.batch(model, 2, seed=1 + r) for r in range(world)]
    idx = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    model(idx, targets)[1].backward()
    whole = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    atol = idx.numel() * 2**-24 * whole.abs().max().item()
    torch.testing.assert_close(results[0]["mean_gradient"], whole, rtol=0, atol=atol)
    assert all(r["mean_gradient"] is None for r in results[1:])


# --------------------------------------------------------------------------- explorer


def test_explorer_starts_exactly_on_the_text_s_setting():
    box = lab03_walls.explorer()
    assert box.kwargs == lab03_walls.EXPLORER_START
    assert box.kwargs == {
        "params_b": 405,
        "tokens_b": 15_600,
        "gpus": 16_384,
        "bandwidth_gb_s": 50,
        "sharded": False,
    }
    want = describe_walls(405e9, 15.6e12, 16384, 50e9)
    assert box.describe() == want
    assert box.children[-1].value == f"<pre>{want.replace('->', '-&gt;')}</pre>"
    labels = [c.label for c in box.children[:4]]
    assert labels == ["405B", "15,600B", "16,384", "50 GB/s"]


def test_explorer_follows_its_controls():
    box = lab03_walls.explorer()
    assert "the memory wall binds" in box.children[-1].value
    box.children[4].value = True  # shard the states: the communication wall binds
    assert "the communication wall binds" in box.children[-1].value
    box.children[2].value = 512  # fewer GPUs: compute outlasts the all-reduce
    assert box.describe() == describe_walls(405e9, 15.6e12, 512, 50e9, sharded=True)
    assert "the compute wall binds" in box.children[-1].value


def test_explorer_shows_its_whole_checkbox_label_and_reads_well_without_a_kernel():
    box = lab03_walls.explorer()
    checkbox = box.children[4]
    assert checkbox.description == "shard the model states (ZeRO-3)"
    # the box is as wide as the sliders: the 150px indent leaves room for the label
    assert checkbox.layout.width == box.children[0].layout.width == "560px"
    plain = box._repr_mimebundle_()["text/plain"]
    assert plain.startswith("Walls explorer") and "children" not in plain


def test_explorer_choices_are_sorted_and_reach_the_lab_s_settings():
    for values in (
        lab03_walls.PARAMS_B,
        lab03_walls.TOKENS_B,
        lab03_walls.GPUS,
        lab03_walls.BANDWIDTH_GB_S,
    ):
        assert list(values) == sorted(set(values))
    assert {1, 7, 70, 405} <= set(lab03_walls.PARAMS_B)
    assert {100, 2_000, 15_000, 15_600} <= set(lab03_walls.TOKENS_B)
    assert {8, 512, 2048, 16384} <= set(lab03_walls.GPUS)
    assert {50, 450} <= set(lab03_walls.BANDWIDTH_GB_S)


# --------------------------------------------------------------------------- exercises


def test_check_training_days(capsys):
    assert not lab03_walls.check_training_days(stub("training_days"))
    assert capsys.readouterr().out.startswith("Not attempted yet: write training_")
    days = solution(LAB, "training_days")
    assert lab03_walls.check_training_days(days)
    said = capsys.readouterr().out
    assert said.startswith("Correct: ") and "6·N·D" not in said and "86,400" not in said
    with pytest.raises(AssertionError, match="in seconds"):
        lab03_walls.check_training_days(lambda *a: days(*a) * 86_400)
    with pytest.raises(AssertionError, match="forward pass only"):
        lab03_walls.check_training_days(lambda *a: days(*a) / 3)
    with pytest.raises(AssertionError, match="in hours"):
        lab03_walls.check_training_days(lambda *a: days(*a) * 24)
    with pytest.raises(AssertionError, match="expected"):  # MFU forgotten
        lab03_walls.check_training_days(lambda n, d, g, peak, mfu: days(n, d, g, peak, 1.0))


def test_check_min_gpus(capsys):
    assert not lab03_walls.check_min_gpus(stub("min_gpus"))
    assert "Not attempted yet: write min_gpus()" in capsys.readouterr().out
    assert lab03_walls.check_min_gpus(solution(LAB, "min_gpus"))
    said = capsys.readouterr().out
    assert said.startswith("Correct: ") and "ceil" not in said and "16·" not in said
    with pytest.raises(AssertionError, match="round up"):
        lab03_walls.check_min_gpus(lambda n, m: int(16 * n / m))
    with pytest.raises(AssertionError):  # the weights alone, 2 bytes per parameter
        lab03_walls.check_min_gpus(lambda n, m: math.ceil(2 * n / m))
    with pytest.raises(AssertionError):  # 12 bytes: the optimizer states only
        lab03_walls.check_min_gpus(lambda n, m: math.ceil(12 * n / m))


def test_check_crossover(capsys):
    lab03_walls.check_crossover(stub("crossover_gpus"))
    assert capsys.readouterr().out.startswith("Not attempted yet")
    assert lab03_walls.check_crossover(solution(LAB, "crossover_gpus"))
    said = capsys.readouterr().out
    assert said.startswith("Correct: ") and "1.5" not in said
    assert not lab03_walls.check_crossover(stub("crossover_gpus"))
    with pytest.raises(AssertionError):  # the 1 + forgotten
        lab03_walls.check_crossover(lambda b, f, bw: 1.5 * b * bw / f)
    with pytest.raises(AssertionError):  # 4-byte gradients
        lab03_walls.check_crossover(lambda b, f, bw: 1 + 0.75 * b * bw / f)
    with pytest.raises(AssertionError):  # one pass of the gradient (a reduce-scatter alone)
        lab03_walls.check_crossover(lambda b, f, bw: 1 + 3 * b * bw / f)
