"""Lab 13's planner: the published runs as the planner sees them, its errors in and out
of sample, its sensitivity to the fitted parameters, its best meshes, an explorer, and the
exercise that changes one of its assumptions.

The planner is :mod:`labsupport.estimate.planner`, the published runs
:mod:`labsupport.estimate.published` and :mod:`labsupport.estimate.runs`, the fit
:mod:`labsupport.estimate.calibration`.
"""

from __future__ import annotations

import html
from dataclasses import replace

import ipywidgets as widgets

from labsupport.estimate import calibration
from labsupport.estimate.compute import FITTED, REPORTED_MEMORY
from labsupport.estimate.planner import DEFAULTS, best_per_mesh, plan
from labsupport.estimate.published import CLUSTERS, MODELS, PUBLISHED, check
from labsupport.labs.cells import exercise, format_table

#: The runs whose sensitivity to the fitted parameters the lab prints.
SENSITIVITY = ("PTD-P 1.7B", "PTD-P 1008.0B", "Llama 3 405B", "DeepSeek-V3")
#: The planner run the assumption exercise changes: GPT-3 175B on Selene, as published.
ASSUMPTION_RUN = ("GPT-3 175B", "Selene, 1,536 GPUs", 1536)


def checked() -> dict:
    """:func:`labsupport.estimate.published.check` of every published run, by name."""
    return {entry["name"]: check(entry) for entry in PUBLISHED}


def mesh_label(layout) -> str:
    """``dp x tp x pp``, with ``cp`` and ``ep`` when they are above 1."""
    dp, tp, cp, pp, ep = layout.axes
    extra = (f" cp{cp}" if cp > 1 else "") + (f" ep{ep}" if ep > 1 else "")
    return f"{dp}x{tp}x{pp}{extra}"


def published_rows(checks: dict) -> list[dict]:
    """The published layouts as the planner sees them (``checks``: :func:`checked`): the
    memory per GPU against what the GPU reports, whether it fits (90 % of that), where its
    mesh ranks among the meshes that fit, the planner's best mesh and how much faster."""
    rows = []
    for entry in PUBLISHED:
        found = checks[entry["name"]]
        p, best = found["published"], found["meshes"][0]
        capacity = REPORTED_MEMORY[CLUSTERS[entry["cluster"]].gpu]
        rank = f"{found['rank']} of {len(found['meshes'])}" if found["rank"] else "-"
        gap = found["mesh_best"]["step_s"] / best["step_s"] - 1 if found["rank"] else None
        rows.append(
            {
                "run": entry["name"],
                "d x t x p": mesh_label(entry["layout"]),
                "GB/GPU": f"{p['memory'] / 1e9:.0f} of {capacity / 1e9:.1f}",
                "fits": "yes" if p["fits"] else "no",
                "rank": rank,
                "best": mesh_label(best["layout"]),
                "vs best": "-" if gap is None else f"+{gap:.0%}",
            }
        )
    return rows


PUBLISHED_TABLES = {
    "as published: GB per GPU, of what the GPU reports; fits under 90 % of it:": (
        "d x t x p",
        "GB/GPU",
        "fits",
    ),
    "the published mesh among the meshes that fit, each with its best settings:": (
        "rank",
        "best",
        "vs best",
    ),
}
"""The columns of :func:`published_rows` the lab prints, table by table."""


def published_tables(checks: dict) -> str:
    """:data:`PUBLISHED_TABLES` of :func:`published_rows`, as text."""
    rows = published_rows(checks)
    return "\n\n".join(
        f"{title}\n" + format_table([{k: r[k] for k in ("run", *columns)} for r in rows])
        for title, columns in PUBLISHED_TABLES.items()
    )


def calibration_rows(eff=None) -> list[dict]:
    """Every published run (:mod:`labsupport.estimate.runs`), in sample (``train``) or
    out of sample (``test``): the planner's TFLOP/s per GPU, counted as the source counts
    them, against the published ones, with one parameter set (``eff``, by default the
    fitted :data:`labsupport.estimate.compute.FITTED`)."""
    return [
        {
            "run": r["name"],
            "sample": "in" if r["split"] == "train" else "out",
            "predicted": f"{r['predicted']:.0f}",
            "published": f"{r['published']:.0f}",
            "error": f"{r['error']:+.1%}",
        }
        for r in calibration.table(eff or FITTED)
    ]


def sensitivity_rows(names=SENSITIVITY) -> list[dict]:
    """How each prediction moves when a fitted parameter moves by 10 %."""
    rows = []
    for r in calibration.sensitivity(list(names)):
        row = {"run": r["name"]}
        for name in ("gemm", "passes"):
            row[f"{name} -10%"] = f"{r[(name, -1)]:+.1%}"
            row[f"{name} +10%"] = f"{r[(name, 1)]:+.1%}"
        rows.append(row)
    return rows


def plan_rows(
    model: str, cluster: str, global_batch: int, top: int = 5, eff=None, **choices
) -> list[dict]:
    """The ``top`` meshes the planner finds, each with its best layout: ``b`` is the
    micro-batch in sequences, ``v`` the chunks per pipeline rank (interleaving), ``comm``
    the communication left exposed (tensor, context, expert, pipeline and data parallel
    together). ``eff`` and ``choices`` change the planner's assumptions
    (:func:`labsupport.estimate.planner.plan`)."""
    meshes = best_per_mesh(plan(MODELS[model], CLUSTERS[cluster], global_batch, eff, **choices))
    rows = []
    for r in meshes[:top]:
        lay, parts = r["layout"], r["parts"]
        comm = sum(parts[k] for k in ("tensor", "context", "expert", "pipeline", "data"))
        rows.append(
            {
                "dp x tp x pp": f"{lay.dp} x {lay.tp} x {lay.pp}",
                "ZeRO": lay.zero,
                "b": lay.micro_batch,
                "v": lay.chunks,
                "recompute": lay.recompute,
                "GB/GPU": f"{r['memory'] / 1e9:.0f}",
                "step (s)": f"{r['step_s']:.2f}",
                "bubble (s)": f"{parts['bubble']:.2f}",
                "comm (s)": f"{comm:.2f}",
                "MFU": f"{r['mfu']:.0%}",
            }
        )
    return rows


class PlannerExplorer(widgets.interactive):
    """The planner's widget; without a kernel it reads as one line."""

    def __repr__(self) -> str:
        return "Planner explorer: a live widget (run this cell in JupyterLab to use it)"

    def describe(self) -> str:
        """The table the controls show now."""
        return format_table(plan_rows(**self.kwargs, top=8))


def explorer() -> PlannerExplorer:
    """Pick a published model, a cluster and a global batch (in sequences): the planner's
    best meshes. It starts on GPT-3 175B's run on Selene (BLOOM's best meshes are printed
    above it in the lab)."""
    report = widgets.HTML()
    style, layout = {"description_width": "120px"}, widgets.Layout(width="520px")

    def show(model, cluster, global_batch):
        rows = plan_rows(model, cluster, global_batch, top=8)
        text = format_table(rows) if rows else "no layout fits in memory"
        report.value = f"<pre>{html.escape(text)}</pre>"

    start = PUBLISHED[1]

    box = PlannerExplorer(
        show,
        model=widgets.Dropdown(
            options=list(MODELS), value=start["model"], description="model", style=style
        ),
        cluster=widgets.Dropdown(
            options=list(CLUSTERS), value=start["cluster"], description="cluster", style=style
        ),
        global_batch=widgets.SelectionSlider(
            options=[256, 512, 1024, 1536, 2048, 3072, 4096],
            value=start["global_batch"],
            description="global batch",
            style=style,
            layout=layout,
        ),
    )
    box.children = (*box.children, report)
    return box


@exercise
def check_assumption(fn) -> str:
    """Exercise 4: ``fn()`` returns one changed assumption of the planner, as a dict of
    one key: a setting of :data:`labsupport.estimate.planner.DEFAULTS` with a tuple of
    values (``{"dp_overlap": (False,)}``), or a fitted parameter, ``"gemm"`` or
    ``"passes"``, with a number. It must change the order of GPT-3 175B's five fastest
    meshes on Selene (:data:`ASSUMPTION_RUN`)."""
    changed = fn()
    assert isinstance(changed, dict) and len(changed) == 1, (
        f"return a dict of one assumption, e.g. {{'dp_overlap': (False,)}}; got {changed!r}"
    )
    ((key, value),) = changed.items()
    names = [*DEFAULTS, "gemm", "passes"]
    assert key in names, f"{key!r} is not an assumption of the planner: use one of {names}"
    eff, choices = FITTED, {}
    if key in ("gemm", "passes"):
        eff = replace(FITTED, **{key: float(value)})
    else:
        choices = {key: tuple(value) if isinstance(value, (list, tuple)) else (value,)}
    before = [r["dp x tp x pp"] for r in plan_rows(*ASSUMPTION_RUN)]
    after = plan_rows(*ASSUMPTION_RUN, eff=eff, **choices)
    assert after, f"with {key}={value!r} no layout fits: choose a value some layout can run"
    after = [r["dp x tp x pp"] for r in after]
    assert after != before, (
        f"with {key}={value!r} the five fastest meshes stay {before}: this assumption does "
        "not change the ranking; try whether data-parallel collectives overlap the backward"
    )
    return f"{key}={value!r}: the fastest meshes were {before[:2]}, now {after[:2]}"
