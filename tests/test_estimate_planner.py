"""The planner: its parts against the course's own calculators and schedules, and the
published runs' layouts (BLOOM-176B, GPT-3 175B, the 1T model of Narayanan et al. 2021,
Llama 3 405B, DeepSeek-V3). Its throughput against published runs, in sample and out of
sample: ``test_estimate_calibration.py``.

Nothing here starts a process: the planner gives the same answer on every machine.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from labsupport.estimate import datasheets, flops, params, planner
from labsupport.estimate.memory import activation_memory, training_memory
from labsupport.estimate.published import CLUSTERS, MODELS, PUBLISHED, as_published, check
from labsupport.models.gpt import RECOMPUTE
from labsupport.parallel import schedules

GPT = planner.Transformer("small GPT", 4, 256, 8, 128, 1000)


def test_parameter_counts_match_the_closed_forms_and_the_papers():
    # the course GPT's closed form (nanoGPT: learned positions, tied output layer)
    assert GPT.params() == params.gpt_params(1000, 128, 256, 4)
    # BLOOM: 176,247 M (BigScience 2022); Narayanan et al. 2021, table 1 and eq. (2):
    # P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), 174.6 B and 1,008.0 B
    bloom = datasheets.MODELS["BLOOM 176B"]["params"]
    assert MODELS["BLOOM-176B"].params() == pytest.approx(bloom, rel=1e-5)
    for name, published in (("GPT-3 175B", 174.6e9), ("GPT 1T", 1008.0e9)):
        m = MODELS[name]
        layers, h, v, s = m.layers, m.hidden, m.vocab, m.seq_len
        formula = 12 * layers * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))
        assert m.params() == pytest.approx(formula, rel=1e-6)
        assert round(m.params() / 1e8) == round(published / 1e8)
    # Llama 3 405B: SwiGLU, grouped-query attention, untied output layer
    assert MODELS["Llama 3 405B"].params() / 1e9 == pytest.approx(405.9, abs=0.05)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_flops_per_token_are_the_flops_module_for_a_gpt(recompute):
    m = MODELS["GPT-3 175B"]
    want = flops.transformer_training_flops(1, m.layers, m.hidden, m.seq_len, m.vocab, recompute)
    assert m.flops_per_token(recompute) == pytest.approx(want, rel=1e-12)


def test_one_gpu_memory_is_the_memory_calculators():
    layout = planner.Layout(1, 1, 1, zero=0, micro_batch=2, recompute="none")
    layout = replace(layout, fused_attention=False)  # the score matrices kept
    got = planner.memory(GPT, layout, global_batch=2)
    assert got["states"] == sum(training_memory(GPT.params(), "mixed").values())
    assert got["activations"] == activation_memory(128, 2, 256, 8, 4, "none")


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_states_are_split_by_tensor_and_pipeline_and_sharded_by_zero(zero):
    m, layout = MODELS["BLOOM-176B"], planner.Layout(8, 4, 12, zero=zero)
    stage = 5 * m.layer_params() + m.embedding_params()  # BLOOM's README: embed + 5 layers
    assert planner.stage_layers(m, 12) == 5
    got = planner.memory(m, layout, 2048)["states"]
    assert got == pytest.approx(sum(training_memory(stage / 4, "mixed", zero, 8).values()))
    assert planner.stage_params(m, 12) == {"dense": stage, "experts": 0}


def rank0_outstanding(actions) -> int:
    """Most chunk-forwards rank 0 has run and not yet run backward for."""
    held = peak = 0
    for a in actions:
        held += {"forward": 1, "backward": -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak


CASES = [
    (2, 2, 1),
    (4, 8, 1),
    (4, 3, 1),
    (8, 16, 1),
    (2, 2, 2),
    (4, 8, 2),
    (4, 4, 4),
    (8, 16, 4),
    (8, 8, 2),
]  # (p, m, v); interleaving needs m to be a multiple of p


@pytest.mark.parametrize(("p", "m", "v"), CASES)
def test_micro_batches_in_flight_are_those_of_the_courses_schedules(p, m, v):
    build = schedules.one_f_one_b if v == 1 else schedules.interleaved_1f1b
    actions = build(p, m, 0) if v == 1 else build(p, m, 0, v)
    assert planner.in_flight(p, m, v) * v == rank0_outstanding(actions)


def test_the_bubble_is_the_schedules_formula():
    cluster = CLUSTERS["Selene, 1,536 GPUs"]
    for layout in (planner.Layout(16, 8, 12, chunks=2), planner.Layout(32, 8, 6, micro_batch=2)):
        parts = planner.step_time(MODELS["GPT-3 175B"], cluster, layout, 1536)
        m = 1536 // (layout.dp * layout.micro_batch)
        busy = parts["compute"] + parts["tensor"] + parts["pipeline"]
        want = schedules.bubble_fraction(layout.pp, m, layout.chunks)["of_ideal"]
        assert parts["bubble"] / busy == pytest.approx(want)


def test_every_enumerated_layout_splits_the_gpus_and_the_batch():
    cluster, batch = CLUSTERS["Jean Zay (BLOOM)"], 2048
    found = list(planner.layouts(MODELS["BLOOM-176B"], cluster, batch))
    assert len(found) > 1000
    for lay in found:
        assert lay.dp * lay.tp * lay.pp == cluster.gpus
        assert batch % (lay.dp * lay.micro_batch) == 0
        assert lay.tp <= cluster.gpus_per_node and 112 % lay.tp == 0


def test_tensor_parallelism_divides_the_key_value_heads():
    """Megatron-core splits the query groups over tp (``num_query_groups_per_partition``):
    a model of 2 key-value heads is never split 4 or 8 ways, though its 32 heads would."""
    cluster = CLUSTERS["Jean Zay (BLOOM)"]
    gqa = replace(MODELS["BLOOM-176B"], heads=32, hidden=4096, layers=4, kv_heads=2)
    tps = {lay.tp for lay in planner.layouts(gqa, cluster, 3072, pp=(1,), micro_batch=(1,))}
    assert tps == {1, 2}
    assert {lay.tp for lay in planner.layouts(replace(gqa, kv_heads=0), cluster, 3072, pp=(1,),
                                             micro_batch=(1,))} == {1, 2, 4, 8}  # fmt: skip


@pytest.mark.parametrize("entry", PUBLISHED, ids=[e["name"] for e in PUBLISHED])
def test_published_layouts_are_evaluated_as_published(entry):
    """Every published layout is evaluated as its source gives it (no setting chosen by
    the planner) and uses every GPU; the dense runs of 2021-22 fit, and Llama 3's 8K stage
    on 16,384 GPUs fits in the memory an H100 reports (its 90 % line is the planner's)."""
    found = as_published(entry)
    assert found["layout"] == entry["layout"]
    assert found["layout"].gpus == entry.get("gpus", CLUSTERS[entry["cluster"]].gpus)
    if entry["source"].startswith(("Narayanan", "BigScience")):
        assert found["fits"]
    if entry["name"] == "Llama 3 405B":
        assert found["memory"] <= 81559 * 2**20


def test_the_published_mesh_ranks_among_the_planners_meshes():
    found = check(PUBLISHED[0])  # BLOOM: its mesh, with the planner's best settings
    assert (
        found["rank"] is not None
        and found["mesh_best"]["step_s"] <= 1.15 * (found["meshes"][0]["step_s"])
    )


def test_zero3_without_model_parallelism_falls_behind_as_in_narayanan_table_2():
    """Narayanan et al. 2021, table 2: GPT-3 175B at a global batch of 1,536; ZeRO-3
    without model parallelism drops from 144 to 44 TFLOP/s per GPU from 384 to 1,536
    GPUs, PTD parallelism (model-parallel size 96) only from 153 to 141."""
    m, base = MODELS["GPT-3 175B"], CLUSTERS["Selene, 1,536 GPUs"]
    zero3, ptd = {}, {}
    for n, b in ((384, 4), (1536, 1)):
        c = replace(base, gpus=n)
        z = planner.Layout(n, 1, 1, zero=3, micro_batch=b, recompute="full")
        p = planner.Layout(n // 96, 8, 12, zero=0, chunks=2, recompute="full")
        zero3[n] = planner.evaluate(m, c, replace(z, sequence_parallel=False), 1536)["tflops"]
        ptd[n] = planner.evaluate(m, c, replace(p, sequence_parallel=False), 1536)["tflops"]
    assert zero3[384] / zero3[1536] > 2  # published: 144 / 44 = 3.3
    assert ptd[384] / ptd[1536] < 1.1  # published: 153 / 141 = 1.09
    assert ptd[1536] > 1.5 * zero3[1536]
