"""The calculators' forms, and the static tables the page shows when Python cannot run.

Written by ``python -m tools.site_calculator`` into ``_build/calculator/``; the page
(``calculators.md``) includes them. The static tables come from
:mod:`labsupport.estimate.web`, the module the live page calls.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from labsupport.estimate import web

#: The memory calculator's opening state: GPT-3 175B as Narayanan et al. 2021 trained it
#: (chapter 13's table: 35 GB).
MEMORY_START = web.published_inputs("GPT-3 175B")
#: The static table's rows: the opening state, one axis changed at a time, then others.
MEMORY_ROWS = [
    ("GPT-3 175B as published", {}),
    ("… ZeRO-1", {"zero": 1}),
    ("… ZeRO-3", {"zero": 3}),
    ("… no recomputation", {"recompute": "none"}),
    ("… no pipeline (pp 1, dp 192)", {"pp": 1, "dp": 192}),
    ("… 8 interleaved chunks", {"chunks": 8}),
    ("… context parallel over 2, selective, FlashAttention",
     {"cp": 2, "recompute": "selective", "fused_attention": True}),
    ("Llama 3 405B, 128K, as published", web.published_inputs("Llama 3 405B, 128K")),
    ("DeepSeek-V3 as published (EP 64)", web.published_inputs("DeepSeek-V3")),
    ("GPT-2 124M on one RTX 4090", {"model": "GPT-2 124M", "seq_len": 1024, "gpu": "RTX 4090",
                                    "dp": 1, "tp": 1, "pp": 1, "zero": 0, "micro_batch": 8,
                                    "micro_batches": 1, "chunks": 1, "recompute": "none"}),
]  # fmt: skip
#: A custom model's families, as the form offers them.
FAMILIES = [("gpt", "GPT (GELU)"), ("llama", "Llama (SwiGLU)")]
PARTS = ["weights", "gradients", "master weights", "momentum", "variance", "activations"]


def _number(name, label, value, low=1, step=1, placeholder=""):
    shown = f' placeholder="{escape(placeholder)}"' if placeholder else ""
    return (f'<label>{label} <input type="number" name="{name}" value="{value}" min="{low}" '
            f'step="{step}" inputmode="numeric"{shown}></label>')  # fmt: skip


def _select(name, label, options, chosen):
    items = "".join(
        f'<option value="{escape(str(v))}"{" selected" if v == chosen else ""}>{escape(str(t))}'
        "</option>"
        for v, t in options
    )
    return f'<label>{label} <select name="{name}">{items}</select></label>'


def memory_form() -> str:
    s, model = MEMORY_START, web.PRESETS[MEMORY_START["model"]]
    models = [(m, m) for m in web.PRESETS] + [("custom", "custom sizes")]
    fields = [
        _select("model", "model", models, s["model"]),
        *(_number(k, k, getattr(model, k)) for k in web.CUSTOM),
        _select("family", "family", FAMILIES, model.family),
        _number("ffn", "FFN width", model.ffn or "", placeholder="default"),
        _number("kv_heads", "key-value heads (GQA)", model.kv_heads or "", placeholder="= heads"),
        _number("seq_len", "sequence (tokens)", s["seq_len"]),
        _select("gpu", "GPU", [(g, g) for g in web.GPUS], s["gpu"]),
        *(_number(k, k, s[k]) for k in ("dp", "tp", "pp", "cp", "ep")),
        _select("zero", "ZeRO stage", [(z, z) for z in range(4)], s["zero"]),
        _select("recompute", "recomputation", [(r, r) for r in web.RECOMPUTE], s["recompute"]),
        _number("micro_batch", "micro-batch (sequences)", s["micro_batch"]),
        _number("micro_batches", "micro-batches per step", s["micro_batches"]),
        _number("chunks", "interleaved chunks", s["chunks"]),
        _check("sequence_parallel", "sequence parallelism", s["sequence_parallel"]),
        _check("fused_attention", "FlashAttention (no score matrix kept)", s["fused_attention"]),
    ]
    return _form("calc-memory", "Memory per GPU", fields)


def plan_form() -> str:
    run = web.planner_presets()[1]  # GPT-3 175B on Selene
    fields = [
        _select("model", "model", [(m, m) for m in web.MODELS], run["model"]),
        _select("cluster", "cluster", [(c, c) for c in web.CLUSTERS], run["cluster"]),
        _number("global_batch", "global batch (sequences)", run["global_batch"]),
        _number("cp", "cp (context parallel)", run["cp"]),
        _select("framework", "framework", [(f, f) for f in web.FRAMEWORKS], run["framework"]),
        _check("dp_overlap", "data-parallel reduction overlaps the backward pass",
               run["dp_overlap"]),
    ]  # fmt: skip
    return _form("calc-plan", "The planner", fields)


def _check(name, label, checked):
    return (f'<label class="calc-check"><input type="checkbox" name="{name}"'
            f'{" checked" if checked else ""}> {escape(label)}</label>')  # fmt: skip


def _form(key, title, fields):
    inputs = "\n".join(fields)
    return f"""<div class="calc" id="{key}">
<p class="calc-status" role="status" data-state="off">The calculator needs JavaScript: \
the tables below were computed when the site was built.</p>
<form class="calc-form" id="{key}-form" aria-label="{escape(title)}">
<fieldset disabled>
{inputs}
</fieldset>
</form>
<div class="calc-out" id="{key}-out" aria-live="polite"></div>
</div>
"""


def memory_table() -> str:
    head = "".join(f"<th>{p}</th>" for p in ["case", *PARTS, "total"])
    rows = []
    for label, change in MEMORY_ROWS:
        inputs = MEMORY_START | change
        r = web.memory_per_gpu(inputs)
        cells = "".join(f"<td>{r['parts'][p] / 1e9:.2f}</td>" for p in PARTS)
        rows.append(f"<tr><th>{escape(label)}</th>{cells}<td>{r['total'] / 1e9:.2f}</td></tr>")
    return _static("GB per GPU, by state", head, rows)


def axes_text(axes) -> str:
    """``dp×tp×pp``, with ``CP c`` and ``EP e`` where they are above 1 (as the page shows)."""
    dp, tp, cp, pp, ep = axes
    return f"{dp}×{tp}×{pp}" + (f", CP {cp}" if cp > 1 else "") + (f", EP {ep}" if ep > 1 else "")


def plan_table() -> str:
    head = "".join(f"<th>{h}</th>" for h in ("run", "rank", "dp×tp×pp", "GB", "step s", "TFLOP/s"))
    rows = []
    for run in web.planner_presets():
        for i, row in enumerate(web.plan_layouts(run, top=3)["rows"]):
            rows.append(
                f"<tr><th>{escape(run['name'])}</th><td>{i + 1}</td>"
                f"<td>{axes_text(row['axes'])}</td><td>{row['memory'] / 1e9:.2f}</td>"
                f"<td>{row['step_s']:.2f}</td><td>{row['tflops']:.1f}</td></tr>"
            )
    return _static("The planner's three fastest meshes for each published run", head, rows)


def _static(caption, head, rows):
    body = "\n".join(rows)
    return f"""<div class="calc-static calc-scroll" tabindex="0" role="region" \
aria-label="{escape(caption)}">
<table class="calc-table"><caption>{escape(caption)} (computed when the site was built)\
</caption>
<thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody></table></div>
"""


def write_pages(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.html").write_text(memory_form() + memory_table())
    (out / "planner.html").write_text(plan_form() + plan_table())
