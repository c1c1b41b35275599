"""The Chinese characters of the website, as a font the site serves: ``python -m
tools.cjk_font [FONT]``.

The glossary and the chapters give each term in Chinese too. A reader whose machine has
no Chinese font would see empty boxes, so the site serves the few hundred characters it
uses, cut from Noto Sans CJK SC (SIL Open Font License 1.1, see _assets/fonts/OFL.txt),
as _assets/fonts/course-cjk.woff: tens of kilobytes instead of the font's 16 MB.
_assets/course.css loads it for those characters only (``unicode-range``), after the
reader's own fonts, so a machine with a Chinese font keeps using its own.

FONT is Debian's ``fonts-noto-cjk`` file by default (``apt-get download fonts-noto-cjk``
and ``dpkg-deb -x`` it anywhere to regenerate without installing it). Run this again when
a page gains a Chinese character: tests/test_site_content.py fails until then.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "_assets" / "fonts" / "course-cjk.woff"
NOTO = Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")
FACE = "Noto Sans CJK SC"

#: The Unicode blocks the font covers; _assets/course.css's unicode-range says the same.
CJK_RANGES = (
    (0x3000, 0x303F),  # CJK symbols and punctuation: 、。「」
    (0x3400, 0x4DBF),  # CJK unified ideographs, extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF00, 0xFFEF),  # full-width forms: ，：（）
)


def is_cjk(char: str) -> bool:
    return any(lo <= ord(char) <= hi for lo, hi in CJK_RANGES)


def _strings(value):
    """Every string inside a notebook's JSON (its cells' sources and outputs)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def site_sources() -> list[Path]:
    """The files the website is built from."""
    return [
        *sorted(ROOT.glob("*.md")),
        *sorted(ROOT.glob("chapters/*.md")),
        *sorted(ROOT.glob("labs/*.ipynb")),
        ROOT / "references.bib",
    ]


def site_characters() -> set[str]:
    """The CJK characters of every page of the site."""
    found = set()
    for path in site_sources():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":
            text = "".join(_strings(json.loads(text)))
        found.update(char for char in text if is_cjk(char))
    return found


def subset(font: Path = NOTO, out: Path = OUT) -> int:
    """Write the site's characters of ``font`` (face ``FACE`` of a collection) to ``out``
    as WOFF; returns its size in bytes."""
    from fontTools import subset as ft_subset
    from fontTools.ttLib import TTCollection, TTFont

    # recalcTimestamp=False: the same bytes on every run, dated as the source font is
    if font.suffix.lower() == ".ttc":
        faces = TTCollection(font, lazy=True, recalcTimestamp=False).fonts
        source = next(f for f in faces if f["name"].getDebugName(1) == FACE)
    else:
        source = TTFont(font, recalcTimestamp=False)
    options = ft_subset.Options()
    options.flavor = "woff"  # zlib: no brotli needed to read it back in the tests
    options.hinting = False
    options.layout_features = []  # horizontal text, one glyph per character
    options.drop_tables += ["BASE", "GDEF", "GPOS", "GSUB", "VORG", "vhea", "vmtx"]
    options.name_IDs = [0, 1, 2, 3, 4, 5, 6, 7, 13, 14]  # keep the copyright and licence
    subsetter = ft_subset.Subsetter(options)
    subsetter.populate(unicodes=[ord(c) for c in sorted(site_characters())])
    subsetter.subset(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    source.flavor = "woff"
    source.save(out)
    return out.stat().st_size


if __name__ == "__main__":
    size = subset(Path(sys.argv[1]) if len(sys.argv) > 1 else NOTO)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(site_characters())} characters, {size:,} bytes")
