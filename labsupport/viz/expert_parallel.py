"""Mixture of experts and expert parallelism, drawn: the tokens each expert gets from each
rank, the dispatch all-to-all from its real split sizes, the imbalance over training
steps, and a step's time against the busiest rank's work.

A token keeps the colour of the rank it came from, as in every figure of the course.
"""

from __future__ import annotations

from matplotlib.patches import Polygon, Rectangle

from labsupport.viz.style import PAGE_WIDTH, figure, rank_color, subplots

BAND = "#f0f0f0"  # the background of every other rank's experts


def draw_tokens_per_expert(per_rank: list[list[int]], title: str = ""):
    """Tokens each expert computes, stacked by the rank they came from (``per_rank[r][e]``:
    rank ``r``'s rows for expert ``e``), the experts grouped by the rank that holds them
    (top); and the rows each rank computes, against the mean (below)."""
    ep, n_expert = len(per_rank), len(per_rank[0])
    local = n_expert // ep
    fig, (top, below) = subplots(2, 1, PAGE_WIDTH, 6.2, gridspec_kw={"height_ratios": [1.5, 1]})
    for holder in range(ep):
        if holder % 2 == 0:
            top.axvspan(holder * local - 0.5, (holder + 1) * local - 0.5, color=BAND, zorder=0)
        top.text(
            (holder + 0.5) * local - 0.5,
            0.98,
            f"on rank {holder}",
            ha="center",
            va="top",
            transform=top.get_xaxis_transform(),
        )
    bottom = [0] * n_expert
    for r, counts in enumerate(per_rank):
        top.bar(
            range(n_expert),
            counts,
            bottom=bottom,
            color=rank_color(r),
            width=0.7,
            label=f"from rank {r}",
            zorder=2,
        )
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    mean = sum(bottom) / n_expert
    top.axhline(mean, color="black", linestyle="--", linewidth=1, zorder=3)
    top.set_xticks(range(n_expert), [f"e{e}" for e in range(n_expert)])
    top.set_ylim(0, 1.18 * max(bottom))
    top.set_ylabel("rows computed")
    top.set_title(title or "rows per expert, by the rank they came from", loc="left")
    top.legend(ncols=ep, loc="upper left", bbox_to_anchor=(0, -0.12), frameon=False,
               handlelength=1.2, columnspacing=1.2)  # fmt: skip
    rows = [sum(bottom[h * local : (h + 1) * local]) for h in range(ep)]
    below.bar(range(ep), rows, color=[rank_color(h) for h in range(ep)], width=0.6)
    below.axhline(sum(rows) / ep, color="black", linestyle="--", linewidth=1)
    below.set_xticks(range(ep), [f"rank {h}" for h in range(ep)])
    below.set_ylabel("rows computed")
    below.set_title(
        f"rows per rank: busiest {max(rows) / (sum(rows) / ep):.2f}x the mean", loc="left"
    )
    fig.tight_layout(h_pad=1.5)
    return fig


def draw_dispatch(sent: list[list[int]], title: str = "dispatch: all_to_all_single"):
    """The dispatch all-to-all from its split sizes, ``sent[i][j]`` rows from rank ``i`` to
    rank ``j``: each rank's rows before (grouped by destination) and after (grouped by
    source), a band for each message; the combine sends them back the same way."""
    ep = len(sent)
    fig, ax = figure(0.8 * PAGE_WIDTH, 0.8 + 1.25 * ep)
    ax.set_position((0, 0, 1, 1 - 0.4 / (0.8 + 1.25 * ep)))  # the whole width: no axes drawn
    scale = 1.0 / max(
        max(sum(row) for row in sent), max(sum(col) for col in zip(*sent, strict=True))
    )
    gap, x_out, width = 0.25, 3.6, 0.75
    top = [(ep - i) * (1 + gap) - gap for i in range(ep)]  # each rank's slot, from the top
    filled = list(top)  # how far down each destination's stack has grown
    for i, row in enumerate(sent):
        y = top[i]
        ax.text(-0.1, y - 0.5, f"rank {i}", ha="right", va="center")
        ax.text(x_out + width + 0.1, y - 0.5, f"rank {i}", ha="left", va="center")
        for j, n in enumerate(row):
            if not n:
                continue
            h, y_in, color = n * scale, filled[j], rank_color(i)
            ax.add_patch(Rectangle((0, y - h), width, h, facecolor=color, edgecolor="white"))
            ax.add_patch(Rectangle((x_out, y_in - h), width, h, facecolor=color, edgecolor="white"))
            band = [(width, y), (width, y - h), (x_out, y_in - h), (x_out, y_in)]
            alpha = 0.12 if i == j else 0.3  # the rows that stay on their rank: faint
            ax.add_patch(Polygon(band, facecolor=color, alpha=alpha, edgecolor="none"))
            ax.text(width / 2, y - h / 2, f"{n}→{j}", ha="center", va="center")
            y -= h
            filled[j] -= h
    ax.text(0, ep * (1 + gap) - 0.05, "sends, by destination", ha="left")
    ax.text(x_out + width, ep * (1 + gap) - 0.05, "receives, by source", ha="right")
    ax.set_xlim(-0.75, x_out + width + 0.75)
    ax.set_ylim(-0.1, ep * (1 + gap) + 0.3)
    ax.set_title(title, loc="left", family="monospace")
    ax.axis("off")
    return fig


def draw_balancing(curves: dict, title: str = "load balance while training"):
    """The imbalance (busiest expert's load over the mean) of each run, step by step."""
    fig, ax = figure(7.5, 3.2)
    styles = ["-", "--", ":", "-."]
    for (label, values), style in zip(curves.items(), styles, strict=False):
        ax.plot(range(1, len(values) + 1), values, style, color="#333333", label=label)
    ax.axhline(1.0, color="#999999", linewidth=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("busiest expert / mean")
    ax.set_title(title, loc="left")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_step_times(runs: dict):
    """For each run (``runs[label]``: per rank ``{"waited", "step"}``), the seconds each
    rank waited for its experts, and the step's measured time (the line)."""
    fig, ax = figure(7.0, 3.0)
    for g, (label, ranks) in enumerate(runs.items()):
        x0 = g * (len(ranks) + 1.5)
        for r, result in enumerate(ranks):
            ax.bar(x0 + r, result["waited"], color=rank_color(r), width=0.8)
        step = ranks[0]["step"]
        ax.hlines(step, x0 - 0.5, x0 + len(ranks) - 0.5, color="black", linewidth=2)
        ax.text(
            x0 + (len(ranks) - 1) / 2,
            step,
            f"step {step:.2f} s",
            ha="center",
            va="bottom",
            fontsize=8,
        )
        ax.text(
            x0 + (len(ranks) - 1) / 2,
            -0.08,
            label,
            ha="center",
            va="top",
            fontsize=9,
            transform=ax.get_xaxis_transform(),
        )
    ax.set_xticks([])
    ax.set_ylabel("seconds")
    ax.set_title("each rank's wait for its experts (bars) and the step (line)", loc="left")
    fig.tight_layout()
    return fig


def draw_total_active(models: dict):
    """Each model's parameters (``models[name]``: :func:`labsupport.estimate.moe.
    moe_params`' dict and its ``top_k``/``n_expert``): those every token uses, the routed
    experts one token uses, and the routed experts it does not; the counts above each bar."""
    fig, ax = figure(0.85 * PAGE_WIDTH, 1.9 + 0.75 * len(models))
    parts = [
        ("used by every token", "#555555"),
        ("routed experts a token uses", "#999999"),
        ("routed experts it does not use", "#dddddd"),
    ]
    for y, (name, m) in enumerate(reversed(list(models.items()))):
        used = m["routed experts"] * m["top_k"] / m["n_expert"]
        sizes = [m["active"] - used, used, m["routed experts"] - used]
        left = 0.0
        for (label, color), size in zip(parts, sizes, strict=True):
            ax.barh(
                y,
                size / m["total"],
                left=left,
                height=0.5,
                color=color,
                edgecolor="white",
                label=label if y == 0 else None,
            )
            left += size / m["total"]
        total, active = m["total"] / 1e9, m["active"] / 1e9
        ax.text(0, y + 0.3, f"{name}: {total:.1f}B total, {active:.1f}B active", va="bottom")
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.35, len(models) - 0.1)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0], ["0", "25%", "50%", "75%", "100%"])
    ax.set_xlabel("share of the parameters")
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.32), frameon=False)
    ax.set_title("total and active parameters", loc="left")
    fig.tight_layout()
    return fig
