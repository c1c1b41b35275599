"""labsupport.estimate: the walls' formulas against published numbers and against PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labsupport import collectives, comm, estimate, launch

SMALL = estimate.GPTConfig()
ODD = estimate.GPTConfig(vocab=100, seq_len=16, layers=3, hidden=32, heads=2, dropout=0.2)

# --------------------------------------------------------------------------- compute


def test_six_n_d_matches_the_published_totals():
    # GPT-3 table D.1: 3.14e23 FLOPs for 174.6 billion parameters and 300 billion tokens
    assert f"{estimate.training_flops(174.6e9, 300e9):.2e}" == "3.14e+23"
    # Llama 3: 405B parameters, 15.6T tokens, "3.8 x 10^25 FLOPs"
    assert f"{estimate.training_flops(405e9, 15.6e12):.1e}" == "3.8e+25"
    for spec in estimate.MODELS.values():
        if "reported_flops" in spec:
            ratio = estimate.training_flops(spec["params"], spec["tokens"]) / spec["reported_flops"]
            assert 0.99 < ratio < 1.01


def test_training_days():
    # 6ND on 1,024 A100s at 40%: GPT-3 in about 28.5 days
    days = estimate.training_days(estimate.training_flops(175e9, 300e9), 1024, 312e12, 0.4)
    assert days == pytest.approx(3.15e23 / (1024 * 312e12 * 0.4) / 86400)
    assert 28 < days < 29
    assert estimate.training_days(86400e12, 1, 1e12, 1.0) == pytest.approx(1.0)


@pytest.mark.parametrize("cfg", [SMALL, ODD], ids=["small", "odd"])
@pytest.mark.parametrize("recompute", estimate.RECOMPUTE)
def test_flop_count_of_a_step_matches_pytorch(cfg, recompute):
    model = estimate.build(cfg, seed=1)
    idx, targets = estimate.random_batch(cfg, 3, seed=2)
    measured = estimate.count_step_flops(model, idx, targets, recompute)
    tokens = 3 * cfg.seq_len
    want = estimate.transformer_training_flops(
        tokens, cfg.layers, cfg.hidden, cfg.seq_len, cfg.vocab, recompute
    )
    assert measured == want


def test_backward_costs_twice_the_forward():
    model = estimate.build(ODD, seed=0)
    idx, targets = estimate.random_batch(ODD, 2, seed=0)
    with FlopCounterMode(display=False) as forward:
        loss = model(idx, targets)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    assert backward.get_total_flops() == 2 * forward.get_total_flops()


def test_transformer_flops_is_narayanans_formula():
    b, s, layers, h, v = 8, 2048, 96, 12288, 51200
    exact = estimate.transformer_training_flops(b * s, layers, h, s, v)
    assert exact == pytest.approx(
        72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    )
    full = estimate.transformer_training_flops(b * s, layers, h, s, v, "full")
    assert full == pytest.approx(
        96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    )
    with pytest.raises(ValueError):
        estimate.transformer_training_flops(1, 1, 1, 1, 1, "partial")


# --------------------------------------------------------------------------- memory


def test_gpt_params_counts_the_model_and_gpt2_small():
    for cfg in (SMALL, ODD):
        assert estimate.gpt_params(cfg) == sum(p.numel() for p in estimate.GPT(cfg).parameters())
    # GPT-2 small (124M) has 124,439,808 parameters, position embeddings included
    gpt2 = estimate.GPTConfig(vocab=50257, seq_len=1024, layers=12, hidden=768, heads=12)
    assert estimate.gpt_params(gpt2) == 124_439_808


def test_training_memory_is_the_zero_papers_16_bytes():
    parts = estimate.training_memory(7.5e9)
    assert sum(parts.values()) == pytest.approx(120e9)  # ZeRO, figure 1: 7.5B -> 120 GB
    assert sum(estimate.training_memory(1.5e9).values()) == pytest.approx(24e9)  # GPT-2 1.5B
    assert parts["weights"] == parts["gradients"] == pytest.approx(15e9)
    assert parts["master weights"] + parts["momentum"] + parts["variance"] == pytest.approx(90e9)
    fp32 = estimate.training_memory(10, "fp32")
    assert fp32 == {"weights": 40, "gradients": 40, "master weights": 0, "momentum": 40,
                    "variance": 40}  # fmt: skip
    with pytest.raises(ValueError):
        estimate.training_memory(10, "int8")


def test_measured_adam_state_is_16_bytes_per_parameter():
    for cfg in (SMALL, ODD):
        model = estimate.build(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx, targets = estimate.random_batch(cfg, 2, seed=0)
        model(idx, targets).backward()
        optimizer.step()
        measured = estimate.measure_model_states(model, optimizer)
        want = estimate.training_memory(estimate.gpt_params(cfg), "fp32")
        for part in ("weights", "gradients", "momentum", "variance"):
            assert measured[part] == want[part], part
        assert measured["step counters"] == 4 * len(list(model.parameters()))


def test_activation_formula_reproduces_the_papers_coefficients():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    per_layer = estimate.activation_memory(s, b, h, a, 1)
    assert per_layer == pytest.approx(sbh * (34 + 5 * a * s / h))
    tp = estimate.activation_memory(s, b, h, a, 1, tensor_parallel=t)
    assert tp == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = estimate.activation_memory(s, b, h, a, 1, tensor_parallel=t, sequence_parallel=True)
    assert sp == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert estimate.activation_memory(s, b, h, a, 1, "selective") == pytest.approx(34 * sbh)
    assert estimate.activation_memory(
        s, b, h, a, 1, "selective", tensor_parallel=t
    ) == pytest.approx(sbh * (10 + 24 / t))
    assert estimate.activation_memory(s, b, h, a, 1, "full") == 2 * sbh
    assert estimate.activation_memory(s, b, h, a, 96) == pytest.approx(96 * per_layer)
    with pytest.raises(ValueError):
        estimate.activation_memory(s, b, h, a, 1, "some")


@pytest.mark.parametrize("dtype,nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("recompute", estimate.RECOMPUTE)
@pytest.mark.parametrize("cfg", [SMALL, ODD], ids=["small", "odd"])
def test_saved_tensors_match_the_formula(cfg, recompute, dtype, nbytes):
    """On CPU, dropout keeps its mask in the activations' dtype; layer norm also saves a
    mean and a reciprocal standard deviation per token (2 of them, 2 values each)."""
    batch = 3
    model = estimate.build(cfg, dtype=dtype)
    idx, _ = estimate.random_batch(cfg, batch, seed=0)
    measured = estimate.measure_activations(model, idx, recompute)
    want = estimate.activation_memory(cfg.seq_len, batch, cfg.hidden, cfg.heads, 1, recompute,
                                      bytes_per_value=nbytes, mask_bytes=nbytes)  # fmt: skip
    layer_norm_stats = 0 if recompute == "full" else 4 * cfg.seq_len * batch * nbytes
    assert measured == [want + layer_norm_stats] * cfg.layers


# --------------------------------------------------------------------------- communication


def test_all_reduce_bytes_is_the_rings_exact_count():
    for world in (2, 3, 4, 8):
        numel = 1000 * world
        exact = collectives.bytes_sent("ring", numel, 4, world, 0)
        assert estimate.all_reduce_bytes(4 * numel, world) == exact


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_step_on_real_ranks(world):
    cfg = {"dropout": 0.0}
    results = launch(estimate.data_parallel_step, world, kwargs={"cfg_kwargs": cfg,
                     "batch_per_rank": 2})  # fmt: skip
    params = estimate.gpt_params(estimate.GPTConfig(**cfg))
    for r in results:
        assert r["numel"] == params
        assert r["bytes_sent"] == estimate.all_reduce_bytes(4 * params, world)
        assert r["messages"] == 2 * (world - 1)
        assert r["max_diff_vs_torch"] < 1e-5
    # the averaged gradient is the gradient of the whole batch on one process
    model = estimate.build(estimate.GPTConfig(**cfg))
    batches = [estimate.random_batch(model.cfg, 2, seed=1 + r) for r in range(world)]
    idx = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    model(idx, targets).backward()
    whole = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(results[0]["mean_gradient"], whole, atol=1e-6, rtol=1e-5)


def test_step_times_and_the_crossover():
    t = estimate.step_times(175e9, 3.2e6, 1024, 312e12, 50e9, mfu=0.4, alpha=0.0)
    assert t["compute"] == pytest.approx(6 * 175e9 * 3.2e6 / (1024 * 312e12 * 0.4))
    assert t["communication"] == pytest.approx(2 * 1023 / 1024 * 350e9 / 50e9)
    sharded = estimate.step_times(175e9, 3.2e6, 1024, 312e12, 50e9, alpha=0.0, sharded=True)
    assert sharded["communication"] == pytest.approx(1.5 * t["communication"])
    g = estimate.crossover_devices(3.2e6, 312e12 * 0.4, 50e9)
    at = estimate.step_times(7e9, 3.2e6, g, 312e12, 50e9, mfu=0.4, alpha=0.0)
    assert at["compute"] == pytest.approx(at["communication"])
    before = estimate.step_times(7e9, 3.2e6, g / 2, 312e12, 50e9, mfu=0.4, alpha=0.0)
    assert before["compute"] > before["communication"]
    with_alpha = estimate.step_times(7e9, 3.2e6, 64, 312e12, 50e9, alpha=1e-3)
    no_alpha = estimate.step_times(7e9, 3.2e6, 64, 312e12, 50e9, alpha=0.0)
    assert with_alpha["communication"] - no_alpha["communication"] == pytest.approx(2 * 63e-3)
    assert comm.all_reduce_time("ring", 64, 14e9, 0.0, 1 / 50e9) == pytest.approx(
        no_alpha["communication"]
    )


def test_which_wall_binds():
    assert estimate.walls(405e9, 15.6e12, 16384, 50e9)["binds"] == "memory"
    assert estimate.walls(405e9, 15.6e12, 16384, 50e9, sharded=True)["binds"] == "communication"
    assert estimate.walls(7e9, 2e12, 512, 50e9, sharded=True)["binds"] == "compute"
    assert estimate.walls(1e9, 1e12, 8, 450e9)["binds"] == "compute"  # 16 GB fits
    w = estimate.walls(1e9, 1e12, 8, 450e9)
    assert w["compute_days"] == pytest.approx(6e21 / (8 * 989e12 * 0.4) / 86400)
    text = estimate.describe_walls(405e9, 15.6e12, 16384, 50e9)
    assert "memory wall binds" in text and "6,480.0 GB" in text


def test_explorer_starts_on_the_default_setting():
    box = estimate.explorer()
    values = {c.description: c.value for c in box.children[:-2]}
    assert values["GPUs (H100)"] == 16384 and values["parameters (B)"] == pytest.approx(405)
    assert box.kwargs["sharded"] is False
    assert "the memory wall binds" in box.children[-1].value
    box.children[4].value = True  # shard the states: the communication wall binds
    assert "the communication wall binds" in box.children[-1].value


def test_figures_draw():
    import matplotlib.pyplot as plt

    for make in (estimate.memory_breakdown_figure, estimate.time_to_train_figure):
        fig = make()
        assert fig.axes
        plt.close(fig)


# --------------------------------------------------------------------------- exercises


def test_checkers_accept_right_answers_and_reject_wrong_ones(capsys):
    def days(n, d, g, peak, mfu):
        return 6 * n * d / (g * peak * mfu) / 86400

    estimate.check_training_days(days)
    with pytest.raises(AssertionError, match="seconds"):
        estimate.check_training_days(lambda *a: days(*a) * 86400)
    with pytest.raises(AssertionError, match="forward pass only"):
        estimate.check_training_days(lambda *a: days(*a) / 3)

    estimate.check_min_gpus(lambda n, m: math.ceil(16 * n / m))
    with pytest.raises(AssertionError):
        estimate.check_min_gpus(lambda n, m: math.ceil(2 * n / m))
    with pytest.raises(AssertionError):
        estimate.check_min_gpus(lambda n, m: int(16 * n / m))

    estimate.check_crossover(lambda b, f, bw: 1 + 1.5 * b * bw / f)
    with pytest.raises(AssertionError):
        estimate.check_crossover(lambda b, f, bw: 1.5 * b * bw / f)
    with pytest.raises(AssertionError):
        estimate.check_crossover(lambda b, f, bw: 1 + 3 * b * bw / f)
    assert capsys.readouterr().out.count("Correct") == 3
