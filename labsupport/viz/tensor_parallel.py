"""Tensor parallelism, drawn: a linear layer split by columns and by rows, where *f* and
*g* sit in a transformer block, what it costs per layer, and the activations it keeps.

Each rank keeps its colour; a tensor every rank holds whole is grey, a sum over the ranks
dark grey. The costs and memory are the formulas of :mod:`labsupport.labs.lab12_memory`
and :mod:`labsupport.estimate.memory`: models, drawn, not measurements.
"""

from __future__ import annotations

from matplotlib.patches import FancyBboxPatch, Rectangle

from labsupport.estimate.datasheets import MODELS
from labsupport.estimate.memory import activation_memory
from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color, subplots

WHOLE = "#d9d9d9"  # a tensor every rank holds whole
SUM = "#555555"  # a sum over the ranks


def _matrix(ax, x, y, rows, cols, colors, axis, label, cell=0.32, size=9):
    """A ``rows`` x ``cols`` matrix at (x, y), its slices along ``axis`` (0: rows, 1:
    columns) coloured ``colors`` in turn (one colour: the whole matrix)."""
    parts = len(colors)
    for i in range(rows):
        for j in range(cols):
            k = (i if axis == 0 else j) * parts // (rows if axis == 0 else cols)
            ax.add_patch(
                Rectangle(
                    (x + j * cell, y - (i + 1) * cell),
                    cell,
                    cell,
                    facecolor=colors[k],
                    edgecolor="white",
                    linewidth=0.8,
                )
            )
    ax.text(x + cols * cell / 2, y + 0.15, label, ha="center", va="bottom", fontsize=size)
    return x + cols * cell


def draw_linear_split(t: int = 4, in_features: int = 8, out_features: int = 12, rows: int = 3):
    """``Y = X Aᵀ`` with ``A`` (``out x in``) split over ``t`` ranks: by columns of ``Aᵀ``
    (each rank its output features, then an all-gather) and by rows of ``Aᵀ`` (each rank
    its input features, partial sums, then an all-reduce); one above the other."""
    ranks = [rank_color(r) for r in range(t)]
    fig, (top, bottom) = subplots(2, 1, PAGE_WIDTH, 5.4)
    c, size = 0.32, SMALL
    x = _matrix(top, 0, 0, rows, in_features, [WHOLE], 0, "X\n(every rank)", size=size)
    top.text(x + 0.2, -rows * c / 2, "×", fontsize=14, va="center")
    x = _matrix(top, x + 0.7, 0, in_features, out_features, ranks, 1, "Aᵀ: rank r holds\ncolumns r",
                size=size)  # fmt: skip
    top.text(x + 0.2, -rows * c / 2, "=", fontsize=14, va="center")
    x = _matrix(top, x + 0.7, 0, rows, out_features, ranks, 1, "Y_r = X A_rᵀ\non rank r",
                size=size)  # fmt: skip
    top.text(x - out_features * c / 2, -rows * c - 0.3, "all-gather\n(gather_output) → Y",
             ha="center", va="top")  # fmt: skip
    top.set_title("Column-parallel: split the output features", loc="left")
    x = _matrix(bottom, 0, 0, rows, in_features, ranks, 1, "X: rank r uses\ncolumns r", size=size)
    bottom.text(x + 0.2, -rows * c / 2, "×", fontsize=14, va="center")
    x = _matrix(bottom, x + 0.7, 0, in_features, out_features, ranks, 0,
                "Aᵀ: rank r holds\nrows r", size=size)  # fmt: skip
    bottom.text(x + 0.2, -rows * c / 2, "=", fontsize=14, va="center")
    x = _matrix(bottom, x + 0.7, 0, rows, out_features, [SUM], 0, "Σ over r\nof X_r A_rᵀ",
                size=size)  # fmt: skip
    bottom.text(x - out_features * c / 2, -rows * c - 0.3, "all-reduce (g)\nof the partial sums",
                ha="center", va="top")  # fmt: skip
    bottom.set_title("Row-parallel: split the input features", loc="left")
    for ax in (top, bottom):
        ax.set_xlim(-0.1, x + 0.1)
        ax.set_ylim(-in_features * c - 0.1, 1.0)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


def draw_block(t: int = 2):
    """The parallel MLP and attention of a transformer block on ``t`` ranks: *f* before
    the column-parallel layer (identity forward, all-reduce backward), *g* after the
    row-parallel one (all-reduce forward, identity backward). The flow runs downwards, the
    MLP left, attention right."""
    fig, axes = subplots(1, 2, PAGE_WIDTH, 6.0)
    halves = [
        ("MLP", ["c_fc\nX A_r (column)", "GeLU", "c_proj\nY_r B_r (row)"]),
        ("Attention", ["c_attn: Q, K, V\nheads r (column)", "attention\nheads r",
                       "c_proj\nheads r (row)"]),
    ]  # fmt: skip
    w, gap = 1.45, 0.1  # a rank's column of boxes, and between two ranks'
    span = t * w + (t - 1) * gap
    mid = span / 2
    for ax, (name, steps) in zip(axes, halves, strict=True):
        levels = [6.5, 5.65, 4.2, 3.0, 1.8, 0.9, 0.05]  # X, f, the three steps, g, Z
        _box(ax, mid - 0.4, levels[0], 0.8, 0.45, "X", WHOLE, fontsize=SMALL)
        _box(ax, mid - 0.4, levels[1], 0.8, 0.45, "f", "white", fontsize=SMALL)
        _arrow(ax, (mid, levels[0]), (mid, levels[1] + 0.45))
        for r in range(t):
            x = r * (w + gap)
            for i, text in enumerate(steps):
                _box(ax, x, levels[2 + i], w, 0.8, text, rank_color(r), alpha=0.55,
                     fontsize=SMALL)  # fmt: skip
                if i:
                    _arrow(ax, (x + w / 2, levels[1 + i]), (x + w / 2, levels[2 + i] + 0.8))
            ax.text(x + w / 2, levels[2] + 0.85, f"rank {r}", ha="center", va="bottom")
            _arrow(ax, (mid, levels[1]), (x + w / 2, levels[2] + 1.2))
            _arrow(ax, (x + w / 2, levels[4]), (mid, levels[5] + 0.45))
        _box(ax, mid - 0.4, levels[5], 0.8, 0.45, "g", "white", fontsize=SMALL)
        _box(ax, mid - 0.4, levels[6], 0.8, 0.45, "Z", WHOLE, fontsize=SMALL)
        _arrow(ax, (mid, levels[5]), (mid, levels[6] + 0.45))
        ax.set_title(name)
        ax.set_xlim(-0.05, span + 0.05)
        ax.set_ylim(levels[-1] - 0.05, levels[0] + 0.5)
        ax.axis("off")
    fig.text(
        0.5,
        0.0,
        "f: identity forward, all-reduce backward\ng: all-reduce forward, identity backward",
        ha="center",
        va="top",
    )
    fig.tight_layout()
    return fig


def _arrow(ax, start, end):
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "lw": 1.0})


def _box(ax, x, y, w, h, text, color, alpha=1.0, fontsize=8):
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.03",
            facecolor=color,
            edgecolor="#444444",
            alpha=alpha,
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def draw_layer_costs(rows: list[dict], title: str):
    """Modelled compute and all-reduce time per layer and GPU for each tensor-parallel
    size (:func:`labsupport.estimate.tensor_parallel.layer_costs`)."""
    fig, ax = figure(0.85 * PAGE_WIDTH, 3.8)
    links = [k for k in rows[0] if k not in ("t", "compute")]
    width = 0.8 / (1 + len(links))
    for i, key in enumerate(["compute", *links]):
        xs = [j + (i - len(links) / 2) * width for j in range(len(rows))]
        label = "compute (forward + backward)" if key == "compute" else f"4 all-reduces, {key}"
        ax.bar(xs, [r[key] * 1e3 for r in rows], width, color=rank_color(i), label=label)
    ax.set_xticks(range(len(rows)), [f"t = {r['t']}" for r in rows])
    ax.set_ylabel("ms per layer and sequence")
    ax.set_title(title, fontsize=SMALL)
    ax.legend(fontsize=SMALL, frameon=False)
    return fig


def draw_activations(model: str = "GPT-3 175B", t_values=(1, 2, 4, 8)):
    """Activation bytes per layer and GPU (one sequence, 16-bit, no recomputation) with
    tensor parallelism alone and with sequence parallelism (Korthikanti et al. 2022)."""
    m = MODELS[model]
    s, h, a = m["seq_len"], m["hidden"], m["heads"]
    fig, ax = figure(0.8 * PAGE_WIDTH, 3.6)
    for i, sp in enumerate((False, True)):
        values = [
            activation_memory(s, 1, h, a, 1, tensor_parallel=t, sequence_parallel=sp) / 1e9
            for t in t_values
        ]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(t_values))]
        label = "tensor + sequence parallel" if sp else "tensor parallel"
        ax.bar(xs, values, 0.38, color=rank_color(i), label=label)
        for x, v in zip(xs, values, strict=True):
            ax.text(x, v + 0.03, f"{v:.2f}", ha="center", fontsize=SMALL)
    ax.set_xticks(range(len(t_values)), [f"t = {t}" for t in t_values])
    ax.set_ylabel("GB per layer and GPU")
    ax.set_title(f"{model}: activations of one layer,\none sequence of {s} tokens", fontsize=SMALL)
    ax.legend(fontsize=SMALL, frameon=False)
    return fig


def draw_sequence_parallel_shapes(t: int = 4):
    """One transformer block with tensor and sequence parallelism on ``t`` ranks, region
    by region, with the shape of the activation each rank holds there (``s`` tokens,
    ``b`` sequences, width ``h``, ``a`` heads): sequence-split around the LayerNorms,
    dropouts and residual additions, split by heads or hidden features inside attention
    and the MLP, all-gathers (*g*) and reduce-scatters (*ḡ*) between."""
    steps = [
        ("LayerNorm, dropout, residual", f"s/{t} × b × h", "sequence"),
        ("g: all-gather", "", "collective"),
        ("Q, K, V (column-parallel)", f"s × b × 3h/{t}", "split"),
        (f"attention of a/{t} heads", f"s × b × h/{t}", "split"),
        ("output projection (row-parallel)", "s × b × h, partial sums", "sum"),
        ("ḡ: reduce-scatter", "", "collective"),
        ("LayerNorm, dropout, residual", f"s/{t} × b × h", "sequence"),
        ("g: all-gather", "", "collective"),
        ("MLP up and GeLU (column-parallel)", f"s × b × 4h/{t}", "split"),
        ("MLP down (row-parallel)", "s × b × h, partial sums", "sum"),
        ("ḡ: reduce-scatter", "", "collective"),
    ]
    colors = {"sequence": rank_color(0), "split": rank_color(1), "sum": SUM, "collective": "white"}
    row = 0.62
    fig, ax = figure(PAGE_WIDTH, row * len(steps) + 0.9)
    y = row * (len(steps) - 1)
    for i, (name, shape, kind) in enumerate(steps):
        alpha = 1.0 if kind == "collective" else 0.45
        _box(ax, 0, y, 3.9, row * 0.72, name, colors[kind], alpha=alpha, fontsize=SMALL)
        ax.text(4.1, y + row * 0.36, shape, va="center", fontsize=SMALL)
        if i < len(steps) - 1:
            _arrow(ax, (1.95, y), (1.95, y - row * 0.28))
        y -= row
    ax.text(0, row * len(steps) + 0.05, f"what each of t = {t} ranks holds, top to bottom",
            fontsize=SMALL)  # fmt: skip
    ax.set_xlim(-0.1, 6.4)
    ax.set_ylim(-0.1, row * len(steps) + 0.35)
    ax.axis("off")
    return fig
