"""One figure style for the whole course, and one colour per rank.

Every figure in the book and the labs is drawn here with matplotlib, so rank 2 is the
same green in the chapter on collectives as in the chapter on ZeRO. The palette is
Okabe and Ito's, chosen to stay distinguishable for colour-blind readers
(https://jfly.uni-koeln.de/color/).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

RANK_COLORS = (
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#009E73",  # green
    "#CC79A7",  # purple
    "#56B4E9",  # sky blue
    "#D55E00",  # vermilion
    "#F0E442",  # yellow
    "#999999",  # grey
)

STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.hashsalt": "labsupport",
}


def rank_color(rank: int) -> str:
    """The colour of ``rank`` in every figure of the course."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


def figure(width: float = 7.0, height: float = 3.0):
    """A new figure and axes in the course style.

    The style is set in ``rcParams`` for the session rather than inside
    ``plt.rc_context``: leaving that context also resets the backend Jupyter chose,
    and the inline backend then stops showing figures.
    """
    plt.rcParams.update(STYLE)
    return plt.subplots(figsize=(width, height))


def subplots(rows: int, cols: int, width: float, height: float, **kwargs):
    """A figure of ``rows`` x ``cols`` axes in the course style (``plt.subplots``)."""
    plt.rcParams.update(STYLE)
    return plt.subplots(rows, cols, figsize=(width, height), **kwargs)
