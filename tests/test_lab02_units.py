"""Lab 2, units: the formats table, what a cast to 16 bits does to gradients, the
all-reduce in each dtype on real ranks, and the exercises' checkers (each accepts the
notebook's worked solution, rejects plausible mistakes and says "not attempted yet" for
the stub)."""

from __future__ import annotations

import math

import pytest
import torch
from notebook_solutions import solution, stub

from labsupport import launch
from labsupport.comm.allreduce import bytes_sent
from labsupport.estimate.dtypes import FORMATS, dtype_bytes
from labsupport.estimate.params import gpt_params
from labsupport.labs import lab02_units

LAB = "02-units.ipynb"


def test_format_rows_hold_each_formats_range_and_precision():
    rows = {r["format"]: r for r in lab02_units.format_rows()}
    assert list(rows) == list(FORMATS)
    assert rows["fp16"]["bits (s-e-m)"] == "16 (1-5-10)"
    assert rows["fp16"]["max"] == "65504"
    assert rows["fp16"]["eps"] == "2^-10 = 0.000977"
    assert rows["bf16"]["digits"] == "2.4"  # 8 significant bits: log10(2^8)
    assert rows["fp8 e4m3"]["max"] == "448"


def test_cast_report_counts_underflow_overflow_and_subnormals():
    values = torch.tensor([1e-9, 1e-6, 1.0, 1e5, 0.0])
    r = lab02_units.cast_report(values, "fp16")
    assert r["zero"] == 0.25  # 1e-9 of the four nonzero values
    assert r["inf"] == 0.25  # 1e5
    assert r["subnormal"] == 0.25  # 1e-6 < 2^-14
    scaled = lab02_units.cast_report(values, "fp16", scale=2.0**-4)
    assert scaled["inf"] == 0 and scaled["zero"] == 0.25
    assert lab02_units.cast_report(values, "bf16")["zero"] == 0


def test_loss_scaling_rescues_logit_gradients():
    grads = lab02_units.tiny_gpt_gradients(vocab_size=1024, batch=8)
    assert grads["tokens"] == 8 * 64
    assert grads["logits"].numel() == 8 * 64 * 1024
    rows = lab02_units.loss_scale_sweep(grads["logits"], "fp16", powers=[0, 16, 40])
    assert [r["log2 scale"] for r in rows] == [0, 16, 40]
    assert rows[0]["subnormal"] > 0.5  # entries about 1 / (V * tokens) ~ 2e-6
    assert rows[1]["subnormal"] == 0 and rows[1]["inf"] == 0
    assert rows[1]["median rel. error"] < rows[0]["median rel. error"] / 5
    assert rows[2]["inf"] > 0  # too large a scale overflows


def test_sweep_rows_do_not_move_with_the_last_bits_of_the_gradients():
    # Two CPUs (AVX2, and no vector unit) computed these gradients a relative 1.1e-6 apart
    # at most; the lab's table must not change for 100 times that, in either direction.
    grads = lab02_units.tiny_gpt_gradients(vocab_size=4096, batch=8)["logits"]
    powers = range(0, 33, 4)
    rows = lab02_units.sweep_rows(lab02_units.loss_scale_sweep(grads, "fp16", powers))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        wiggle = 1 + 1e-4 * (2 * torch.rand(grads.shape, generator=gen) - 1)
        moved = lab02_units.loss_scale_sweep(grads * wiggle, "fp16", powers)
        assert lab02_units.sweep_rows(moved) == rows
    for factor in (1 - 1e-4, 1 + 1e-4):
        assert (
            lab02_units.sweep_rows(lab02_units.loss_scale_sweep(grads * factor, "fp16", powers))
            == rows
        )


def test_all_reduce_in_dtypes_on_real_ranks():
    world, numel = 3, 999
    results = launch(lab02_units.all_reduce_in_dtypes, world_size=world, kwargs={"numel": numel})
    assert [r["rank"] for r in results] == list(range(world))
    cases = {(c["dtype"], c["loss scale"]): c for c in results[0]["cases"]}
    assert list(cases) == list(lab02_units.ALL_REDUCE_CASES)
    for r in results[1:]:
        assert [c["checksum"] for c in r["cases"]] == [c["checksum"] for c in results[0]["cases"]]
    assert cases["fp32", 1.0]["relative error"] < 1e-6
    assert 1e-4 < cases["fp16", 1.0]["relative error"] < 2e-3
    assert 1e-3 < cases["bf16", 1.0]["relative error"] < 1e-2
    for r in results:  # a 16-bit gradient sends half the bytes of an fp32 one
        for case in r["cases"]:
            want = bytes_sent("ring", numel, dtype_bytes(case["dtype"]), world, r["rank"])
            assert case["bytes sent"] == want

    tiny = launch(
        lab02_units.all_reduce_in_dtypes, world_size=2, kwargs={"numel": 512, "scale": 1e-8}
    )
    cases = {(c["dtype"], c["loss scale"]): c for c in tiny[0]["cases"]}
    assert cases["fp16", 1.0]["relative error"] > 0.5  # flushed to zero
    assert cases["fp16", 1.0]["zeros"] > 0
    assert cases["fp16", 2.0**16]["relative error"] < 2e-3  # rescued by the scale
    assert cases["bf16", 1.0]["relative error"] < 1e-2


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_under_autocast_all_reduces_fp32_unless_a_hook_compresses(world):
    runs = {
        compress: launch(lab02_units.ddp_gradient_dtypes, world, kwargs={"compress": compress})
        for compress in (False, True)
    }
    numel = 64 * 256 + 256 + 256 * 8 + 8  # the model's parameters: one bucket
    for compress, results in runs.items():
        for r in results:
            assert r["output dtype"] == "bfloat16"
            assert r["param dtype"] == r["grad dtype"] == "float32"
            assert r["buckets"] == [{"dtype": "float32", "numel": numel}]
            assert r["bf16 numbers"] is compress
            assert torch.equal(r["grads"], results[0]["grads"])
    plain, compressed = runs[False][0]["grads"], runs[True][0]["grads"]
    assert 0 < (compressed - plain).norm() / plain.norm() < 4 * 2**-8
    # without the hook DDP's average is the fp32 mean of the ranks' gradients
    assert not torch.equal(plain, plain.bfloat16().float())


# --------------------------------------------------------------------------- exercises


def accepts(check, fn, capsys) -> None:
    """``check`` passes ``fn`` and says so in one line."""
    assert check(fn)
    out = capsys.readouterr().out
    assert out.startswith("Correct: ") and out.count("\n") == 1
    return out


def says_not_attempted(check, name, capsys) -> None:
    assert not check(stub(name))
    assert capsys.readouterr().out.startswith(f"Not attempted yet: write {name}()")


def test_check_untied_gpt_params(capsys):
    check = lab02_units.check_untied_gpt_params
    out = accepts(check, solution(LAB, "untied_gpt_params"), capsys)
    assert "12" not in out and "d²" not in out  # no formula in the verdict
    says_not_attempted(check, "untied_gpt_params", capsys)
    with pytest.raises(AssertionError, match="GPT-2's count"):
        check(gpt_params)
    with pytest.raises(AssertionError, match="second V x d"):
        check(lambda V, P, d, L: V * d + P * d + L * (12 * d * d + 2 * d) + d)
    with pytest.raises(AssertionError, match="no Linear or LayerNorm has a bias"):  # kept biases
        check(lambda V, P, d, L: 2 * V * d + P * d + L * (12 * d * d + 13 * d) + 2 * d)


def test_check_safe_loss_scale(capsys):
    check = lab02_units.check_safe_loss_scale
    out = accepts(check, solution(LAB, "safe_loss_scale"), capsys)
    assert "65504" not in out and "log2" not in out
    says_not_attempted(check, "safe_loss_scale", capsys)
    fp16_max = 65504.0
    with pytest.raises(AssertionError, match="a larger one is too"):
        check(lambda g: 2.0**16)
    with pytest.raises(AssertionError, match="power of two"):
        check(lambda g: fp16_max / g.abs().max().item())
    with pytest.raises(AssertionError, match="above 65504"):  # rounds up, not down
        check(lambda g: 2.0 ** math.ceil(math.log2(fp16_max / g.abs().max().item())))


def test_check_decode(capsys):
    check = lab02_units.check_decode
    out = accepts(check, solution(LAB, "decode"), capsys)
    assert "bias" not in out and "2^" not in out
    says_not_attempted(check, "decode", capsys)

    def no_subnormals(pattern, e_bits, m_bits):
        s, e, m = pattern.split()
        bias = 2 ** (e_bits - 1) - 1
        value = (1 + int(m, 2) / 2**m_bits) * 2.0 ** (int(e, 2) - bias)
        return (-1) ** int(s) * value

    with pytest.raises(AssertionError, match="all-zeros exponent holds the subnormals"):
        check(no_subnormals)

    def bias_off_by_one(pattern, e_bits, m_bits):
        s, e, m = pattern.split()
        bias = 2 ** (e_bits - 1)
        exponent = max(int(e, 2), 1) - bias
        lead = 0 if int(e, 2) == 0 else 1
        return (-1) ** int(s) * (lead + int(m, 2) / 2**m_bits) * 2.0**exponent

    with pytest.raises(AssertionError, match="stored value is"):
        check(bias_off_by_one)

    def unsigned(pattern, e_bits, m_bits):
        return abs(solution(LAB, "decode")(pattern, e_bits, m_bits))

    with pytest.raises(AssertionError, match="got 1.5"):
        check(unsigned)
