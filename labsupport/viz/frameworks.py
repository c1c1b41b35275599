"""Chapter 15, drawn: the layers of one training process, coloured by the project that
provides each."""

from __future__ import annotations

import textwrap

from labsupport.viz.style import PAGE_WIDTH, figure, rank_color


def stack_figure(stack, providers, title: str):
    """One bar per layer of ``stack`` (``(layer, provider, what runs there)``, top to
    bottom), coloured by its provider, one colour per name of ``providers`` in order: the
    provider's name on the bar, what runs there below it, the layer's name left of it."""
    colors = {name: rank_color(i) for i, name in enumerate(providers)}
    fig, ax = figure(PAGE_WIDTH, 0.46 * len(stack) + 0.6)
    for row, (_, provider, what) in enumerate(stack):
        y = len(stack) - 1 - row
        ax.barh(y, 1.0, left=0.0, height=0.9, color=colors[provider], alpha=0.85)
        ax.text(0.015, y + 0.2, provider, va="center", ha="left", fontweight="bold")
        ax.text(0.015, y - 0.2, what, va="center", ha="left")
    names = [textwrap.fill(layer, 13, break_long_words=False) for layer, _, _ in reversed(stack)]
    ax.set_yticks(range(len(stack)), names)
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, len(stack) - 0.5)
    ax.set_xticks([])
    ax.spines[["left", "bottom"]].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set_title(title, loc="left")
    fig.tight_layout()
    return fig
