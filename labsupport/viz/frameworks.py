"""Chapter 15, drawn: the layers of one training process, coloured by the project that
provides each."""

from __future__ import annotations

from labsupport.viz.style import figure, rank_color


def stack_figure(stack, providers, title: str):
    """One bar per layer of ``stack`` (``(layer, provider, what runs there)``, top to
    bottom), coloured by its provider, one colour per name of ``providers`` in order."""
    colors = {name: rank_color(i) for i, name in enumerate(providers)}
    fig, ax = figure(9.0, 0.42 * len(stack) + 0.8)
    for row, (_, provider, what) in enumerate(stack):
        y = len(stack) - 1 - row
        ax.barh(y, 1.0, left=0.0, height=0.82, color=colors[provider], alpha=0.85)
        ax.text(0.015, y, provider, va="center", ha="left", fontsize=9, fontweight="bold")
        ax.text(0.2, y, what, va="center", ha="left", fontsize=9)
    ax.set_yticks(range(len(stack)), [layer for layer, _, _ in reversed(stack)])
    ax.set_xlim(0, 1)
    ax.set_xticks([])
    ax.spines[["left", "bottom"]].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set_title(title, loc="left")
    return fig
