"""What the website shows, checked on its sources: the chapters' markdown as MyST reads it,
and the outputs stored in the labs. (The built site itself is opened in a browser by
tests/browser/test_site.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from markdown_it.renderer import RendererHTML
from myst_parser.config.main import MdParserConfig
from myst_parser.parsers.mdit import create_md_parser

ROOT = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
MYST = create_md_parser(
    MdParserConfig(enable_extensions=set(CONFIG["parse"]["myst_enable_extensions"])), RendererHTML
)
PAGES = sorted(ROOT.glob("chapters/*.md")) + [
    ROOT / name
    for name in ("intro.md", "glossary.md", "setup.md", "references.md", "calculators.md")
]
LABS = sorted(ROOT.glob("labs/*.ipynb"))


def lists_inside_a_paragraph(text: str) -> list[str]:
    """Lines where a list starts straight after a paragraph's line, with no blank line.

    Markdown lets a bullet ("- ", "* ", "+ ") or a "1." interrupt a paragraph, so a wrapped
    line that happens to begin with one of them turns the rest of the sentence into a list
    (chapter 11's "... stage 0 already runs micro-batch / 1. All forwards first" did). The
    course's pages put a blank line before every list they mean.
    """
    lines = text.split("\n")
    tokens = MYST.parse(text)
    found, paragraph = [], None
    for before, token in zip([None, *tokens], tokens, strict=False):
        if token.type == "paragraph_open":
            paragraph = token
        if (
            token.type in ("bullet_list_open", "ordered_list_open")
            and before is not None
            and before.type == "paragraph_close"
            and paragraph.map[1] == token.map[0]
        ):
            n = token.map[0]
            found.append(f"line {n + 1}: {lines[n - 1].strip()!r} / {lines[n].strip()!r}")
    return found


def test_a_wrapped_line_that_starts_like_a_list_is_found():
    assert lists_inside_a_paragraph("runs micro-batch\n1. All forwards first.\n") == [
        "line 2: 'runs micro-batch' / '1. All forwards first.'"
    ]
    assert lists_inside_a_paragraph("that is 699 GB / 50 GB/s\n+ 2,046 × 5 µs.\n") != []
    assert lists_inside_a_paragraph("Three steps:\n\n1. one\n2. two\n") == []
    assert lists_inside_a_paragraph("a sum of\n2. terms is not a list\n") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_no_list_starts_inside_a_paragraph(page):
    assert lists_inside_a_paragraph(page.read_text()) == []


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_no_list_starts_inside_a_paragraph_of_a_lab(lab):
    cells = json.loads(lab.read_text())["cells"]
    found = [
        f"cell {i}, {line}"
        for i, cell in enumerate(cells)
        if cell["cell_type"] == "markdown"
        for line in lists_inside_a_paragraph("".join(cell["source"]))
    ]
    assert found == []


def empty_outputs(notebook: Path) -> list[str]:
    """The stored outputs that show nothing but an empty box on the website: a stream or a
    display whose text is empty, and no image, HTML or widget beside it. (A display with
    no data at all, what a launch's live area ends as, is left out of the page.)"""
    found = []
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                shown = {"text": output["text"]}
            elif output["output_type"] in ("display_data", "execute_result"):
                shown = output["data"]
            else:
                continue
            if shown and all(not "".join(value).strip() for value in shown.values()):
                found.append(f"cell {i}: {output['output_type']} {json.dumps(shown)}")
    return found


def test_an_empty_output_is_found(tmp_path):
    notebook = tmp_path / "lab.ipynb"
    outputs = [
        {"output_type": "display_data", "data": {"text/plain": []}, "metadata": {}},
        {"output_type": "stream", "name": "stdout", "text": ["\n"]},
        {"output_type": "stream", "name": "stdout", "text": ["[rank 0] done\n"]},
        {"output_type": "display_data", "data": {"image/png": "iVBO", "text/plain": [""]}},
    ]
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "outputs": outputs}]}))
    assert len(empty_outputs(notebook)) == 2


def test_no_lab_stores_an_empty_output():
    found = {lab.name: empty_outputs(lab) for lab in LABS}
    assert {name: cells for name, cells in found.items() if cells} == {}


def test_the_sites_chinese_font_has_every_chinese_character_of_the_site():
    from fontTools.ttLib import TTFont

    from tools import cjk_font

    served = set(map(chr, TTFont(cjk_font.OUT).getBestCmap()))
    missing = cjk_font.site_characters() - served
    assert not missing, (
        f"{''.join(sorted(missing))}: not in {cjk_font.OUT.name}; run `python -m "
        "tools.cjk_font` (its docstring says where the font comes from) and commit the result"
    )
    assert cjk_font.OUT.stat().st_size < 100_000
    css = (ROOT / "_assets" / "course.css").read_text()
    ranges = ", ".join(f"U+{lo:04X}-{hi:04X}" for lo, hi in cjk_font.CJK_RANGES)
    assert f"unicode-range: {ranges};" in css, "the CSS loads the font for other characters"
