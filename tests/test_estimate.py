"""labsupport.estimate: the calculators against published numbers, against numbers worked
out by hand, and where a model or a tensor can say the same, against PyTorch.

Nothing here starts a process or times anything: a calculator gives the same answer on
every machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labsupport.comm.cost import all_reduce_time
from labsupport.estimate import (
    datasheets,
    dtypes,
    flops,
    memory,
    params,
    roofline,
    units,
    walls,
)
from labsupport.measure.memory import count_parameters, storage_bytes
from labsupport.models import GPT, MLP, GPTConfig, SmallCNN

# --------------------------------------------------------------------------- flops


def test_six_n_d_matches_the_published_totals():
    # GPT-3 table D.1: 3.14e23 FLOPs for 174.6 billion parameters and 300 billion tokens
    assert f"{flops.training_flops(174.6e9, 300e9):.2e}" == "3.14e+23"
    # Llama 3: 405B parameters, 15.6T tokens, "3.8 x 10^25 FLOPs"
    assert f"{flops.training_flops(405e9, 15.6e12):.1e}" == "3.8e+25"
    reported = [spec for spec in datasheets.MODELS.values() if "reported_flops" in spec]
    assert len(reported) == 2
    for spec in reported:
        ratio = flops.training_flops(spec["params"], spec["tokens"]) / spec["reported_flops"]
        assert 0.99 < ratio < 1.01


def test_training_days():
    # 6ND on 1,024 A100s at 40%: GPT-3 in about 28.5 days
    days = flops.training_days(flops.training_flops(175e9, 300e9), 1024, 312e12, 0.4)
    assert days == pytest.approx(3.15e23 / (1024 * 312e12 * 0.4) / 86400)
    assert 28 < days < 29
    assert flops.training_days(86400e12, 1, 1e12, 1.0) == pytest.approx(1.0)
    assert flops.SECONDS_PER_DAY == 24 * 60 * 60


def test_transformer_flops_is_narayanans_formula():
    b, s, layers, h, v = 8, 2048, 96, 12288, 51200
    exact = flops.transformer_training_flops(b * s, layers, h, s, v)
    assert exact == pytest.approx(
        72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    )
    full = flops.transformer_training_flops(b * s, layers, h, s, v, "full")
    assert full == pytest.approx(
        96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    )
    # selective recomputation reruns only the two attention products: 2·2·s·h per token
    selective = flops.transformer_training_flops(b * s, layers, h, s, v, "selective")
    assert selective - exact == b * s * layers * 4 * s * h
    with pytest.raises(ValueError):
        flops.transformer_training_flops(1, 1, 1, 1, 1, "partial")


# --------------------------------------------------------------------------- memory


def test_training_memory_is_the_zero_papers_16_bytes():
    parts = memory.training_memory(7.5e9)
    assert sum(parts.values()) == pytest.approx(120e9)  # ZeRO, figure 1: 7.5B -> 120 GB
    assert sum(memory.training_memory(1.5e9).values()) == pytest.approx(24e9)  # GPT-2 1.5B
    assert parts["weights"] == parts["gradients"] == pytest.approx(15e9)
    assert parts["master weights"] + parts["momentum"] + parts["variance"] == pytest.approx(90e9)
    fp32 = memory.training_memory(10, "fp32")
    assert fp32 == {"weights": 40, "gradients": 40, "master weights": 0, "momentum": 40,
                    "variance": 40}  # fmt: skip
    with pytest.raises(ValueError):
        memory.training_memory(10, "int8")


def test_activation_formula_reproduces_the_papers_coefficients():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    per_layer = memory.activation_memory(s, b, h, a, 1)
    assert per_layer == pytest.approx(sbh * (34 + 5 * a * s / h))
    tp = memory.activation_memory(s, b, h, a, 1, tensor_parallel=t)
    assert tp == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = memory.activation_memory(s, b, h, a, 1, tensor_parallel=t, sequence_parallel=True)
    assert sp == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert memory.activation_memory(s, b, h, a, 1, "selective") == pytest.approx(34 * sbh)
    assert memory.activation_memory(s, b, h, a, 1, "selective", tensor_parallel=t) == pytest.approx(
        sbh * (10 + 24 / t)
    )
    assert memory.activation_memory(s, b, h, a, 1, "full") == 2 * sbh
    assert memory.activation_memory(s, b, h, a, 1, "full", tensor_parallel=t) == 2 * sbh
    full_sp = memory.activation_memory(
        s, b, h, a, 1, "full", tensor_parallel=t, sequence_parallel=True
    )
    assert full_sp == pytest.approx(2 * sbh / t)
    assert memory.activation_memory(s, b, h, a, 96) == pytest.approx(96 * per_layer)
    with pytest.raises(ValueError):
        memory.activation_memory(s, b, h, a, 1, "some")


def test_checkpoint_formulas_known_values():
    # 9 units of b*d fp32 per block: 12 layers, b=2, d=8 -> 9*12*16*4 bytes
    assert memory.checkpoint_saved_bytes(12, 2, 8) == 6912
    assert memory.checkpoint_saved_bytes(12, 2, 8, segment=4) == 3 * 16 * 4
    assert memory.checkpoint_saved_bytes(10, 1, 1, segment=3) == 4 * 4  # ceil(10/3) inputs
    assert memory.checkpoint_saved_bytes(12, 2, 8, itemsize=2) == 6912 // 2
    # the peak: kept segment inputs plus one segment recomputed, (L/c + 9 c) units
    assert memory.checkpoint_peak_bytes(12, 2, 8) == memory.checkpoint_saved_bytes(12, 2, 8)
    assert memory.checkpoint_peak_bytes(36, 1, 1, segment=2) == (18 + 18) * 4
    # smallest at c = sqrt(L / 9): for 36 layers, segments of 2
    peaks = {c: memory.checkpoint_peak_bytes(36, 1, 1, c) for c in range(1, 37)}
    assert min(peaks, key=peaks.get) == 2


# --------------------------------------------------------------------------- walls


def test_step_times_and_the_crossover():
    t = walls.step_times(175e9, 3.2e6, 1024, 312e12, 50e9, mfu=0.4, alpha=0.0)
    assert t["compute"] == pytest.approx(6 * 175e9 * 3.2e6 / (1024 * 312e12 * 0.4))
    assert t["communication"] == pytest.approx(2 * 1023 / 1024 * 350e9 / 50e9)
    sharded = walls.step_times(175e9, 3.2e6, 1024, 312e12, 50e9, alpha=0.0, sharded=True)
    assert sharded["communication"] == pytest.approx(1.5 * t["communication"])
    g = walls.crossover_devices(3.2e6, 312e12 * 0.4, 50e9)
    at = walls.step_times(7e9, 3.2e6, g, 312e12, 50e9, mfu=0.4, alpha=0.0)
    assert at["compute"] == pytest.approx(at["communication"])
    before = walls.step_times(7e9, 3.2e6, g / 2, 312e12, 50e9, mfu=0.4, alpha=0.0)
    assert before["compute"] > before["communication"]
    with_alpha = walls.step_times(7e9, 3.2e6, 64, 312e12, 50e9, alpha=1e-3)
    no_alpha = walls.step_times(7e9, 3.2e6, 64, 312e12, 50e9, alpha=0.0)
    assert with_alpha["communication"] - no_alpha["communication"] == pytest.approx(2 * 63e-3)
    assert all_reduce_time("ring", 64, 14e9, 0.0, 1 / 50e9) == pytest.approx(
        no_alpha["communication"]
    )


def test_llama3_batches_are_the_paper_s_first_and_final():
    # Llama 3 paper, section 3.4.1: "an initial batch size of 4M tokens and sequences of
    # length 4,096", doubled twice, "to 16M after pre-training on 2.87T tokens"
    assert walls.BATCH_TOKENS == 1024 * 4096 == 4 * 2**20
    final = datasheets.MODELS["Llama 3 405B"]["batch_tokens"]
    assert final == 4 * walls.BATCH_TOKENS
    # table 4, on 16,384 GPUs: 128 data-parallel groups of 16 sequences of 8,192 tokens
    assert final == 128 * 16 * 8192


def test_which_wall_binds():
    assert walls.walls(405e9, 15.6e12, 16384, 50e9)["binds"] == "memory"
    assert walls.walls(405e9, 15.6e12, 16384, 50e9, sharded=True)["binds"] == "communication"
    assert walls.walls(7e9, 2e12, 512, 50e9, sharded=True)["binds"] == "compute"
    # beyond the sharded crossover, 1 + B·bw/F = 531 GPUs for the first batch, whatever
    # the model; the final batch, four times larger, moves it to 2,121
    assert walls.walls(70e9, 15e12, 2048, 50e9, sharded=True)["binds"] == "communication"
    final = datasheets.MODELS["Llama 3 405B"]["batch_tokens"]
    w = walls.walls(70e9, 15e12, 2048, 50e9, sharded=True, batch_tokens=final)
    assert w["binds"] == "compute"
    w = walls.walls(1e9, 1e12, 8, 450e9)
    assert w["binds"] == "compute"  # 16 GB fits in an H100's 80 GB
    assert w["device_memory"] == 80e9 and w["state_bytes_per_device"] == 16e9
    assert w["compute_days"] == pytest.approx(6e21 / (8 * 989e12 * 0.4) / 86400)
    # a GPU with more memory: the same 5B model's 80 GB of states fit an H200, not an H100
    assert walls.walls(5.5e9, 1e12, 8, 450e9)["binds"] == "memory"
    assert walls.walls(5.5e9, 1e12, 8, 450e9, gpu="H200 SXM")["binds"] == "compute"


def test_describe_walls_says_which_binds_in_words():
    text = walls.describe_walls(405e9, 15.6e12, 16384, 50e9)
    assert "16,384 x H100 SXM at 40% MFU" in text
    assert "6,480.0 GB of model states per GPU (does not fit in 80 GB)" in text
    assert "the memory wall binds" in text
    text = walls.describe_walls(405e9, 15.6e12, 16384, 50e9, sharded=True, gpu="A100 SXM 80GB")
    assert "x A100 SXM 80GB" in text and "ZeRO-3 / FSDP" in text


# --------------------------------------------------------------------------- roofline


def test_copy_and_add_move_the_bytes_their_tensors_hold():
    numel = 1000
    a, b = torch.ones(numel), torch.ones(numel)
    c = a + b
    tensor_bytes = [t.untyped_storage().nbytes() for t in (a, b, c)]
    assert roofline.kernel_cost("copy", numel=numel) == {"flops": 0, "bytes": 2 * tensor_bytes[0]}
    assert roofline.kernel_cost("add", numel=numel) == {"flops": numel, "bytes": sum(tensor_bytes)}
    assert roofline.arithmetic_intensity("add", numel=numel) == pytest.approx(1 / 12)
    assert roofline.arithmetic_intensity("add", numel=numel, itemsize=2) == pytest.approx(1 / 6)
    assert roofline.arithmetic_intensity("copy", numel=numel) == 0


@pytest.mark.parametrize(("m", "k", "n"), [(64, 64, 64), (3, 5, 7), (128, 512, 32)])
def test_matmul_flops_match_pytorchs_flop_counter(m, k, n):
    a, b = torch.randn(m, k), torch.randn(k, n)
    with FlopCounterMode(display=False) as counter:
        c = a @ b
    cost = roofline.kernel_cost("matmul", m=m, k=k, n=n)
    assert cost["flops"] == counter.get_total_flops() == 2 * m * n * k
    assert cost["bytes"] == sum(t.untyped_storage().nbytes() for t in (a, b, c))


def test_square_matmul_intensity_is_n_over_6_in_fp32_and_n_over_3_in_bf16():
    for n in (64, 1024, 8192):
        assert roofline.arithmetic_intensity("matmul", m=n, k=n, n=n) == pytest.approx(n / 6)
        assert roofline.arithmetic_intensity("matmul", m=n, k=n, n=n, itemsize=2) == (
            pytest.approx(n / 3)
        )


def test_unknown_kernel_is_refused_clearly():
    with pytest.raises(ValueError, match="unknown kernel"):
        roofline.kernel_cost("conv", numel=4)


def test_roofline_is_the_lower_of_the_two_roofs():
    peak, bw = 100.0, 10.0  # ridge at 10 FLOP/byte
    assert roofline.ridge_point(peak, bw) == 10
    assert roofline.roofline(peak, bw, 1) == 10
    assert roofline.roofline(peak, bw, 10) == 100
    assert roofline.roofline(peak, bw, 1000) == 100
    got = roofline.roofline(peak, bw, np.array([0.0, 5.0, 20.0]))
    np.testing.assert_array_equal(got, [0.0, 50.0, 100.0])


def test_h100_ridge_point_worked_number():
    h100 = datasheets.device_spec("H100 SXM")
    # 989e12 / 3.35e12 = 295.2 FLOP/byte (BF16 dense), 67e12 / 3.35e12 = 20 (FP32)
    assert roofline.ridge_point(h100["tensor"], h100["bandwidth"]) == pytest.approx(
        295.22, abs=0.01
    )
    assert roofline.ridge_point(h100["fp32"], h100["bandwidth"]) == pytest.approx(20.0)


def test_predicted_seconds_takes_the_longer_of_compute_and_memory():
    assert roofline.predicted_seconds(1e12, 1e9, 1e12, 1e11) == 1.0  # compute-bound
    assert roofline.predicted_seconds(1e9, 1e12, 1e12, 1e11) == 10.0  # memory-bound
    add = roofline.kernel_cost("add", numel=2**28)
    h100 = datasheets.device_spec("H100 SXM")
    # 3 GiB through 3.35 TB/s: 0.96 ms; its 2^28 FLOPs would take 4 µs at 67 TFLOP/s
    assert roofline.predicted_seconds(
        add["flops"], add["bytes"], h100["fp32"], h100["bandwidth"]
    ) == pytest.approx(3 * 2**30 / 3.35e12)


# --------------------------------------------------------------------------- params


# GPT-2 small, medium, large and XL: width, layers, and the parameter count of the
# released checkpoints (test_models builds each on the meta device and counts the same)
GPT2_RELEASED = [
    (768, 12, 124_439_808),
    (1024, 24, 354_823_168),
    (1280, 36, 774_030_080),
    (1600, 48, 1_557_611_200),
]


def test_gpt_params_formula_gives_the_released_gpt2_counts():
    for n_embd, n_layer, released in GPT2_RELEASED:
        args = (50257, 1024, n_embd, n_layer)
        assert params.gpt_params(*args) == released
        rows = params.gpt_breakdown(*args)
        assert sum(int(row["parameters"].replace(",", "")) for row in rows) == released
    shares = [float(r["share"].rstrip("%")) for r in params.gpt_breakdown(50257, 1024, 768, 12)]
    assert sum(shares) == pytest.approx(100, abs=0.3)  # each rounded to 0.1%


@pytest.mark.parametrize(
    "fields",
    [
        {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64},
        {"vocab_size": 100, "block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 32},
    ],
)
def test_gpt_params_formula_counts_the_model(fields):
    with torch.device("meta"):
        model = GPT(GPTConfig(**fields))
    args = (fields["vocab_size"], fields["block_size"], fields["n_embd"], fields["n_layer"])
    assert params.gpt_params(*args) == count_parameters(model)


@pytest.mark.parametrize("sizes", [[784, 256, 256, 10], [3, 1], [100, 7, 100]])
def test_mlp_formula(sizes):
    assert count_parameters(MLP(sizes)) == params.mlp_params(sizes)


def test_mlp_formula_known_value():
    # 784*256+256 + 256*256+256 + 256*10+10, worked out by hand
    assert params.mlp_params([784, 256, 256, 10]) == 200_960 + 65_792 + 2_570


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"in_channels": 3, "channels": (8, 16), "kernel": 3, "image_size": 32, "classes": 100}],
)
def test_cnn_formula(kwargs):
    assert count_parameters(SmallCNN(**kwargs)) == params.cnn_params(**kwargs)


def test_cnn_formula_known_value():
    # conv1 16*1*25+16 = 416, conv2 32*16*25+32 = 12,832, fc 32*7*7*10+10 = 15,690
    assert params.cnn_params() == 416 + 12_832 + 15_690


# --------------------------------------------------------------------------- dtypes


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
    assert dtypes.to_dtype(name) is dtype
    assert dtypes.dtype_bytes(name) == size
    assert dtypes.dtype_bytes(dtype) == size
    assert torch.empty(3, dtype=dtype).untyped_storage().nbytes() == 3 * size


def test_dtype_bytes_rejects_unknown_names_clearly():
    with pytest.raises(ValueError, match="unknown dtype name 'fp12'.*bf16"):
        dtypes.dtype_bytes("fp12")
    with pytest.raises(TypeError, match="torch.dtype"):
        dtypes.dtype_bytes(16)


def test_param_bytes_matches_storage_for_every_dtype():
    model = MLP([50, 30, 7])
    n = count_parameters(model)
    for name in ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"):
        tensors = [p.detach().to(dtypes.to_dtype(name)) for p in model.parameters()]
        assert storage_bytes(tensors) == dtypes.param_bytes(n, name)
    assert dtypes.param_bytes(110_000_000, "fp32") == 440_000_000
    with pytest.raises(ValueError, match="non-negative"):
        dtypes.param_bytes(-1, "fp32")


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
    f = dtypes.FORMATS[name]
    dtype = getattr(torch, f.dtype)
    known, info = KNOWN[name], torch.finfo(dtype)
    assert f.max == known["max"] == info.max
    assert f.eps == known["eps"] == info.eps
    assert f.unit_roundoff == known["eps"] / 2 == info.eps / 2
    assert f.smallest_normal == known["tiny"] == info.smallest_normal
    assert f.bits == info.bits
    sub = torch.tensor(f.smallest_subnormal, dtype=torch.float64).to(dtype)
    assert float(sub) == f.smallest_subnormal
    half = torch.tensor(f.smallest_subnormal / 2, dtype=torch.float64).to(dtype)
    assert float(half) == 0.0  # ties to even: half the smallest subnormal rounds to 0


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_unit_roundoff_bounds_the_error_of_one_rounding(name):
    f = dtypes.FORMATS[name]
    generator = torch.Generator().manual_seed(0)
    x = 1 + torch.rand(10_000, dtype=torch.float64, generator=generator)  # normal numbers
    relative = ((x.to(getattr(torch, f.dtype)).double() - x) / x).abs()
    # the bound holds and is reached: the worst of 10,000 roundings comes within 10% of it
    assert 0.9 * f.unit_roundoff < relative.max().item() <= f.unit_roundoff


def test_tf32_layout():
    f = dtypes.FORMATS["tf32"]
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
    assert dtypes.bits(value, dtype) == pattern


def test_bits_rejects_integer_dtypes():
    with pytest.raises(ValueError, match="floating-point"):
        dtypes.bits(1, "int8")


def test_rounding_facts_the_chapter_states():
    assert torch.tensor(70000.0).half().isinf()
    assert torch.tensor(1e-8).half() == 0
    assert torch.tensor(1e-8 * 2**16).half() != 0
    assert torch.tensor(1 + 2**-8).bfloat16() == 1
    assert torch.tensor(256.0).bfloat16() + 1 == 256
    assert torch.tensor(1 + 2**-7).bfloat16() != 1


# --------------------------------------------------------------------------- units


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
    assert units.format_bytes(n, standard) == text


def test_format_bytes_auto_writes_sizes_as_datasheets_and_buffers_do():
    cases = {4: "4 B", 1024: "1 KiB", 2**20: "1 MiB", 25 * 2**20: "25 MiB", 10**9: "1 GB",
             350 * 10**9: "350 GB", 128_000: "128 kB", 999: "999 B"}  # fmt: skip
    assert {n: units.format_bytes(n, "auto") for n in cases} == cases


def test_format_bytes_rejects_unknown_standard():
    with pytest.raises(ValueError, match="'iec', 'si' or 'auto'"):
        units.format_bytes(1, "jedec")


def test_format_count():
    assert units.format_count(124_439_808) == "124.4M = 1.24亿 = 0.124B"
    assert units.format_count(175e9) == "175,000.0M = 1,750.00亿 = 175.000B"


def test_units_name_decimal_and_binary_prefixes_apart():
    assert (units.KB, units.MB, units.GB, units.TB) == (1e3, 1e6, 1e9, 1e12)
    assert (units.KiB, units.MiB, units.GiB) == (2**10, 2**20, 2**30)
    assert units.GiB / units.GB == pytest.approx(1.0737, abs=1e-4)  # "7.4 % more"


# --------------------------------------------------------------------------- datasheets


@pytest.mark.parametrize(
    ("name", "memory_gb", "gb_s", "fp32_tflops", "tensor_tflops"),
    [
        ("V100 SXM2", 32, 900, 15.7, 125),
        ("A100 SXM 80GB", 80, 2039, 19.5, 312),  # 624 with sparsity
        ("H100 SXM", 80, 3350, 67, 989),  # 1,979 with sparsity
        ("H200 SXM", 141, 4800, 67, 989),
        ("RTX 4090", 24, 1008, 82.6, 165.2),
    ],
)
def test_device_entries_hold_the_published_dense_numbers(
    name, memory_gb, gb_s, fp32_tflops, tensor_tflops
):
    entry = datasheets.device_spec(name)
    assert entry["name"] == name and entry["kind"] == "GPU"
    assert entry["memory_bytes"] == pytest.approx(memory_gb * 1e9)
    assert entry["bandwidth"] == pytest.approx(gb_s * 1e9)
    assert entry["fp32"] == pytest.approx(fp32_tflops * 1e12)
    assert entry["tensor"] == pytest.approx(tensor_tflops * 1e12)
    assert entry["source"].startswith("https://")


def test_laptop_cpu_peaks_are_computed_from_its_specifications():
    peak, bandwidth = datasheets.laptop_cpu_peaks()
    assert peak == pytest.approx(8 * 3.3e9 * 32)  # 844.8 GFLOP/s
    assert bandwidth == pytest.approx(89.6e9)  # 2 channels x 8 bytes x 5600 MT/s
    cpu = datasheets.device_spec("Ryzen 7 7840U (laptop CPU)")
    assert cpu["fp32"] == pytest.approx(844.8e9) and cpu["bandwidth"] == pytest.approx(89.6e9)
    assert cpu["kind"] == "CPU" and cpu["tensor"] is None
    with pytest.raises(KeyError, match="known"):
        datasheets.device_spec("H100")


def test_datasheet_units_convert_to_bytes_per_second_per_direction():
    assert datasheets.per_direction(400, "Gb/s") == 50e9
    assert datasheets.per_direction(900, "GB/s bidirectional") == 450e9
    assert datasheets.per_direction(50, "GB/s") == 50e9
    with pytest.raises(ValueError, match="unknown unit"):
        datasheets.per_direction(400, "Gbps")
    assert datasheets.pcie_x16(8, 128, 130) == pytest.approx(15.754, abs=5e-4)


@pytest.mark.parametrize(
    ("name", "gb_per_s"),
    [
        ("PCIe 3.0 x16", 15.754),  # 16 x 8 GT/s x 128/130 / 8
        ("PCIe 4.0 x16", 31.508),
        ("PCIe 5.0 x16", 63.015),
        ("PCIe 6.0 x16", 128.0),  # raw 64 GT/s
        ("NVLink 2 (V100)", 150.0),  # 300 GB/s bidirectional
        ("NVLink 3 (A100)", 300.0),
        ("NVLink 4 (H100)", 450.0),
        ("NVLink 5 (B200)", 900.0),
        ("InfiniBand EDR", 12.5),  # 100 Gb/s
        ("InfiniBand HDR", 25.0),
        ("InfiniBand NDR", 50.0),
        ("InfiniBand XDR", 100.0),
        ("RoCE 400 GbE", 50.0),
    ],
)
def test_links_hold_per_direction_bandwidth(name, gb_per_s):
    assert datasheets.link(name)["gb_per_s"] == pytest.approx(gb_per_s, abs=5e-4)
    assert datasheets.beta(name) == pytest.approx(1 / (gb_per_s * 1e9), rel=1e-4)


def test_every_link_cites_its_source_and_invents_no_latency():
    assert len(datasheets.LINKS) == 13
    for name, entry in datasheets.LINKS.items():
        assert entry["name"] == name
        assert entry["source"].startswith("https://"), name
        assert entry["latency_s"] is None, name
        assert entry["datasheet"], name
    with pytest.raises(KeyError, match="known links"):
        datasheets.link("NVLink 9")


def test_every_device_and_hierarchy_level_is_complete():
    for name, entry in datasheets.DEVICES.items():
        assert entry["name"] == name and entry["source"].startswith("https://"), name
        assert entry["memory_bytes"] > 0 and entry["bandwidth"] > 0 and entry["fp32"] > 0
        assert (entry["tensor"] is None) == (entry["tensor_precision"] is None), name
    for device, levels in datasheets.HIERARCHY.items():
        sizes = [size for _, size, _ in levels]
        assert sizes == sorted(sizes), f"{device}: each level down is at least as large"
    assert datasheets.ASSUMED_ALPHA == 5e-6 and datasheets.ASSUMED_MFU == 0.40


# --------------------------------------------------------------------------- tensor parallel


def test_layer_costs_keep_tensor_parallelism_inside_a_server():
    from labsupport.estimate.tensor_parallel import layer_costs

    rows = {r["t"]: r for r in layer_costs()}
    assert rows[8]["compute"] == pytest.approx(rows[2]["compute"] / 4)
    assert rows[8]["NVLink 4 (H100)"] < 0.2 * rows[8]["compute"] < rows[8]["InfiniBand NDR"]
    # one GPT-3 layer and sequence: 72·s·h²·(1 + s/6h) FLOPs at 40% of 989 TFLOP/s
    s, h = 2048, 12288
    want = 72 * s * h * h * (1 + s / (6 * h)) / (0.4 * 989e12)
    assert rows[2]["compute"] * 2 == pytest.approx(want)
