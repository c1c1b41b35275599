"""Published training runs with their throughput, the data the efficiency model is fitted
on and checked against (:mod:`labsupport.estimate.calibration`).

Every row gives what its source gives: the model, the GPUs, the layout, the global batch
and the throughput per GPU, counted as the source counts it (``counted``: every FLOP with
recomputation, as Megatron-LM and BLOOM report, or the model's, as MFU). ``assumed`` names
the settings the source leaves open and the value the row takes; the same for every row of
a source, never the planner's fastest.

* **PTD-P, table 1** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", SC21, table 1): ten GPT models from 1.7 B to 1 T
  parameters on Selene's A100s, vocabulary 51,200, sequences of 2,048, activation
  recomputation (the FLOPs they count include it). Micro-batch size and interleaving are
  not given: micro-batch 1 (their table 2's setting for PTD-P) and no interleaving.
* **PTD-P, table 2**: GPT-3 175 B (model parallel 96: TP 8 × PP 12) at a global batch of
  1,536 on 384, 768 and 1,536 GPUs, 153, 149 and 141 TFLOP/s; the 530 B model (TP 8 × PP
  35) at 2,240 on 560, 1,120 and 2,240 GPUs, 171, 167 and 159; micro-batch 1.
* The 2021 Megatron-LM reduced data-parallel gradients after the pipeline flush and had
  no FlashAttention: :data:`labsupport.estimate.published.MEGATRON_2021`.
* **BLOOM-176B**, **Llama 3 405B** and **DeepSeek-V3**: :mod:`labsupport.estimate.published`.
"""

from __future__ import annotations

from dataclasses import replace

from labsupport.estimate.planner import Layout, Transformer
from labsupport.estimate.published import CLUSTERS, MEGATRON_2021, MODELS, PUBLISHED

PTDP_TABLE_1 = [
    # billions of parameters, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
"""Narayanan et al. 2021, table 1, as published."""

PTDP_TABLE_2 = [
    # billions, model, TP, PP, GPUs, batch, TFLOP/s per GPU
    (174.6, "GPT-3 175B", 8, 12, 384, 1536, 153),
    (174.6, "GPT-3 175B", 8, 12, 768, 1536, 149),
    (174.6, "GPT-3 175B", 8, 12, 1536, 1536, 141),
    (529.6, "GPT 530B", 8, 35, 560, 2240, 171),
    (529.6, "GPT 530B", 8, 35, 1120, 2240, 167),
    (529.6, "GPT 530B", 8, 35, 2240, 2240, 159),
]
"""Narayanan et al. 2021, table 2, the PTD-P rows."""

PTDP = {"zero": 0, "micro_batch": 1} | MEGATRON_2021
"""The PTD-P rows' layout settings: plain data parallelism, micro-batch 1 (table 2's, and
assumed for table 1), the 2021 framework
(:data:`labsupport.estimate.published.MEGATRON_2021`)."""

ASSUMED_2021 = "micro-batch 1, no interleaving"

TRAINING = ("PTD-P 1.7B", "PTD-P 18.4B", "PTD-P 145.6B", "PTD-P 1008.0B")
"""The rows the efficiency model is fitted on: four of PTD-P table 1, from the smallest to
the largest model, every third row. Every other row is out of sample."""


def _gpt(name, heads, hidden, layers) -> Transformer:
    return Transformer(name, layers, hidden, heads, 2048, 51200)


def _row(name, model, cluster, gpus, batch, layout, tflops, counted, source, assumed):
    return {
        "name": name,
        "model": model,
        "cluster": replace(cluster, gpus=gpus),
        "global_batch": batch,
        "layout": layout,
        "tflops": tflops,
        "counted": counted,
        "source": source,
        "assumed": assumed,
    }


def runs() -> list[dict]:
    """Every published run, PTD-P's tables first; ``split`` is ``"train"`` for the rows
    of :data:`TRAINING`, ``"test"`` for the others."""
    selene = CLUSTERS["Selene, 1,536 GPUs"]
    rows = []
    for billions, a, h, layers, t, p, n, batch, tflops in PTDP_TABLE_1:
        name = f"PTD-P {billions}B"
        layout = Layout(n // (t * p), t, p, **PTDP)
        rows.append(
            _row(
                name,
                _gpt(name, a, h, layers),
                selene,
                n,
                batch,
                layout,
                tflops,
                "with recomputation",
                "Narayanan et al. 2021, table 1",
                ASSUMED_2021,
            )
        )
    shapes = {"GPT-3 175B": MODELS["GPT-3 175B"], "GPT 530B": _gpt("GPT 530B", 128, 20480, 105)}
    for billions, model, t, p, n, batch, tflops in PTDP_TABLE_2:
        layout = Layout(n // (t * p), t, p, **PTDP)
        name = f"PTD-P {billions}B, {n:,} GPUs"
        rows.append(
            _row(
                name,
                shapes[model],
                selene,
                n,
                batch,
                layout,
                tflops,
                "with recomputation",
                "Narayanan et al. 2021, table 2",
                "no interleaving",
            )
        )
    for entry in PUBLISHED:
        if entry["source"].startswith("Narayanan"):
            continue  # GPT-3 and the 1T model are rows of tables 1 and 2 above
        cluster = CLUSTERS[entry["cluster"]]
        rows.append(
            _row(
                entry["name"],
                MODELS[entry["model"]],
                cluster,
                entry.get("gpus", cluster.gpus),
                entry["global_batch"],
                entry["layout"],
                entry["tflops"],
                entry["counted"],
                entry["source"],
                entry.get("assumed", ""),
            )
        )
    for row in rows:
        row["split"] = "train" if row["name"] in TRAINING else "test"
    return rows
