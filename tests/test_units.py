"""labsupport.units and labsupport.models: counts against published parameter counts,
bytes against storage, format properties against torch.finfo and IEEE 754 values worked
out by hand, the all-reduce in several dtypes on real ranks, and the exercises' checkers."""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch

from labsupport import launch
from labsupport import units as U
from labsupport.models import (
    GPT,
    GPT2_LARGE,
    GPT2_MEDIUM,
    GPT2_SMALL,
    GPT2_XL,
    MLP,
    GPTConfig,
    SmallCNN,
    tiny_gpt,
)

matplotlib.use("Agg")

# --------------------------------------------------------------------------- counting

# Parameter counts of the released GPT-2 checkpoints (tied embeddings), as counted from
# their weights; the GPT-2 paper's Table 2 rounds them differently (117M, 345M, ...).
GPT2_PUBLISHED = [
    (GPT2_SMALL, 124_439_808),
    (GPT2_MEDIUM, 354_823_168),
    (GPT2_LARGE, 774_030_080),
    (GPT2_XL, 1_557_611_200),
]


@pytest.mark.parametrize(("config", "published"), GPT2_PUBLISHED)
def test_gpt2_models_and_formula_match_published_counts(config, published):
    with torch.device("meta"):
        model = GPT(config)
    assert U.count_parameters(model) == published
    args = (config.vocab_size, config.block_size, config.n_embd, config.n_layer)
    assert U.gpt2_params(*args) == published
    total = sum(int(row["parameters"].replace(",", "")) for row in U.gpt2_breakdown(*args))
    assert total == published


def test_tied_weight_is_counted_and_stored_once():
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    untied = tiny_gpt(tie_weights=False)
    extra = model.config.vocab_size * model.config.n_embd
    assert U.count_parameters(untied) == U.count_parameters(model) + extra
    assert U.storage_bytes(model) == 4 * U.count_parameters(model)
    assert U.storage_bytes(untied) == 4 * U.count_parameters(untied)
    naive = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert naive == U.count_parameters(model) + extra  # what a careless count would say


def test_count_parameters_trainable_only():
    model = MLP([10, 5, 2])
    model[0].weight.requires_grad_(False)
    assert U.count_parameters(model) == 10 * 5 + 5 + 5 * 2 + 2
    assert U.count_parameters(model, trainable_only=True) == 5 + 5 * 2 + 2


@pytest.mark.parametrize("sizes", [[784, 256, 256, 10], [3, 1], [100, 7, 100]])
def test_mlp_formula(sizes):
    assert U.count_parameters(MLP(sizes)) == U.mlp_params(sizes)


def test_mlp_formula_known_value():
    # 784*256+256 + 256*256+256 + 256*10+10, worked out by hand
    assert U.mlp_params([784, 256, 256, 10]) == 200_960 + 65_792 + 2_570


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"in_channels": 3, "channels": (8, 16), "kernel": 3, "image_size": 32, "classes": 100}],
)
def test_cnn_formula(kwargs):
    model = SmallCNN(**kwargs)
    assert U.count_parameters(model) == U.cnn_params(**kwargs)
    side = kwargs.get("image_size", 28)
    out = model(torch.zeros(2, kwargs.get("in_channels", 1), side, side))
    assert out.shape == (2, kwargs.get("classes", 10))


def test_cnn_formula_known_value():
    # conv1 16*1*25+16 = 416, conv2 32*16*25+32 = 12,832, fc 32*7*7*10+10 = 15,690
    assert U.cnn_params() == 416 + 12_832 + 15_690


def test_tiny_gpt_runs_and_shapes():
    model = tiny_gpt()
    tokens = torch.randint(0, 256, (2, 65))
    logits, loss = model(tokens[:, :-1], tokens[:, 1:])
    assert logits.shape == (2, 64, 256)
    assert math.isclose(loss.item(), math.log(256), rel_tol=0.05)  # near-uniform at init


def test_format_count():
    assert U.format_count(124_439_808) == "124.4M = 1.24亿 = 0.124B"
    assert U.format_count(175e9) == "175,000.0M = 1,750.00亿 = 175.000B"


# --------------------------------------------------------------------------- bytes


@pytest.mark.parametrize(
    ("name", "dtype", "size"),
    [
        ("fp32", torch.float32, 4),
        ("float32", torch.float32, 4),
        ("tf32", torch.float32, 4),
        ("FP16", torch.float16, 2),
        ("half", torch.float16, 2),
        ("bf16", torch.bfloat16, 2),
        ("torch.bfloat16", torch.bfloat16, 2),
        ("fp8_e4m3", torch.float8_e4m3fn, 1),
        ("float8_e4m3fn", torch.float8_e4m3fn, 1),
        ("fp8_e5m2", torch.float8_e5m2, 1),
        ("int8", torch.int8, 1),
        ("fp64", torch.float64, 8),
    ],
)
def test_dtype_bytes_names_and_dtypes(name, dtype, size):
    assert U.to_dtype(name) is dtype
    assert U.dtype_bytes(name) == size
    assert U.dtype_bytes(dtype) == size
    assert torch.empty(3, dtype=dtype).untyped_storage().nbytes() == 3 * size


def test_dtype_bytes_rejects_unknown_names_clearly():
    with pytest.raises(ValueError, match="unknown dtype name 'fp12'.*bf16"):
        U.dtype_bytes("fp12")
    with pytest.raises(TypeError, match="torch.dtype"):
        U.dtype_bytes(16)


def test_param_bytes_matches_storage_for_every_dtype():
    model = MLP([50, 30, 7])
    n = U.count_parameters(model)
    for name in ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"):
        tensors = [p.detach().to(U.to_dtype(name)) for p in model.parameters()]
        assert U.storage_bytes(tensors) == U.param_bytes(n, name)
    assert U.param_bytes(110_000_000, "fp32") == 440_000_000
    with pytest.raises(ValueError, match="non-negative"):
        U.param_bytes(-1, "fp32")


def test_storage_bytes_counts_a_shared_storage_once():
    base = torch.zeros(100)
    assert U.storage_bytes([base, base[:10], base.view(10, 10)]) == 400
    assert U.storage_bytes([base, torch.zeros(100)]) == 800


@pytest.mark.parametrize(
    ("n", "standard", "text"),
    [
        (440_000_000, "iec", "419.6 MiB"),
        (440_000_000, "si", "440 MB"),
        (1024, "iec", "1 KiB"),
        (1000, "iec", "1000 B"),
        (1000, "si", "1 kB"),
        (999, "si", "999 B"),
        (1536, "iec", "1.5 KiB"),
        (2**30, "iec", "1 GiB"),
        (2**30, "si", "1.1 GB"),
        (1023.99 * 1024, "iec", "1.0 MiB"),  # rounds up into the next unit
        (350e9, "si", "350 GB"),
        (350e9, "iec", "326.0 GiB"),
        (-2048, "iec", "-2 KiB"),
        (0, "si", "0 B"),
        (2**70, "iec", "1024 EiB"),
    ],
)
def test_format_bytes(n, standard, text):
    assert U.format_bytes(n, standard) == text


def test_format_bytes_rejects_unknown_standard():
    with pytest.raises(ValueError, match="'iec' or 'si'"):
        U.format_bytes(1, "jedec")


# --------------------------------------------------------------------------- formats

# IEEE 754 binary16/binary32 values, bfloat16 and the OCP FP8 values, by hand
KNOWN = {
    "fp32": {"max": (2 - 2**-23) * 2.0**127, "eps": 2**-23, "tiny": 2**-126},
    "fp16": {"max": 65504.0, "eps": 2**-10, "tiny": 2**-14},
    "bf16": {"max": (2 - 2**-7) * 2.0**127, "eps": 2**-7, "tiny": 2**-126},
    "fp8 e4m3": {"max": 448.0, "eps": 2**-3, "tiny": 2**-6},
    "fp8 e5m2": {"max": 57344.0, "eps": 2**-2, "tiny": 2**-14},
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_formats_against_known_values_and_finfo(name):
    f = U.FORMATS[name]
    dtype = getattr(torch, f.dtype)
    known, info = KNOWN[name], torch.finfo(dtype)
    assert f.max == known["max"] == info.max
    assert f.eps == known["eps"] == info.eps
    assert f.smallest_normal == known["tiny"] == info.smallest_normal
    assert f.bits == info.bits
    sub = torch.tensor(f.smallest_subnormal, dtype=torch.float64).to(dtype)
    assert float(sub) == f.smallest_subnormal
    half = torch.tensor(f.smallest_subnormal / 2, dtype=torch.float64).to(dtype)
    assert float(half) == 0.0  # ties to even: half the smallest subnormal rounds to 0


def test_tf32_layout():
    f = U.FORMATS["tf32"]
    assert (f.bits, f.exponent, f.mantissa, f.eps) == (19, 8, 10, 2**-10)
    assert f.dtype is None


@pytest.mark.parametrize(
    ("value", "dtype", "pattern"),
    [
        (1.0, "fp16", "0 01111 0000000000"),
        (-1.5, "fp16", "1 01111 1000000000"),
        (65504, "fp16", "0 11110 1111111111"),
        (2.0**-24, "fp16", "0 00000 0000000001"),
        (1.0, "bf16", "0 01111111 0000000"),
        (1.0, "fp32", "0 01111111 00000000000000000000000"),
        (0.1, "fp32", "0 01111011 10011001100110011001101"),
        (448.0, "fp8_e4m3", "0 1111 110"),
        (57344.0, "fp8_e5m2", "0 11110 11"),
        (-2.0, "fp8_e5m2", "1 10000 00"),
    ],
)
def test_bits(value, dtype, pattern):
    assert U.bits(value, dtype) == pattern


def test_bits_rejects_integer_dtypes():
    with pytest.raises(ValueError, match="floating-point"):
        U.bits(1, "int8")


def test_rounding_facts_the_chapter_states():
    assert torch.tensor(70000.0).half().isinf()
    assert torch.tensor(1e-8).half() == 0
    assert torch.tensor(1e-8 * 2**16).half() != 0
    assert torch.tensor(1 + 2**-8).bfloat16() == 1
    assert torch.tensor(256.0).bfloat16() + 1 == 256
    assert torch.tensor(1 + 2**-7).bfloat16() != 1


# --------------------------------------------------------------------------- mixed precision


def test_cast_report_counts_underflow_overflow_and_subnormals():
    values = torch.tensor([1e-9, 1e-6, 1.0, 1e5, 0.0])
    r = U.cast_report(values, "fp16")
    assert r["zero"] == 0.25  # 1e-9 of the four nonzero values
    assert r["inf"] == 0.25  # 1e5
    assert r["subnormal"] == 0.25  # 1e-6 < 2^-14
    scaled = U.cast_report(values, "fp16", scale=2.0**-4)
    assert scaled["inf"] == 0 and scaled["zero"] == 0.25
    assert U.cast_report(values, "bf16")["zero"] == 0


def test_loss_scaling_rescues_logit_gradients():
    grads = U.tiny_gpt_gradients(vocab_size=1024, batch=8)
    assert grads["tokens"] == 8 * 64
    rows = U.loss_scale_sweep(grads["logits"], "fp16", powers=[0, 16, 40])
    assert rows[0]["subnormal"] > 0.5  # entries about 1 / (V * tokens) ~ 2e-6
    assert rows[1]["subnormal"] == 0 and rows[1]["inf"] == 0
    assert rows[1]["median rel. error"] < rows[0]["median rel. error"] / 5
    assert rows[2]["inf"] > 0  # too large a scale overflows


def test_all_reduce_in_dtypes_on_real_ranks():
    world, numel = 3, 999
    results = launch(U.all_reduce_in_dtypes, world_size=world, kwargs={"numel": numel})
    assert [r["rank"] for r in results] == list(range(world))
    cases = {(c["dtype"], c["loss scale"]): c for c in results[0]["cases"]}
    for r in results[1:]:
        assert [c["checksum"] for c in r["cases"]] == [c["checksum"] for c in results[0]["cases"]]
    assert cases["fp32", 1.0]["relative error"] < 1e-6
    assert 1e-4 < cases["fp16", 1.0]["relative error"] < 2e-3
    assert 1e-3 < cases["bf16", 1.0]["relative error"] < 1e-2
    for (name, _), case in cases.items():
        assert case["bytes sent"] == U.ring_bytes_per_rank(numel, name, world)

    tiny = launch(U.all_reduce_in_dtypes, world_size=2, kwargs={"numel": 512, "scale": 1e-8})
    cases = {(c["dtype"], c["loss scale"]): c for c in tiny[0]["cases"]}
    assert cases["fp16", 1.0]["relative error"] > 0.5  # flushed to zero
    assert cases["fp16", 2.0**16]["relative error"] < 2e-3  # rescued by the scale
    assert cases["bf16", 1.0]["relative error"] < 1e-2


# --------------------------------------------------------------------------- figures


def test_figures_draw():
    for fig in (U.dtype_layouts(), U.range_and_precision()):
        assert fig.axes
        matplotlib.pyplot.close(fig)
    rows = U.loss_scale_sweep(torch.tensor([1e-7, 1e-3]), powers=[0, 4])
    fig = U.plot_loss_scaling(rows)
    assert len(fig.axes) == 2
    matplotlib.pyplot.close(fig)


# --------------------------------------------------------------------------- exercises


def test_check_untied_gpt_params():
    U.check_untied_gpt_params(lambda V, P, d, L: 2 * V * d + P * d + L * (12 * d * d + 2 * d) + d)
    with pytest.raises(AssertionError, match="GPT-2's formula"):
        U.check_untied_gpt_params(U.gpt2_params)
    with pytest.raises(AssertionError, match="second V x d"):
        U.check_untied_gpt_params(lambda V, P, d, L: V * d + P * d + L * (12 * d * d + 2 * d) + d)


def test_check_safe_loss_scale():
    fp16_max = 65504.0
    U.check_safe_loss_scale(lambda g: 2.0 ** math.floor(math.log2(fp16_max / g.abs().max().item())))
    with pytest.raises(AssertionError):
        U.check_safe_loss_scale(lambda g: 2.0**16)
    with pytest.raises(AssertionError, match="power of two"):
        U.check_safe_loss_scale(lambda g: fp16_max / g.abs().max().item())


def _decode(pattern, e_bits, m_bits):
    s, e, m = pattern.split()
    sign, exp, man = (-1) ** int(s), int(e, 2), int(m, 2)
    bias = 2 ** (e_bits - 1) - 1
    if exp == 0:
        return sign * man / 2**m_bits * 2.0 ** (1 - bias)
    return sign * (1 + man / 2**m_bits) * 2.0 ** (exp - bias)


def test_check_decode():
    U.check_decode(_decode)

    def no_subnormals(pattern, e_bits, m_bits):
        s, e, m = pattern.split()
        bias = 2 ** (e_bits - 1) - 1
        value = (1 + int(m, 2) / 2**m_bits) * 2.0 ** (int(e, 2) - bias)
        return (-1) ** int(s) * value

    with pytest.raises(AssertionError):
        U.check_decode(no_subnormals)


def test_default_config_is_gpt2_small():
    assert GPTConfig() == GPT2_SMALL
