"""Text in the chapters' figures is at least as large as the page's small print, shown
at the page's width: a figure's text, in points at its dpi, scaled by how wide its PNG
is shown on the page (``tools.figures.shown_widths``) over how wide it is."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import pytest
from PIL import Image

from labsupport.viz.style import figure
from tools import figures

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_text_is_scaled_by_how_wide_the_figure_is_shown():
    fig, ax = figure(6.0, 2.0)
    ax.set_title("title", fontsize=12)
    ax.text(0.5, 0.5, "note", fontsize=9)
    sizes = dict((text, size) for size, text in figures.text_on_the_page(fig, 600, 300))
    assert sizes["title"] == pytest.approx(12 * 100 / 72 / 2)  # 12 pt at 100 dpi, halved
    assert sizes["note"] == pytest.approx(9 * 100 / 72 / 2)


def test_every_chapter_figure_is_shown_and_drawn():
    assert set(figures.shown_widths()) == set(figures.FIGURES)
    assert figures.shown_widths()["11-schedules.png"] == figures.PAGE_PX  # :width: 100%


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_a_figures_text_is_no_smaller_than_the_pages_small_print(name):
    png_px = Image.open(figures.CHAPTERS / "figures" / name).size[0]
    sizes = figures.text_on_the_page(figures.FIGURES[name](), png_px, figures.shown_widths()[name])
    small = sorted((round(size, 1), text) for size, text in sizes if size < figures.SMALL_PRINT_PX)
    assert small == [], f"{name}: text smaller than {figures.SMALL_PRINT_PX} px on the page"
