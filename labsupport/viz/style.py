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

#: The smallest text of any figure, in points (the style's default size too): 14.6 px
#: at 100 dpi, shown at its own size, as a lab's figure is: no smaller than the page's
#: small print, its code (14 px).
SMALL = 10.5
#: How wide a figure may be drawn, in inches at 100 dpi, to be shown at the page's full
#: width (660 px in a 1280 px window) with that text still 14 px or more (it is shown
#: at most at its own size, 650 px, with a margin for what is drawn outside the axes). A
#: figure shown at 80 % of the page is drawn 80 % as wide (tools.figures checks them).
PAGE_WIDTH = 6.5

STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "font.size": SMALL,
    "axes.titlesize": 11.5,
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
