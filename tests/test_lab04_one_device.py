"""Lab 4, one device faster: gradient accumulation (one process and several, and training
on several ranks) and mixed precision, checked against PyTorch and against values worked
out by hand; and the exercises' checkers against the notebook's worked solutions and
wrong answers. Checkpointing and fusion: test_lab04_checkpointing, test_lab04_fusion."""

from __future__ import annotations

import math

import pytest
import torch
from notebook_solutions import solution, stub

from labsupport import launch
from labsupport.estimate.dtypes import FORMATS
from labsupport.labs import lab04_one_device
from labsupport.models import regression_data

LAB = "04-one-device.ipynb"

# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("k", [1, 2, 4, 8, 64])
def test_accumulated_gradient_equals_big_batch(k):
    model = lab04_one_device.make_mlp()
    x, y = regression_data(n=64)
    assert torch.allclose(
        lab04_one_device.accumulated_gradient(model, x, y, k),
        lab04_one_device.batch_gradient(model, x, y),
    )


def test_accumulation_without_dividing_by_k_is_k_times_too_big():
    model = lab04_one_device.make_mlp()
    x, y = regression_data(n=64)
    model.zero_grad()
    for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
        torch.nn.functional.mse_loss(model(xm), ym).backward()
    assert torch.allclose(
        lab04_one_device.flat_grad(model),
        4 * lab04_one_device.batch_gradient(model, x, y),
        atol=1e-6,
    )


def test_batchnorm_breaks_the_equivalence():
    model = lab04_one_device.make_mlp(batchnorm=True)
    x, y = regression_data(n=64)
    big, accumulated = (
        lab04_one_device.batch_gradient(model, x, y),
        lab04_one_device.accumulated_gradient(model, x, y, 4),
    )
    assert not torch.allclose(big, accumulated, atol=1e-4)


def test_accumulation_rejects_unequal_chunks():
    with pytest.raises(ValueError, match="equal chunks"):
        lab04_one_device.accumulated_gradient(
            lab04_one_device.make_mlp(), *regression_data(n=10), 4
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_gradient_equals_big_batch_on_every_rank(world_size):
    grads = launch(lab04_one_device.data_parallel_gradient, world_size, timeout=120)
    want = lab04_one_device.batch_gradient(lab04_one_device.make_mlp(), *regression_data(n=64))
    tolerance = lab04_one_device.rounding_tolerance(want, 64)
    for grad in grads:
        assert (grad - want).abs().max() <= tolerance
    assert all(torch.equal(grads[0], g) for g in grads)


def test_rounding_tolerance_is_terms_times_unit_roundoff_times_the_largest_value():
    assert lab04_one_device.rounding_tolerance(torch.tensor([0.5, -2.0]), 64) == 64 * 2**-24 * 2
    # two orders of one fp32 sum stay within it
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    forward, backward = values.sum(), values.flip(0).cumsum(0)[-1]
    bound = lab04_one_device.rounding_tolerance(values.abs().sum().reshape(1), 4096)
    assert (forward - backward).abs() <= bound


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_training_follows_one_process_on_the_whole_batch(world_size):
    steps = 40
    runs = launch(
        lab04_one_device.data_parallel_training, world_size, kwargs={"steps": steps}, timeout=120
    )
    assert all(torch.equal(runs[0]["weights"], r["weights"]) for r in runs)
    model = lab04_one_device.make_mlp()
    x, y = regression_data(n=64)
    first = lab04_one_device.batch_gradient(model, x, y)
    losses = lab04_one_device.train(model, x, y, steps=steps)
    step_tolerance = lab04_one_device.rounding_tolerance(first, 64)
    tolerance = steps * lab04_one_device.TRAIN_LR * step_tolerance
    assert (runs[0]["weights"] - lab04_one_device.flat_params(model)).abs().max() <= tolerance
    assert runs[0]["losses"].shape == (steps,)
    torch.testing.assert_close(runs[0]["losses"], torch.tensor(losses), rtol=1e-5, atol=0)
    assert losses[-1] < losses[0]


def test_data_parallel_training_shows_each_rank_s_progress(capsys):
    launch(lab04_one_device.data_parallel_training, 2, kwargs={"steps": 5}, timeout=120)
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}] 32 of the 64 samples, 5 steps of SGD" in out
        assert f"[rank {rank}] train |{'#' * 24}| 5/5" in out


# --------------------------------------------------------------------------- mixed precision


def test_rounding_error_is_at_most_unit_roundoff():
    x = torch.randn(10000, dtype=torch.float64)
    for name in ("fp32", "fp16", "bf16"):
        f = FORMATS[name]
        assert 0 < lab04_one_device.rounding_error(x, getattr(torch, f.dtype)) <= f.unit_roundoff
    assert lab04_one_device.rounding_error(torch.tensor([1.0, 0.5, 2.0]), torch.bfloat16) == 0


def test_bf16_matmul_error_near_prediction_and_far_above_fp32():
    errors = lab04_one_device.matmul_errors(n=128)
    assert errors["bf16_dtype"] == torch.bfloat16
    assert errors["fp32"] < 2**-20
    assert 2**-10 < errors["bf16"] < 2**-7
    assert errors["bf16"] == pytest.approx(errors["predicted_bf16"], rel=0.25)
    assert errors["predicted_bf16"] == math.sqrt(3) * errors["one_rounding"]


def test_matmul_seconds_times_fp32_against_bf16_autocast(monkeypatch):
    """The timing itself is side_by_side's (tests/test_measure.py); here, which functions
    are timed and what is made of the times."""
    outputs = {}

    def one_round(fns, rounds):
        outputs.update((name, fn()) for name, fn in fns.items())
        return {"fp32": 2.0, "bf16": 0.5, "ratio": {"fp32": 1.0, "bf16": 0.25}}

    monkeypatch.setattr(lab04_one_device, "side_by_side", one_round)
    t = lab04_one_device.matmul_seconds(n=64, rounds=3)
    assert t == {
        "fp32": 2.0,
        "bf16": 0.5,
        "speedup": 4.0,
        "flops": 2 * 64**3,
        "bf16_dtype": torch.bfloat16,
    }
    assert outputs["fp32"].dtype == torch.float32 and outputs["fp32"].shape == (64, 64)
    assert outputs["bf16"].dtype == torch.bfloat16
    torch.testing.assert_close(outputs["bf16"].float(), outputs["fp32"], atol=0.5, rtol=0.05)


def test_spacing_is_the_ulp():
    assert lab04_one_device.spacing(1.0, torch.bfloat16) == 2**-7
    assert lab04_one_device.spacing(1.0, torch.float16) == 2**-10
    assert lab04_one_device.spacing(1.0, torch.float32) == 2**-23
    assert lab04_one_device.spacing(1024.0, torch.float16) == 1.0


def test_small_updates_vanish_in_bf16_but_not_in_fp32():
    assert (
        lab04_one_device.repeated_update(torch.bfloat16) == 1.0
    )  # 1e-3 < 2^-8, half the spacing at 1
    assert lab04_one_device.repeated_update(torch.float32) == pytest.approx(2.0, abs=1e-3)
    # fp16: 1 + 1e-3 rounds up to 1 + 2^-10 until w reaches 2 (1000 * 2^-10 = 0.977)
    assert lab04_one_device.repeated_update(torch.float16) == pytest.approx(1 + 1000 * 2**-10)
    assert lab04_one_device.repeated_update(torch.bfloat16, update=2**-6, steps=4) == 1 + 2**-4


def test_fp16_gradients_underflow_without_scaling_and_survive_with_it():
    model, x, y = lab04_one_device.make_amp_model()
    ref = lab04_one_device.amp_gradient(model, x, y)
    unscaled = lab04_one_device.amp_gradient(model, x, y, torch.float16)
    scaled = lab04_one_device.amp_gradient(model, x, y, torch.float16, loss_scale=2.0**16)
    assert (ref == 0).float().mean() == 0
    assert (unscaled == 0).float().mean() > 0.5
    assert ((scaled - ref).norm() / ref.norm()) < 1e-2
    assert (scaled == 0).float().mean() < 1e-3
    bf16 = lab04_one_device.amp_gradient(model, x, y, torch.bfloat16)
    assert ((bf16 - ref).norm() / ref.norm()) < 2e-2  # bf16 has fp32's range: no scaling


def test_static_scaler_equals_torch_gradscaler():
    model, x, y = lab04_one_device.make_amp_model()
    ours = lab04_one_device.amp_gradient(model, x, y, torch.float16, loss_scale=2.0**16)
    assert torch.equal(ours, lab04_one_device.gradscaler_gradient(model, x, y, 2.0**16))


def test_gradscaler_skips_step_and_halves_scale_on_overflow():
    result = lab04_one_device.gradscaler_overflow_step(2.0**40)
    assert result["skipped"] and result["scale_after"] == 2.0**39
    assert not lab04_one_device.gradscaler_overflow_step(2.0**10)[
        "skipped"
    ]  # a safe scale: a real step


def test_best_segment_length_minimizes_chen_s_peak():
    # the lab's stack, 16 blocks of 9 units: 16 + 9 = 25 at c = 1, 8 + 18 = 26 at c = 2
    assert lab04_one_device.checkpoint_peak_units(16, 9, 1) == 25
    assert lab04_one_device.best_segment_length(16, 9) == 1
    # GPT-3: 96 layers that save 57 times their input (Korthikanti et al.): every layer
    assert lab04_one_device.best_segment_length(96, 57) == 1
    # sqrt(L) segments when a block saves one unit: 100 -> 10, at a peak of 20
    assert lab04_one_device.best_segment_length(100, 1) == 10
    # 1,000 blocks: peaks of 64 for c = 28 to 36; the shortest wins, not round(sqrt(1000))
    peaks = {c: lab04_one_device.checkpoint_peak_units(1000, 1, c) for c in range(26, 40)}
    assert min(peaks.values()) == 64 and [c for c, p in peaks.items() if p == 64] == list(
        range(28, 37)
    )
    assert lab04_one_device.best_segment_length(1000, 1) == 28


# --------------------------------------------------------------------------- exercises


def _accumulate_by_count(model, x, y, sizes):  # the mistake: 1/k, not size/n
    model.zero_grad()
    for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True):
        (torch.nn.functional.mse_loss(model(xm), ym) / len(sizes)).backward()
    return lab04_one_device.flat_grad(model)


def _accumulate_unweighted(model, x, y, sizes):  # the mistake: no weight at all
    model.zero_grad()
    for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True):
        torch.nn.functional.mse_loss(model(xm), ym).backward()
    return lab04_one_device.flat_grad(model)


def _accumulate_last_only(model, x, y, sizes):  # the mistake: zero_grad in the loop
    for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True):
        model.zero_grad()
        (torch.nn.functional.mse_loss(model(xm), ym) * len(xm) / len(x)).backward()
    return lab04_one_device.flat_grad(model)


def test_check_accumulation(capsys):
    assert not lab04_one_device.check_accumulation(stub("accumulate"))
    assert capsys.readouterr().out.startswith("Not attempted yet: write accumulate()")
    assert lab04_one_device.check_accumulation(solution(LAB, "accumulate"))
    said = capsys.readouterr().out
    assert said.startswith("Correct: ") and "len(" not in said and "weight" not in said
    with pytest.raises(AssertionError, match="sizes=\\[40, 20\\]"):
        lab04_one_device.check_accumulation(_accumulate_by_count)
    with pytest.raises(AssertionError, match="2 times too big"):
        lab04_one_device.check_accumulation(_accumulate_unweighted)
    with pytest.raises(AssertionError, match="sizes="):
        lab04_one_device.check_accumulation(_accumulate_last_only)
    with pytest.raises(AssertionError, match="flat gradient"):
        lab04_one_device.check_accumulation(lambda model, x, y, sizes: None)


def test_check_saved_bytes(capsys):
    name = "saved_bytes_with_checkpoints"
    assert not lab04_one_device.check_saved_bytes(stub(name))
    assert f"write {name}()" in capsys.readouterr().out
    assert lab04_one_device.check_saved_bytes(solution(LAB, name))
    said = capsys.readouterr().out
    assert said.startswith("Correct: ") and "ceil" not in said
    with pytest.raises(AssertionError, match="saved"):  # the last, shorter segment forgotten
        lab04_one_device.check_saved_bytes(lambda L, b, d, s: L // s * b * d * 4)
    with pytest.raises(AssertionError, match="saved"):  # no checkpointing: 9 per block
        lab04_one_device.check_saved_bytes(lambda L, b, d, s: 9 * L * b * d * 4)
    with pytest.raises(AssertionError, match="saved"):  # elements, not bytes
        lab04_one_device.check_saved_bytes(lambda L, b, d, s: math.ceil(L / s) * b * d)


def _rounded_square_root(layers, units):  # the mistake: the continuous optimum, rounded
    return max(1, round(math.sqrt(layers / units)))


def _longest_of_equal_peaks(layers, units):  # the mistake: the last of equal peaks
    peaks = [math.ceil(layers / c) + units * c for c in range(1, layers + 1)]
    return max(c for c in range(1, layers + 1) if peaks[c - 1] == min(peaks))


def test_check_best_segment(capsys):
    assert not lab04_one_device.check_best_segment(stub("best_segment"))
    assert capsys.readouterr().out.startswith("Not attempted yet: write best_segment()")
    assert lab04_one_device.check_best_segment(solution(LAB, "best_segment"))
    said = capsys.readouterr().out
    assert said.startswith("Correct: ") and "ceil" not in said and "min(" not in said
    with pytest.raises(AssertionError, match="shorter segment"):
        lab04_one_device.check_best_segment(_rounded_square_root)
    with pytest.raises(AssertionError, match="shorter segment"):
        lab04_one_device.check_best_segment(_longest_of_equal_peaks)
    with pytest.raises(AssertionError, match="peaks lower"):  # units per block forgotten
        lab04_one_device.check_best_segment(lambda layers, units: _rounded_square_root(layers, 1))
    with pytest.raises(AssertionError, match="whole number"):
        lab04_one_device.check_best_segment(lambda layers, units: math.sqrt(layers / units))
