"""The built website, opened in a real headless Chromium (Debian's, driven by Playwright).

Run after ``make book``: serves ``_build/html`` on 127.0.0.1 and visits every page in
``_toc.yml``. The browser is started with background networking off, as this machine
has no network beyond its package registries: every asset a page needs must be served
from the site itself.
"""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "_build" / "html"


def toc_pages() -> list[str]:
    """Every page of _toc.yml, as a path relative to the site root, without suffix."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]]
    stack = list(toc.get("parts", [])) + list(toc.get("chapters", []))
    while stack:
        entry = stack.pop(0)
        if "file" in entry:
            pages.append(entry["file"])
        stack[:0] = entry.get("chapters", []) + entry.get("sections", [])
    return [str(Path(p).with_suffix("")) for p in pages]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").exists():
        pytest.fail("no website in _build/html: run `make book` first (`make browser` does)")
    handler = functools.partial(QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.problems = []
    page.on(
        "console",
        lambda msg: (
            page.problems.append(f"console {msg.type}: {msg.text}") if msg.type == "error" else None
        ),
    )
    page.on("pageerror", lambda exc: page.problems.append(f"page error: {exc}"))
    page.on(
        "requestfailed",
        lambda req: page.problems.append(f"request failed: {req.url} ({req.failure})"),
    )
    page.on(
        "response",
        lambda resp: (
            page.problems.append(f"HTTP {resp.status}: {resp.url}") if resp.status >= 400 else None
        ),
    )
    yield page
    context.close()


@pytest.mark.parametrize("path", toc_pages())
def test_every_page_in_the_toc_loads_cleanly(page, site_url, path):
    page.goto(f"{site_url}/{path}.html", wait_until="networkidle")
    assert page.locator("main h1").count() >= 1, f"{path}: no title"
    assert page.problems == [], "\n".join(page.problems)


def test_the_lab_page_shows_its_outputs_and_figures(page, site_url):
    page.goto(f"{site_url}/labs/06-launching.html", wait_until="networkidle")
    outputs = page.locator(".cell_output").all_inner_texts()
    text = "\n".join(outputs)
    assert "[rank 3] sent 3 to rank 0, received 2 from rank 2" in text
    assert "rank 2 failed (root cause)" in text
    images = page.locator(".cell_output img")
    assert images.count() >= 2
    for i in range(images.count()):
        width = images.nth(i).evaluate("img => img.naturalWidth")
        assert width > 100, "a figure did not load"
    assert page.problems == [], "\n".join(page.problems)


def test_the_chapter_figure_loads(page, site_url):
    page.goto(f"{site_url}/chapters/06-launching.html", wait_until="networkidle")
    figure = page.locator("figure img").first
    assert figure.evaluate("img => img.complete && img.naturalWidth > 100")
    assert page.problems == [], "\n".join(page.problems)


def test_search_finds_a_term(page, site_url):
    page.goto(f"{site_url}/search.html?q=rendezvous", wait_until="networkidle")
    results = page.locator("ul.search li a")
    results.first.wait_for(timeout=15000)
    titles = results.all_inner_texts()
    assert any("Launching" in t for t in titles), titles
    assert page.problems == [], "\n".join(page.problems)


def test_navigation_links_lead_from_the_intro_to_the_lab(page, site_url):
    page.goto(f"{site_url}/intro.html", wait_until="networkidle")
    page.locator("nav.bd-links a", has_text="Launching").first.click()
    page.wait_for_load_state("networkidle")
    assert page.url.endswith("chapters/06-launching.html")
    page.locator("a.right-next").click()  # the "next" button under the page
    page.wait_for_load_state("networkidle")
    assert page.url.endswith("labs/06-launching.html")
    page.locator("a.left-prev").click()
    page.wait_for_load_state("networkidle")
    assert page.url.endswith("chapters/06-launching.html")
    assert page.problems == [], "\n".join(page.problems)


def test_math_is_typeset_offline(page, site_url):
    page.goto(f"{site_url}/chapters/08-allreduce.html", wait_until="networkidle")
    typeset = page.locator("main article mjx-container svg")
    typeset.first.wait_for(state="visible", timeout=15000)
    assert typeset.count() > 10
    assert "\\frac" not in page.locator("main").inner_text(), "raw LaTeX left on the page"
    assert page.problems == [], "\n".join(page.problems)
