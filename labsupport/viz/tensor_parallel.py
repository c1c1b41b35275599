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
from labsupport.viz.style import figure, rank_color, subplots

WHOLE = "#d9d9d9"  # a tensor every rank holds whole
SUM = "#555555"  # a sum over the ranks


def _matrix(ax, x, y, rows, cols, colors, axis, label, cell=0.32):
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
    ax.text(x + cols * cell / 2, y + 0.15, label, ha="center", va="bottom", fontsize=9)
    return x + cols * cell


def draw_linear_split(t: int = 4, in_features: int = 8, out_features: int = 12, rows: int = 3):
    """``Y = X Aᵀ`` with ``A`` (``out x in``) split over ``t`` ranks: by columns of ``Aᵀ``
    (each rank its output features, then an all-gather) and by rows of ``Aᵀ`` (each rank
    its input features, partial sums, then an all-reduce)."""
    ranks = [rank_color(r) for r in range(t)]
    fig, (left, right) = subplots(1, 2, 13.0, 3.6)
    c = 0.32
    x = _matrix(left, 0, 0, rows, in_features, [WHOLE], 0, "X (every rank)")
    left.text(x + 0.25, -rows * c / 2, "×", fontsize=14, va="center")
    x = _matrix(left, x + 0.7, 0, in_features, out_features, ranks, 1, "Aᵀ: rank r holds columns r")
    left.text(x + 0.25, -rows * c / 2, "=", fontsize=14, va="center")
    x = _matrix(left, x + 0.7, 0, rows, out_features, ranks, 1, "Y_r = X A_rᵀ on rank r")
    left.text(
        x - out_features * c / 2,
        -rows * c - 0.55,
        "all-gather (gather_output) → Y",
        ha="center",
        fontsize=9,
    )
    left.set_title("Column-parallel: split the output features", fontsize=10, loc="left")
    x = _matrix(right, 0, 0, rows, in_features, ranks, 1, "X: rank r uses columns r")
    right.text(x + 0.25, -rows * c / 2, "×", fontsize=14, va="center")
    x = _matrix(right, x + 0.7, 0, in_features, out_features, ranks, 0, "Aᵀ: rank r holds rows r")
    right.text(x + 0.25, -rows * c / 2, "=", fontsize=14, va="center")
    x = _matrix(right, x + 0.7, 0, rows, out_features, [SUM], 0, "Σ over r of X_r A_rᵀ")
    right.text(
        x - out_features * c / 2,
        -rows * c - 0.55,
        "all-reduce (g) of the partial sums",
        ha="center",
        fontsize=9,
    )
    right.set_title("Row-parallel: split the input features", fontsize=10, loc="left")
    for ax in (left, right):
        ax.set_xlim(-0.2, x + 0.2)
        ax.set_ylim(-in_features * c - 0.3, 0.8)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


def draw_block(t: int = 2):
    """The parallel MLP and attention of a transformer block on ``t`` ranks: *f* before
    the column-parallel layer (identity forward, all-reduce backward), *g* after the
    row-parallel one (all-reduce forward, identity backward)."""
    fig, axes = subplots(2, 1, 11.0, 1.2 * t + 2.6)
    halves = [
        ("MLP", ["c_fc: X A_r\n(column)", "GeLU", "c_proj: Y_r B_r\n(row)"]),
        (
            "Attention",
            [
                "c_attn: Q, K, V\nof heads r (column)",
                "attention\nof heads r",
                "c_proj: Y_r B_r\n(row)",
            ],
        ),
    ]
    for ax, (name, steps) in zip(axes, halves, strict=True):
        _box(ax, 0, t / 2 - 0.35, 1.2, 0.7, "X", WHOLE)
        _box(ax, 1.7, t / 2 - 0.35, 0.9, 0.7, "f", "white")
        for r in range(t):
            y = t - 1 - r
            for i, text in enumerate(steps):
                _box(ax, 3.1 + 2.3 * i, y + 0.1, 2.0, 0.8, text, rank_color(r), alpha=0.55)
            ax.text(2.95, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=8)
        _box(ax, 10.1, t / 2 - 0.35, 0.9, 0.7, "g", "white")
        _box(ax, 11.5, t / 2 - 0.35, 1.2, 0.7, "Z", WHOLE)
        _arrow(ax, (1.2, t / 2), (1.7, t / 2))
        _arrow(ax, (11.0, t / 2), (11.5, t / 2))
        for r in range(t):
            y = t - 1 - r + 0.5
            _arrow(ax, (2.6, t / 2), (3.1, y))
            for i in range(len(steps) - 1):
                _arrow(ax, (5.1 + 2.3 * i, y), (5.4 + 2.3 * i, y))
            _arrow(ax, (9.7, y), (10.1, t / 2))
        ax.text(
            0,
            t + 0.25,
            f"{name}: f = identity forward, all-reduce backward; "
            "g = all-reduce forward, identity backward",
            fontsize=9,
        )
        ax.set_xlim(-0.1, 12.8)
        ax.set_ylim(-0.1, t + 0.6)
        ax.axis("off")
    fig.tight_layout()
    return fig


def _arrow(ax, start, end):
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "lw": 1.0})


def _box(ax, x, y, w, h, text, color, alpha=1.0):
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
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)


def draw_layer_costs(rows: list[dict], title: str):
    """Modelled compute and all-reduce time per layer and GPU for each tensor-parallel
    size (:func:`labsupport.estimate.tensor_parallel.layer_costs`)."""
    fig, ax = figure(7.5, 3.6)
    links = [k for k in rows[0] if k not in ("t", "compute")]
    width = 0.8 / (1 + len(links))
    for i, key in enumerate(["compute", *links]):
        xs = [j + (i - len(links) / 2) * width for j in range(len(rows))]
        label = "compute (forward + backward)" if key == "compute" else f"4 all-reduces, {key}"
        ax.bar(xs, [r[key] * 1e3 for r in rows], width, color=rank_color(i), label=label)
    ax.set_xticks(range(len(rows)), [f"t = {r['t']}" for r in rows])
    ax.set_ylabel("ms per layer and sequence")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    return fig


def draw_activations(model: str = "GPT-3 175B", t_values=(1, 2, 4, 8)):
    """Activation bytes per layer and GPU (one sequence, 16-bit, no recomputation) with
    tensor parallelism alone and with sequence parallelism (Korthikanti et al. 2022)."""
    m = MODELS[model]
    s, h, a = m["seq_len"], m["hidden"], m["heads"]
    fig, ax = figure(6.5, 3.4)
    for i, sp in enumerate((False, True)):
        values = [
            activation_memory(s, 1, h, a, 1, tensor_parallel=t, sequence_parallel=sp) / 1e9
            for t in t_values
        ]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(t_values))]
        label = "tensor + sequence parallel" if sp else "tensor parallel"
        ax.bar(xs, values, 0.38, color=rank_color(i), label=label)
        for x, v in zip(xs, values, strict=True):
            ax.text(x, v + 0.03, f"{v:.2f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(t_values)), [f"t = {t}" for t in t_values])
    ax.set_ylabel("GB per layer and GPU")
    ax.set_title(f"{model}: activations of one layer, one sequence of {s} tokens", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    return fig


def draw_sequence_parallel_shapes(t: int = 4):
    """One transformer block with tensor and sequence parallelism on ``t`` ranks, region
    by region, with the shape of the activation each rank holds there (``s`` tokens,
    ``b`` sequences, width ``h``, ``a`` heads): sequence-split around the LayerNorms,
    dropouts and residual additions, split by heads or hidden features inside attention
    and the MLP, all-gathers (*g*) and reduce-scatters (*ḡ*) between."""
    steps = [
        ("LayerNorm,\ndropout,\nresidual", f"s/{t} × b × h", "sequence"),
        ("g:\nall-gather", "", "collective"),
        ("Q, K, V\n(column)", f"s × b × 3h/{t}", "split"),
        ("attention\nof a/t heads", f"s × b × h/{t}", "split"),
        ("out proj.\n(row)", "s × b × h\npartial sums", "sum"),
        ("ḡ:\nreduce-\nscatter", "", "collective"),
        ("LayerNorm,\ndropout,\nresidual", f"s/{t} × b × h", "sequence"),
        ("g:\nall-gather", "", "collective"),
        ("MLP up,\nGeLU\n(column)", f"s × b × 4h/{t}", "split"),
        ("MLP down\n(row)", "s × b × h\npartial sums", "sum"),
        ("ḡ:\nreduce-\nscatter", "", "collective"),
    ]
    colors = {"sequence": rank_color(0), "split": rank_color(1), "sum": SUM, "collective": "white"}
    fig, ax = figure(14.0, 2.6)
    x = 0.0
    for i, (name, shape, kind) in enumerate(steps):
        w = 0.9 if kind == "collective" else 1.45
        _box(ax, x, 0.9, w, 0.9, name, colors[kind], alpha=1.0 if kind == "collective" else 0.45)
        if shape:
            ax.text(x + w / 2, 0.55, shape, ha="center", va="top", fontsize=8)
        if i < len(steps) - 1:
            _arrow(ax, (x + w, 1.35), (x + w + 0.15, 1.35))
        x += w + 0.15
    ax.text(
        0,
        2.05,
        f"per rank, t = {t}: the sequence split (s/{t} tokens) where each token is computed "
        "alone; heads or hidden features split inside attention and the MLP",
        fontsize=9,
    )
    ax.set_xlim(-0.1, x)
    ax.set_ylim(0, 2.3)
    ax.axis("off")
    return fig
