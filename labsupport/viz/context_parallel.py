"""Context parallelism, drawn: the causal score matrix cut into chunks with each block in
the colour of the rank that computes it, step by step around the ring; the work per rank
without and with zig-zag; the bytes each variant sends; activation memory against cp.

The blocks come from the ring's own schedule
(:func:`labsupport.parallel.context_parallel.ring_schedule`) or from a run's count
(:func:`labsupport.parallel.blockwise_attention.count_work`); the bytes and the memory
are the formulas of :mod:`labsupport.estimate.context_parallel`: models, drawn, not
measurements.
"""

from __future__ import annotations

from matplotlib.patches import Polygon, Rectangle

from labsupport.estimate import context_parallel as est
from labsupport.estimate.planner import stage_layers
from labsupport.estimate.published import MODELS
from labsupport.parallel.context_parallel import Layout, ring_schedule
from labsupport.viz.style import PAGE_WIDTH, SMALL, rank_color, subplots

MASKED_ALPHA = 0.3  # the half of a diagonal block the causal mask hides, computed anyway


def draw_blocks(ax, by_rank: list, n_chunks: int, title: str = "") -> None:
    """The score matrix, query chunks down and key chunks across: each block
    ``(query chunk, key chunk, kind)`` of ``by_rank[r]`` in rank ``r``'s colour; a
    diagonal block's hidden half pale. Blank: blocks no rank computes."""
    size = 1 / n_chunks
    for rank, blocks in enumerate(by_rank):
        color = rank_color(rank)
        for a, b, kind in blocks:
            x, y = b * size, a * size
            alpha = MASKED_ALPHA if kind == "diagonal" else 1.0
            ax.add_patch(Rectangle((x, y), size, size, facecolor=color, alpha=alpha, lw=0))
            if kind == "diagonal":  # the keys at or before each query: lower left
                corners = [(x, y), (x, y + size), (x + size, y + size)]
                ax.add_patch(Polygon(corners, facecolor=color, edgecolor="none"))
    for i in range(n_chunks + 1):
        ax.axhline(i * size, color="white", lw=1.2)
        ax.axvline(i * size, color="white", lw=1.2)
    ax.plot([0, 1], [0, 1], color="#444444", lw=0.7, ls=":")
    ax.set_xlim(0, 1)
    ax.set_ylim(1, 0)
    ax.set_aspect("equal")
    ticks = [(i + 0.5) * size for i in range(n_chunks)]
    ax.set_xticks(ticks, [str(i) for i in range(n_chunks)])
    ax.set_yticks(ticks, [str(i) for i in range(n_chunks)])
    ax.tick_params(length=0)
    ax.set_xlabel("key chunk")
    ax.set_ylabel("query chunk")
    if title:
        ax.set_title(title, fontsize=SMALL)


def ring_steps_figure(steps: list, n_chunks: int, title: str = ""):
    """One panel per step of the ring, two to a row: the blocks each rank computes at that
    step (``steps[step][rank]`` is ``(src, blocks)``, as
    :func:`~labsupport.parallel.context_parallel.ring_schedule` gives)."""
    cp = len(steps)
    rows = -(-cp // 2)
    fig, axes = subplots(rows, 2, PAGE_WIDTH, 3.3 * rows + (0.3 if title else 0), squeeze=False)
    for ax in axes.flat[cp:]:
        ax.axis("off")
    for step, (ax, row) in enumerate(zip(axes.flat, steps, strict=False)):
        draw_blocks(ax, [blocks for _, blocks in row], n_chunks)
        held = ", ".join(f"{rank}←{src}" for rank, (src, _) in enumerate(row))
        ax.set_title(f"step {step}\nrank←K/V of rank: {held}", fontsize=SMALL)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw_work(ax, work: dict, title: str = "") -> None:
    """Bars per rank: ``work[layout]`` lists the score blocks each rank computes."""
    layouts = list(work)
    width = 0.8 / len(layouts)
    for i, layout in enumerate(layouts):
        values = work[layout]
        xs = [r + (i - (len(layouts) - 1) / 2) * width for r in range(len(values))]
        bars = ax.bar(xs, values, width, color=[rank_color(r) for r in range(len(values))])
        for bar in bars:
            bar.set_alpha(0.45 if i == 0 else 1.0)
        for x, v in zip(xs, values, strict=True):
            ax.text(x, v + 0.2, f"{v:g}", ha="center")
        mean = sum(values) / len(values)
        label = f"{layout}: slowest {est.imbalance(values):.2f}x the mean"
        ax.plot([], [], color="#777777", alpha=0.45 if i == 0 else 1.0, lw=6, label=label)
        ax.axhline(mean, color="#777777", lw=0.6, ls="--")
    ax.set_xticks(range(len(work[layouts[0]])), [f"rank {r}" for r in range(len(work[layouts[0]]))])
    ax.set_ylabel("blocks of (s/2cp)²")
    ax.set_ylim(0, 1.45 * max(max(values) for values in work.values()))
    ax.legend(fontsize=SMALL, frameon=False, loc="upper left")
    if title:
        ax.set_title(title, fontsize=SMALL)


def _all_steps(lay: Layout) -> list:
    """Every block each rank computes over the whole ring."""
    steps = ring_schedule(lay)
    return [[b for row in steps for b in row[rank][1]] for rank in range(lay.cp)]


def balance_figure(cp: int = 4):
    """The causal score matrix over ``cp`` ranks, contiguous and zig-zag side by side (each
    block in the colour of the rank that computes it), and the blocks per rank below."""
    fig, _ = subplots(1, 1, PAGE_WIDTH, 6.6)
    fig.clear()
    grid = fig.add_gridspec(2, 2, height_ratios=[1.25, 1])
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])]
    counts = {}
    for ax, name in zip(axes[:2], ("contiguous", "zigzag"), strict=True):
        lay = Layout.contiguous(cp) if name == "contiguous" else Layout.zigzag(cp)
        by_rank = _all_steps(lay)
        unit = (2 * cp // lay.n_chunks) ** 2  # blocks of (s/2cp)² scores
        counts[name] = [unit * len(blocks) for blocks in by_rank]
        chunks = "; ".join(f"{r}: {list(c)}" for r, c in enumerate(lay.chunks))
        draw_blocks(ax, by_rank, lay.n_chunks, f"{name}, chunks per rank\n{chunks}")
    draw_work(axes[2], counts, "score blocks per rank (causal)")
    fig.tight_layout()
    return fig


def variants_figure(seq_len: int = 131072, heads: int = 32, head_dim: int = 128, cps=None):
    """Bytes each rank sends per attention layer (forward and backward, bf16) for the
    ring, all-gather K/V and Ulysses, against cp: multi-head attention (as many K/V heads
    as query heads) and grouped-query attention (8 K/V heads). Ulysses stops where cp
    exceeds the K/V heads."""
    cps = cps or [2, 4, 8, 16, 32]
    fig, axes = subplots(1, 2, PAGE_WIDTH, 4.2, sharey=True)
    for ax, kv_heads in zip(axes, (heads, 8), strict=True):
        for variant in est.VARIANTS:
            xs = [c for c in cps if variant != "ulysses" or c <= kv_heads]
            ys = [
                est.bytes_per_rank(variant, 1, seq_len, heads, kv_heads, head_dim, c, 2, 2)["total"]
                / 1e9
                for c in xs
            ]
            color = rank_color(est.VARIANTS.index(variant))
            style = (0, (4, 3)) if variant == "all_gather" else "-"
            label = {
                "ring": "ring",
                "all_gather": "all-gather K/V (the ring's bytes)",
                "ulysses": "Ulysses",
            }[variant]
            ax.plot(xs, ys, ls=style, marker="o", ms=3, color=color, label=label)
            if variant == "ulysses" and xs[-1] < cps[-1]:
                ax.annotate(
                    f"Ulysses stops at\ncp = {xs[-1]}: cp cannot\nexceed the K/V heads",
                    (xs[-1], ys[-1]),
                    xytext=(0.05, 0.6),
                    textcoords="axes fraction",
                    va="center",
                    arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.8},
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(cps, [str(c) for c in cps])
        ax.set_xlabel("cp")
        kind = "multi-head" if kv_heads == heads else "grouped-query"
        ax.set_title(f"{kind}:\n{heads} query heads, {kv_heads} K/V", fontsize=SMALL)
    axes[0].set_ylabel("GB sent per rank and layer")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncols=3, frameon=False)
    fig.suptitle(f"one sequence of {seq_len:,} tokens, head dim {head_dim}, bf16 (a model)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def memory_figure(model: str = "Llama 3 405B", seq_len: int = 131072, tp: int = 8, pp: int = 16):
    """Activation bytes per GPU of one pipeline stage for one sequence, with tensor and
    sequence parallelism over ``tp``, against cp: with the attention scores kept and
    without them (FlashAttention, selective recomputation). Korthikanti et al.'s count
    for a GPT layer (a model of the model), against an 80 GB GPU."""
    m = MODELS[model]
    layers = stage_layers(m, pp)
    cps = [1, 2, 4, 8, 16]
    fig, ax = subplots(1, 1, 0.85 * PAGE_WIDTH, 3.8)
    for i, (policy, label) in enumerate(
        (("none", "scores kept"), ("selective", "FlashAttention (no scores kept)"))
    ):
        ys = [
            est.activation_per_gpu(seq_len, 1, m.hidden, m.heads, layers, tp, c, policy) / 1e9
            for c in cps
        ]
        ax.plot(cps, ys, marker="o", color=rank_color(i), label=label)
        for c, y in zip(cps, ys, strict=True):
            ax.text(c, y * 1.35, f"{y:,.0f}" if y >= 10 else f"{y:.1f}", ha="center")
    ax.axhline(80, color="#777777", ls="--", lw=0.8)
    ax.text(1.9, 95, "80 GB: one H100", color="#555555")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.set_xlabel("cp")
    ax.set_ylabel("GB per GPU")
    ax.set_title(
        f"{model}: one stage ({layers} layers), {seq_len:,} tokens,\n"
        f"TP {tp} + sequence parallel (a model, GPT-style layers)",
        fontsize=SMALL,
    )
    ax.set_ylim(1, ax.get_ylim()[1] * 3)
    ax.set_xlim(0.8, 20)
    ax.legend(fontsize=SMALL, frameon=False, loc="lower left")
    fig.tight_layout()
    return fig


def activations_figure(rows: list[dict]):
    """Measured bytes saved per rank against cp, and one process's divided by cp."""
    alone = next(r["bytes"] for r in rows if r["cp"] == 1)
    fig, ax = subplots(1, 1, 6.0, 3.2)
    for i, r in enumerate(rows):
        ax.bar(i, r["bytes"] / 1e3, 0.7, color=rank_color(r["rank"]))
        ax.text(i, r["bytes"] / 1e3 + 1, f"{r['bytes']:,}", ha="center", fontsize=7)
    for i, r in enumerate(rows):
        ax.plot([i - 0.4, i + 0.4], [alone / r["cp"] / 1e3] * 2, color="black", lw=1)
    ax.set_xticks(range(len(rows)), [f"cp={r['cp']}\nrank {r['rank']}" for r in rows], fontsize=7)
    ax.set_ylabel("kB saved for backward")
    ax.set_title(
        "the GPT's blocks, one sequence: measured per rank; line: one process / cp", fontsize=9
    )
    fig.tight_layout()
    return fig
