"""The planner's model of a step, term by term against hand-computed values, and its fit:
one set of three parameters, fitted on four rows of Narayanan et al. 2021's table 1, the
errors on every other published run.

Nothing here starts a process: the planner gives the same answer on every machine.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from labsupport.estimate import calibration, planner
from labsupport.estimate.architecture import Transformer
from labsupport.estimate.compute import (
    FITTED,
    REPORTED_MEMORY,
    Efficiency,
    gemm_seconds,
    layer_gemms,
)
from labsupport.estimate.datasheets import device_spec
from labsupport.estimate.memory import activation_memory
from labsupport.estimate.moe import DEEPSEEK_V3, moe_params
from labsupport.estimate.published import MODELS
from labsupport.estimate.runs import PTDP_TABLE_1, TRAINING, runs

A100 = device_spec("A100 SXM 80GB")
LLAMA = MODELS["Llama 3 405B"]
SMALL = planner.Cluster("small", "A100 SXM 80GB", 8, 8, 100e9, 10e9, 1e-6)


# ------------------------------------------------------------------ the architecture


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (4, True), (8, True)])
def test_a_gpts_activations_are_korthikanti_et_al(recompute, tp, sp):
    gpt = Transformer("GPT-3", 96, 12288, 96, 2048, 51200)
    got = gpt.activation_bytes(recompute, tp, sp) * 2 * 2048  # two sequences
    want = activation_memory(
        2048, 2, 12288, 96, 1, recompute, tensor_parallel=tp, sequence_parallel=sp
    )
    assert got == pytest.approx(want, rel=1e-12)


def test_llama_3s_swiglu_and_gqa_hold_38_sbh():
    h, kv, f = 16384, 8 * 128, 53248
    # norms 4h; QKV input 2h, Q 2h, K and V 2·kv each, out-projection input 2h;
    # MLP input 2h, gate, up, SiLU(gate) and their product 2f each
    want = 4 * h + 2 * h + 2 * h + 4 * kv + 2 * h + 2 * h + 8 * f
    assert LLAMA.activation_bytes("selective") == want == 38.25 * h
    # tensor parallel 8 without sequence parallelism: norms, QKV and MLP inputs whole
    assert LLAMA.activation_bytes("selective", 8) == (2 * (2 * h + 2 * kv) + 8 * f) / 8 + 8 * h
    assert LLAMA.activation_bytes("selective", 8, True) == want / 8
    assert LLAMA.activation_bytes("full", 8, True) == 2 * h / 8


def test_llama_flops_per_token_by_hand():
    h, kv, f, s, layers, vocab = 16384, 1024, 53248, 8192, 126, 128256
    weights = 2 * h * h + 2 * h * kv + 3 * h * f
    attention = 2 * s * h + 2 * s * h  # Q·Kᵀ and scores·V, forward, per token
    want = layers * (6 * weights + 3 * attention) + 6 * h * vocab
    assert LLAMA.flops_per_token("none") == want
    assert LLAMA.flops_per_token("selective") == want + layers * attention


def test_deepseek_v3_total_and_active_parameters_are_the_moe_modules():
    found, want = MODELS["DeepSeek-V3"], moe_params(DEEPSEEK_V3)
    assert found.params() == want["total"]
    assert found.params(active=True) == want["active"]
    assert found.expert_params() == want["routed experts"]
    assert round(found.params() / 1e9) == 671


def test_an_moe_layers_activations_by_hand():
    m, h = MODELS["DeepSeek-V3"], 7168
    # norms 4h, QKV input 2h; Q, K of 128 heads of 192, V and the output of 128 heads of
    # 128; the MoE's input 2h and 8 routed copies of it, 8 bytes per width of each of
    # the 8 routed experts and the shared one
    qkvo = 2 * 128 * (192 + 192 + 128 + 128)
    want = 6 * h + qkvo + 2 * h * 9 + 8 * 2048 * 9
    assert m.activation_bytes("selective", moe=True) == want == 483328
    dense = 6 * h + qkvo + 2 * h + 8 * 18432  # a dense layer's SwiGLU of 18,432
    assert m.activation_bytes("selective") == dense


def test_an_moe_layers_gemms_share_the_tokens_among_the_experts():
    m = MODELS["DeepSeek-V3"]
    gemms = layer_gemms(m, 4096, tp=1, ep=64, moe=True)["linear"]
    # 4 of 256 experts on a GPU, each with 4096 tokens x 64 ranks x 8 / 256 = 8192 rows
    assert gemms[-2] == (8192, 7168, 2 * 2048, 4)
    assert gemms[-1] == (8192, 2048, 7168, 4)


# ------------------------------------------------------------------ the new terms


def test_a_gemm_is_the_roofline_at_the_fitted_share():
    eff = Efficiency(gemm=0.5, passes=0.0)
    square = gemm_seconds(4096, 4096, 4096, 312e12, 2039e9, eff)
    assert square == pytest.approx(2 * 4096**3 / (0.5 * 312e12))
    row = gemm_seconds(1, 4096, 4096, 312e12, 2039e9, eff)  # memory-bound: a vector
    assert row == pytest.approx(2 * (4096 + 4096 * 4096 + 4096) / 2039e9)
    batched = gemm_seconds(2048, 128, 2048, 312e12, 2039e9, eff, batch=12)
    assert batched == pytest.approx(12 * 2 * 2048 * 128 * 2048 / (0.5 * 312e12))


def test_context_parallel_all_gathers_by_hand():
    m = Transformer("cp", 4, 1024, 8, 4096, 1000, kv_heads=2, family="llama", tied=False)
    lay = planner.Layout(1, 1, 1, zero=0, cp=8, sequence_parallel=False)
    got = planner.step_time(m, SMALL, lay, 1)["context"]
    kv = 2 * 2 * (4096 // 8) * 128  # K and V of one rank: 2 heads of 128, 512 tokens
    sent = 7 * kv * 2 + 7 * kv * (2 + 2)  # all-gather forward; all-gather, reduce-scatter
    assert got == pytest.approx(4 * (sent / 100e9 + 3 * 7 * 1e-6))


def test_context_parallelism_divides_the_activations_by_cp():
    one = planner.memory(LLAMA, planner.Layout(128, 8, 16, zero=2), 2048)["activations"]
    model = replace(LLAMA, seq_len=16 * 8192)
    lay = planner.Layout(8, 8, 16, zero=2, cp=16)
    assert planner.memory(model, lay, 128)["activations"] == pytest.approx(one)


def test_expert_parallel_all_to_alls_by_hand_and_hidden_when_overlapped():
    m = Transformer(
        "moe", 2, 512, 8, 256, 1000, family="llama", tied=False, n_expert=8, top_k=2, expert_ffn=256
    )
    lay = planner.Layout(8, 1, 1, zero=0, ep=8, sequence_parallel=False)
    got = planner.step_time(m, SMALL, lay, 8)["expert"]
    # dispatch and combine, forward and backward: 4·T·k·(ep-1)/ep·h values of 2 bytes
    sent = 4 * 256 * 2 * 7 / 8 * 512 * 2
    assert got == pytest.approx(2 * (sent / 100e9 + 4 * 7 * 1e-6))
    assert planner.step_time(m, SMALL, replace(lay, a2a_overlap=True), 8)["expert"] == 0
    # the expert data-parallel group: 8 ranks, 8 experts each on one: no expert replica
    states = planner.memory(m, lay, 8)["states"]
    dense = m.params() - m.expert_params()
    assert states == 16 * dense + 16 * m.expert_params() / 8


def test_a_reduction_after_the_flush_is_exposed_whole():
    m = Transformer("dp", 2, 1024, 8, 1024, 1000)
    cluster = replace(SMALL, gpus=4)
    after = planner.Layout(4, 1, 1, zero=0, dp_overlap=False)
    got = planner.step_time(m, cluster, after, 4)["data"]
    nbytes = 2 * m.params()
    assert got == pytest.approx(2 * 3 * 1e-6 + 2 * 3 / 4 * nbytes / 100e9)
    overlapped = planner.step_time(m, cluster, replace(after, dp_overlap=True), 4)["data"]
    assert overlapped < got


def test_gpu_memory_is_what_the_device_reports():
    assert REPORTED_MEMORY["H100 SXM"] == 85_520_809_984  # 81,559 MiB
    assert REPORTED_MEMORY["A100 SXM 80GB"] == 85_899_345_920  # 81,920 MiB
    layout = planner.Layout(128, 8, 16, zero=2, chunks=2)
    found = planner.evaluate(LLAMA, planner.Cluster("x", "H100 SXM", 16384, 8, 1, 1), layout, 2048)
    assert found["fits"] == (found["memory"] <= 0.9 * 85_520_809_984)


# ------------------------------------------------------------------ the fit


def test_the_fitted_parameters_are_what_the_fit_finds_on_the_training_rows():
    found = calibration.fit()
    assert found.gemm == pytest.approx(FITTED.gemm, rel=2e-3)
    assert found.passes == pytest.approx(FITTED.passes, rel=2e-3)


def test_the_fit_reads_the_training_rows_only(monkeypatch):
    seen = set()

    def recorded(eff, rows):
        seen.update(r["name"] for r in rows)
        return 1.0

    monkeypatch.setattr(calibration, "loss", recorded)
    calibration.fit()
    assert seen == set(TRAINING)


def test_one_parameter_set_for_every_row():
    """No row carries a parameter of its own, and every prediction of the table is the
    planner's with :data:`FITTED`."""
    keys = {"name", "model", "cluster", "global_batch", "layout", "tflops", "counted"}
    keys |= {"source", "assumed", "split"}
    rows = runs()
    for r in rows:
        assert set(r) == keys
    table = calibration.table()
    for r, t in zip(rows, table, strict=True):
        found = planner.evaluate(r["model"], r["cluster"], r["layout"], r["global_batch"])
        key = "tflops" if r["counted"] == "with recomputation" else "model_tflops"
        assert t["predicted"] == found[key]


def test_every_row_of_ptdp_table_1_is_in_the_table_in_or_out_of_sample():
    table = calibration.table()
    names = {r["name"]: r for r in table}
    for billions, *_ in PTDP_TABLE_1:
        assert f"PTD-P {billions}B" in names
    assert {r["name"] for r in table if r["split"] == "train"} == set(TRAINING)
    errors = calibration.summary(table)
    assert errors["train"]["rows"] == 4 and errors["train"]["max"] < 0.03
    ptdp = [abs(r["error"]) for r in table if r["name"].startswith("PTD-P")]
    assert max(ptdp) < 0.06  # 2021 Megatron-LM on A100s, out of sample too


def test_sensitivity_moves_each_prediction_the_right_way():
    rows = calibration.sensitivity(["PTD-P 1.7B", "PTD-P 1008.0B"])
    for r in rows:
        assert 0 < r[("gemm", 1)] < 0.10 and -0.12 < r[("gemm", -1)] < 0
        assert r[("passes", 1)] < 0 < r[("passes", -1)]
    small, large = rows
    assert abs(small[("passes", 1)]) > abs(large[("passes", 1)])  # small layers feel it more


def test_changing_one_assumption_changes_the_ranking():
    model, cluster = (
        MODELS["GPT-3 175B"],
        planner.Cluster("Selene", "A100 SXM 80GB", 1536, 8, 300e9, 25e9),
    )
    hidden = planner.best_per_mesh(planner.plan(model, cluster, 1536))
    exposed = planner.best_per_mesh(planner.plan(model, cluster, 1536, dp_overlap=(False,)))
    assert hidden[0]["layout"].zero == 3  # ZeRO-3's gathers hidden behind compute
    assert exposed[0]["layout"].zero < 3
    assert hidden[0]["layout"].mesh != exposed[0]["layout"].mesh


def test_the_calculators_constants_are_the_models_and_need_no_torch():
    import subprocess
    import sys

    from labsupport.estimate import memory
    from labsupport.models import gpt, recompute

    # one home for the constants, shared by the models and the calculators
    assert memory.RECOMPUTE is recompute.RECOMPUTE is gpt.RECOMPUTE
    assert memory.BLOCK_UNITS is recompute.BLOCK_UNITS
    # the planner's modules import neither PyTorch, NumPy nor a model, only the models'
    # torch-free constants; the __init__ files that import torch are left out (as on the
    # website, tests/test_site_calculator.py)
    package = str(Path(memory.__file__).resolve().parents[1])
    code = (
        "import sys, types\n"
        "for name, sub in (('labsupport', ''), ('labsupport.models', '/models')):\n"
        "    sys.modules[name] = types.ModuleType(name)\n"
        f"    sys.modules[name].__path__ = [{package!r} + sub]\n"
        "import labsupport.estimate.calibration, labsupport.estimate.published\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m in ('torch', 'numpy') or m.startswith('labsupport.models.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['labsupport.models.recompute']"


@pytest.mark.parametrize(("n", "stride"), [(1, 1), (2, 1), (8, 1), (3, 8), (16, 8)])
def test_the_planners_ring_all_reduce_is_the_comm_modules(n, stride):
    from labsupport.comm.cost import all_reduce_time
    from labsupport.estimate.step import _beta, ring_all_reduce_time

    got = ring_all_reduce_time(SMALL, n, 1e9, stride)
    want = all_reduce_time("ring", n, 1e9, SMALL.alpha, _beta(SMALL, stride, n))
    assert got == pytest.approx(float(want), rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_layers_time_is_its_gemms_three_times_the_reruns_and_the_memory_bound_kernels(recompute):
    from labsupport.estimate.compute import layer_seconds

    gpt = Transformer("GPT", 2, 2048, 16, 1024, 1000)
    eff = Efficiency(gemm=0.5, passes=3.0)
    found = layer_seconds(gpt, 1024, A100, eff, tp=2, recompute=recompute)
    gemms = layer_gemms(gpt, 1024, tp=2)
    forward = sum(
        gemm_seconds(*g[:3], 312e12, 2039e9, eff, g[3]) for kind in gemms.values() for g in kind
    )
    core = sum(gemm_seconds(*g[:3], 312e12, 2039e9, eff, g[3]) for g in gemms["core"])
    memory_bound = 3.0 * gpt.activation_bytes("none", 2) * 1024 / 2039e9
    rerun = {"none": 0, "selective": core, "full": forward}[recompute]
    assert found["forward"] == pytest.approx(forward)
    assert found["total"] == pytest.approx(3 * forward + rerun + memory_bound)
