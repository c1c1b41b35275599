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
from playwright.sync_api import expect

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


# A phone, and a wide screen that draws overlay scrollbars as phones, tablets and macOS do
# (Chromium's mobile emulation): a scrollbar then takes room only where the site's CSS asks
# for one, so a test can tell a table cut at the page's edge from one that says it scrolls.
PHONE = {"viewport": {"width": 400, "height": 800}, "is_mobile": True, "has_touch": True}
TABLET = {"viewport": {"width": 800, "height": 1000}, "is_mobile": True, "has_touch": True}
WIDE = {"viewport": {"width": 1280, "height": 800}, "is_mobile": True, "has_touch": True}


def open_page(browser, **context_options):
    """A page in a fresh browser context, recording every console error, page error and
    failed request in ``page.problems``."""
    context = browser.new_context(**context_options)
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
    return page


@pytest.fixture
def page(browser):
    page = open_page(browser)
    yield page
    page.context.close()


@pytest.fixture
def phone(browser):
    page = open_page(browser, **PHONE)
    yield page
    page.context.close()


@pytest.fixture
def wide(browser):
    page = open_page(browser, **WIDE)
    yield page
    page.context.close()


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


# The header's ☰ and "Contents" buttons, those sphinx-book-theme shows above the article
# (pydata-sphinx-theme's own pair, in its navbar, is hidden).
PRIMARY_TOGGLE = ".bd-header-article .primary-toggle"
SECONDARY_TOGGLE = ".bd-header-article .secondary-toggle"


@pytest.mark.parametrize("device", [PHONE, TABLET], ids=["400px", "800px"])
def test_the_navigation_and_the_contents_open_on_a_narrow_screen(browser, site_url, device):
    page = open_page(browser, **device)
    page.goto(f"{site_url}/chapters/06-launching.html", wait_until="networkidle")
    assert page.locator("#pst-primary-sidebar").is_hidden(), "the sidebar shows at this width"
    page.locator(PRIMARY_TOGGLE).click()
    navigation = page.locator("#pst-primary-sidebar-modal")
    expect(navigation).to_be_visible()
    link = navigation.locator("nav.bd-links a", has_text="Collective communication").first
    expect(link).to_be_visible()
    link.click()
    page.wait_for_url("**/chapters/07-collectives.html")
    page.wait_for_load_state("networkidle")

    page.locator(SECONDARY_TOGGLE).click()
    contents = page.locator("#pst-secondary-sidebar-modal")
    expect(contents).to_be_visible()
    expect(contents.locator("nav a", has_text="Broadcast").first).to_be_visible()
    page.keyboard.press("Escape")
    expect(contents).to_be_hidden()
    assert page.problems == [], "\n".join(page.problems)
    page.context.close()


def test_the_navigation_collapses_on_a_wide_screen(page, site_url):
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{site_url}/chapters/06-launching.html", wait_until="networkidle")
    sidebar = page.locator("#pst-primary-sidebar")
    article = page.locator("main article")
    expect(sidebar).to_be_visible()
    narrow = article.bounding_box()["width"]
    page.locator(PRIMARY_TOGGLE).click()
    expect(sidebar).to_be_hidden()
    expect(page.locator("#pst-primary-sidebar-modal")).to_be_hidden()
    assert article.bounding_box()["width"] > narrow + 100, "the article did not take the room"
    page.locator(PRIMARY_TOGGLE).click()
    expect(sidebar).to_be_visible()
    assert page.problems == [], "\n".join(page.problems)


@pytest.mark.parametrize("device", [PHONE, {}], ids=["touch", "mouse"])
def test_no_tooltip_stays_over_the_header_after_a_click(browser, site_url, device):
    page = open_page(browser, **device)
    page.goto(f"{site_url}/chapters/06-launching.html", wait_until="networkidle")
    for button in (PRIMARY_TOGGLE, SECONDARY_TOGGLE, ".bd-header-article .theme-switch-button"):
        if not page.locator(button).is_visible():
            continue
        page.locator(button).tap() if device else page.locator(button).click()
        page.keyboard.press("Escape")  # closes a sidebar's dialog, where one opened
        if not device:
            page.mouse.move(640, 600)
        page.wait_for_timeout(1000)  # the theme shows a tooltip 500 ms after a hover or focus
        tooltips = page.locator(".tooltip").all_inner_texts()
        assert tooltips == [], f"after a click on {button}"
    assert page.problems == [], "\n".join(page.problems)
    page.context.close()


@pytest.mark.parametrize("path", toc_pages())
def test_no_page_scrolls_sideways_on_a_phone(phone, site_url, path):
    phone.goto(f"{site_url}/{path}.html", wait_until="networkidle")
    width = phone.evaluate("document.documentElement.scrollWidth")
    widest = phone.evaluate(WIDER_THAN_THE_PAGE)
    assert width <= PHONE["viewport"]["width"], f"{path} is {width} px wide: {widest}"


# Elements that reach past the page's right edge and are not inside a box that scrolls.
WIDER_THAN_THE_PAGE = """() => {
  const edge = document.documentElement.clientWidth + 0.5, found = [];
  const scrolls = (el) => { for (let a = el.parentElement; a; a = a.parentElement)
    if (getComputedStyle(a).overflowX !== "visible") return true; return false; };
  for (const el of document.querySelectorAll("main *")) {
    if (el.getBoundingClientRect().right > edge && !scrolls(el))
      found.push(el.tagName.toLowerCase() + ": " + el.textContent.trim().slice(0, 60));
  }
  return found.slice(0, 5);
}"""

# Every table, code block and output that is wider than its box: the box scrolls sideways
# and draws a scrollbar (one that takes room: an overlay scrollbar shows only while one
# scrolls). Returns what is cut instead.
CUT = """() => {
  const cut = [], blocks = "main table, main pre, main mjx-container[display=true]";
  for (const el of document.querySelectorAll(blocks)) {
    let box = el.parentElement;
    while (box && getComputedStyle(box).overflowX === "visible") box = box.parentElement;
    if (getComputedStyle(el).overflowX !== "visible") box = el;
    if (!box || box.scrollWidth <= box.clientWidth + 1) continue;
    const style = getComputedStyle(box);
    const scrollbar = box.offsetHeight - box.clientHeight
      - parseFloat(style.borderTopWidth) - parseFloat(style.borderBottomWidth);
    if (!["auto", "scroll"].includes(style.overflowX) || scrollbar < 4)
      cut.push(`${el.tagName.toLowerCase()} ${box.scrollWidth} px in ${box.clientWidth} px `
        + `(overflow ${style.overflowX}, scrollbar ${scrollbar} px): `
        + el.textContent.trim().slice(0, 60));
  }
  return cut;
}"""


@pytest.mark.parametrize("path", toc_pages())
def test_every_page_loads_cleanly_and_cuts_no_table_or_code_on_a_wide_screen(wide, site_url, path):
    """One visit a page at 1280 px: a title, no console error, failed request or HTTP
    error, and nothing wider than its box without a scrollbar."""
    wide.goto(f"{site_url}/{path}.html", wait_until="networkidle")
    assert wide.locator("main h1").count() >= 1, f"{path}: no title"
    assert wide.problems == [], "\n".join(wide.problems)
    cut = wide.evaluate(CUT)
    assert cut == [], f"{path}:\n" + "\n".join(cut)


# Each Chinese character of the glossary drawn alone, in the font the page gives its cell
# and in the site's own Chinese font: how many different drawings the page's font makes
# (a missing glyph is the same empty box for every character), and whether they are the
# site font's.
CHINESE_GLYPHS = """async () => {
  await document.fonts.ready;
  const cells = [...document.querySelectorAll("main table tbody td:nth-child(2)")];
  const chars = [...new Set(cells.flatMap(c => [...c.innerText]))]
    .filter(ch => /[\\u3400-\\u9fff]/.test(ch));
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = 48;
  const ctx = canvas.getContext("2d", {willReadFrequently: true});
  const draw = (ch, font) => {
    ctx.clearRect(0, 0, 48, 48);
    ctx.font = font;
    ctx.fillText(ch, 4, 38);
    return ctx.getImageData(0, 0, 48, 48).data.join();
  };
  const page = "32px " + getComputedStyle(cells[0]).fontFamily;
  const drawn = chars.map(ch => draw(ch, page));
  return {
    characters: chars.length,
    different: new Set(drawn).size,
    site_font: chars.every((ch, i) => drawn[i] === draw(ch, '32px "Course CJK"')),
  };
}"""


def test_the_glossarys_chinese_is_drawn_from_the_sites_font(page, site_url):
    page.goto(f"{site_url}/glossary.html", wait_until="networkidle")
    glyphs = page.evaluate(CHINESE_GLYPHS)
    assert glyphs["characters"] > 200
    assert glyphs["different"] == glyphs["characters"], f"empty boxes: {glyphs}"
    assert glyphs["site_font"], glyphs
    assert page.problems == [], "\n".join(page.problems)


def test_search_puts_the_chapter_first_and_typesets_the_quotes(page, site_url):
    page.goto(f"{site_url}/search.html?q=ZeRO", wait_until="networkidle")
    results = page.locator("ul.search li")
    results.first.wait_for(timeout=15000)
    first = results.first.locator("a").first
    assert first.inner_text() == "ZeRO and FSDP"
    assert first.get_attribute("href").startswith("chapters/14-zero.html")
    page.goto(f"{site_url}/search.html?q=bubble", wait_until="networkidle")
    quotes = page.locator("ul.search li p.context")
    quotes.first.wait_for(timeout=15000)
    expect(page.locator("ul.search li p.context mjx-container").first).to_be_attached()
    page.wait_for_function(
        "() => ![...document.querySelectorAll('ul.search li p.context')]"
        ".some(p => p.textContent.includes('\\\\('))",
        timeout=15000,
    )
    assert page.problems == [], "\n".join(page.problems)


@pytest.mark.parametrize("lab", ["03-walls", "13-hybrid-parallel"])
def test_a_labs_explorer_says_it_is_live_in_jupyterlab(page, site_url, lab):
    page.goto(f"{site_url}/labs/{lab}.html", wait_until="networkidle")
    note = page.locator(".cell_output", has_text="explorer: a live widget (run this cell in")
    expect(note).to_have_count(1)
    expect(note).to_be_visible()
    assert page.problems == [], "\n".join(page.problems)


def test_figures_are_shown_as_wide_as_tools_figures_assumes(page, site_url):
    """tools.figures sizes the figures' text for these widths and this small print."""
    import sys

    sys.path.insert(0, str(ROOT))
    from tools.figures import PAGE_PX, SMALL_PRINT_PX, shown_widths

    widths = shown_widths()
    page.set_viewport_size({"width": 1280, "height": 800})
    for chapter in sorted({"chapters/11-pipeline-parallel", "chapters/14-zero"}):
        page.goto(f"{site_url}/{chapter}.html", wait_until="networkidle")
        for img in page.locator("main figure img").all():
            name = img.get_attribute("src").rsplit("/", 1)[-1]
            assert abs(img.bounding_box()["width"] - widths[name]) <= 2, name
        code = page.locator("main code.literal").first
        assert code.evaluate("c => getComputedStyle(c).fontSize") == f"{SMALL_PRINT_PX}px"
    assert widths["11-schedules.png"] == PAGE_PX


# ---------------------------------------------------------------------- the calculators
# calculators.md runs labsupport.estimate in the page (Pyodide). Python starts in 4-7 s in
# headless Chromium on this project's 2-core machine under a load of 5, in 21-29 s under the
# heaviest load seen (2.6 s of CPU); a start that takes longer than this
# has failed.
STARTUP_MS = 180_000


def calculator_started(page):
    page.wait_for_function("document.documentElement.dataset.calculator", timeout=STARTUP_MS)
    status = page.locator("#calc-memory .calc-status").inner_text()
    assert page.evaluate("document.documentElement.dataset.calculator") == "ready", status
    assert status.startswith("Live: computed in this page by labsupport.estimate"), status


# Every long task of the page's main thread (50 ms or more: the page answers no scroll, key
# or click meanwhile).
LONG_TASKS = """window.longTasks = [];
new PerformanceObserver((list) => window.longTasks.push(
  ...list.getEntries().map((task) => [task.startTime, task.duration])))
  .observe({type: "longtask"});"""
LONGEST_TASK_SINCE = """(since) => Math.max(0,
  ...window.longTasks.filter(([start]) => start >= since).map(([, duration]) => duration))"""
MARK = "(name) => performance.getEntriesByName(name)[0].startTime"


def main_thread_stays_free(page, since: float, until: float, what: str):
    """No task of the main thread after ``since`` took a fifth of the ``since``-``until``
    time. Python runs in a worker: the page's own tasks (drawing answers) take tens of ms.
    On the main thread, Python's start was one task of nearly all of it (4.9-12.6 s of
    5.4-12.1 s on this project's loaded 2-core machine)."""
    longest = page.evaluate(LONGEST_TASK_SINCE, since)
    assert longest < (until - since) / 5, (
        f"{what}: a {longest:.0f} ms task in {until - since:.0f} ms"
    )


# A new search (the planner's global batch changed), and a task queued as it starts: when
# the task ran and when the answer was drawn. On the main thread, the search and the
# drawing ran in the input's own task, before any other.
WHILE_IT_SEARCHES = """async (batch) => {
  const out = document.getElementById("calc-plan-out");
  const field = document.querySelector("#calc-plan-form [name=global_batch]");
  const times = {};
  const drawn = new Promise((resolve) => new MutationObserver((_, observer) => {
    observer.disconnect();
    times.drawn = performance.now();
    resolve();
  }).observe(out, {childList: true}));
  setTimeout(() => { times.free = performance.now(); }, 0);
  field.value = batch;
  field.dispatchEvent(new Event("input", {bubbles: true}));
  await drawn;
  await new Promise((resolve) => setTimeout(resolve, 0));
  return times;
}"""


def started_off_the_main_thread(page):
    """While Python started and drew its first answers, the main thread stayed free."""
    marks = ("calculator: scripts loaded", "calculator: first answers drawn")
    loaded, drawn = (page.evaluate(MARK, mark) for mark in marks)
    main_thread_stays_free(page, loaded, drawn, "while Python starts")


def set_inputs(page, form: str, inputs: dict):
    """Set a form's fields as a reader does (the model first: a preset fills the sizes)."""
    for name in sorted(inputs, key=lambda n: n != "model"):
        field = page.locator(f"#{form} [name='{name}']")
        value = inputs[name]
        if isinstance(value, bool):
            field.set_checked(value)
        elif field.evaluate("e => e.tagName") == "SELECT":
            field.select_option(str(value))
        else:
            field.fill(str(value))


def settled(page, out: str):
    """Wait until the output shows the answer to its form's latest input (Python answers
    in a worker: until then the output is aria-busy)."""
    expect(page.locator(f"#{out}")).not_to_have_attribute("aria-busy", "true")


def shown(page, out: str) -> dict:
    settled(page, out)
    cells = page.locator(f"#{out} td[data-part]")
    return {
        cells.nth(i).get_attribute("data-part"): float(cells.nth(i).inner_text())
        for i in range(cells.count())
    }


def _site_modules():
    import sys

    sys.path.insert(0, str(ROOT))
    import tools.site_calculator_html as html
    from labsupport.estimate import planner, published, stages

    return html, planner, published, stages


def memory_cases() -> dict:
    """Six cases of the memory form: three published layouts (GPT-3; Llama 3's 128K stage,
    context parallel; DeepSeek-V3, expert parallel), a custom GPT (family, FFN width and
    key-value heads set back from DeepSeek-V3's), a custom Llama with grouped-query
    attention, GPT-2 on one GPU."""
    html = _site_modules()[0]
    rest = {"cp": 1, "ep": 1, "fused_attention": False}
    return {
        "GPT-3 as published": html.web.published_inputs("GPT-3 175B"),
        "Llama 3 405B 128K as published": html.web.published_inputs("Llama 3 405B, 128K"),
        "DeepSeek-V3 as published": html.web.published_inputs("DeepSeek-V3"),
        "custom 1.3B, ZeRO-3": {
            "model": "custom", "layers": 24, "hidden": 2048, "heads": 16, "vocab": 50257,
            "family": "gpt", "ffn": "", "kv_heads": "", "seq_len": 4096, "gpu": "H200 SXM",
            "dp": 4, "tp": 2, "pp": 2, "zero": 3, "recompute": "none", "micro_batch": 2,
            "micro_batches": 4, "chunks": 1, "sequence_parallel": True,
        } | rest,
        "custom Llama 3 8B, GQA, TP 4 × CP 2": rest | {
            "model": "custom", "layers": 32, "hidden": 4096, "heads": 32, "vocab": 128256,
            "family": "llama", "ffn": 14336, "kv_heads": 8, "seq_len": 8192, "gpu": "H100 SXM",
            "dp": 4, "tp": 4, "pp": 2, "cp": 2, "zero": 1, "recompute": "selective",
            "micro_batch": 1, "micro_batches": 8, "chunks": 2, "sequence_parallel": True,
            "fused_attention": True,
        },
        "GPT-2 on one RTX 4090": {
            "model": "GPT-2 124M", "seq_len": 1024, "gpu": "RTX 4090", "dp": 1, "tp": 1,
            "pp": 1, "zero": 0, "recompute": "none", "micro_batch": 8, "micro_batches": 1,
            "chunks": 1, "sequence_parallel": False,
        } | rest,
    }  # fmt: skip


def expected_memory(inputs: dict) -> dict:
    """GB per part of the heaviest stage, from the planner's functions called here in
    CPython (with torch): the model and the layout built here, not by the page's adapter."""
    import dataclasses

    _, planner, published, stages = _site_modules()
    i = inputs
    if i["model"] == "custom" and i["family"] == "llama":
        model = planner.Transformer(
            "custom", i["layers"], i["hidden"], i["heads"], 1, i["vocab"], ffn=i["ffn"],
            kv_heads=i["kv_heads"], family="llama", positions=False, tied=False,
        )  # fmt: skip
    elif i["model"] == "custom":
        model = planner.Transformer("custom", i["layers"], i["hidden"], i["heads"], 1, i["vocab"])
    elif i["model"] == "GPT-2 124M":
        model = planner.Transformer("GPT-2 124M", 12, 768, 12, 1024, 50257)
    else:
        model = published.MODELS[i["model"]]
    model = dataclasses.replace(model, seq_len=i["seq_len"])
    layout = planner.Layout(
        i["dp"], i["tp"], i["pp"], zero=i["zero"], micro_batch=i["micro_batch"],
        chunks=i["chunks"], recompute=i["recompute"], cp=i["cp"], ep=i["ep"],
        sequence_parallel=i["sequence_parallel"] and i["tp"] > 1,
        fused_attention=i["fused_attention"],
    )  # fmt: skip
    batch = i["dp"] * i["micro_batch"] * i["micro_batches"]
    parts = dict(stages.heaviest_stage(model, layout, batch)[1])
    parts["total"] = sum(parts.values())
    return {part: value / 1e9 for part, value in parts.items()}


def test_the_calculators_compute_in_the_page_opened_from_a_folder(browser):
    """file://, where Chromium allows no fetch(): five cases of memory per GPU and the
    planner's rankings, against the same functions in CPython."""

    html, planner, published, _ = _site_modules()
    runs = {e["name"]: e for e in published.PUBLISHED}

    page = open_page(browser)
    page.add_init_script(LONG_TASKS)
    page.goto((SITE / "calculators.html").as_uri())
    calculator_started(page)
    started_off_the_main_thread(page)
    cases = memory_cases()
    for name, inputs in cases.items():
        before = page.locator("#calc-memory-out").inner_text()
        set_inputs(page, "calc-memory-form", inputs)
        expect(page.locator("#calc-memory-out")).not_to_have_text(before)
        got, want = shown(page, "calc-memory-out"), expected_memory(inputs)
        assert got == pytest.approx(want, abs=0.0051), name
    # A model with a published run: choosing it fills its layout as published.
    for name in ("GPT-3 175B", "Llama 3 405B, 128K", "DeepSeek-V3"):
        page.locator("#calc-memory-form [name=model]").select_option(name)
        lay = runs[name]["layout"]
        for axis in ("dp", "tp", "pp", "cp", "ep", "chunks"):
            field = page.locator(f"#calc-memory-form [name={axis}]")
            expect(field).to_have_value(str(getattr(lay, axis)))
        fits = published.as_published(runs[name])
        assert shown(page, "calc-memory-out")["total"] == pytest.approx(
            fits["memory"] / 1e9, abs=0.0051
        )
        verdict = page.locator("#calc-memory-out .calc-verdict")
        expect(verdict).to_have_attribute("data-fits", str(fits["fits"]).lower())

    # The planner opens on GPT-3 on Selene, its framework's settings as published: its ten
    # first meshes as check() ranks them.
    rows = page.locator("#calc-plan-out tbody tr[data-row]")
    expect(rows).to_have_count(10)
    want = published.check(runs["GPT-3 175B"])["meshes"][:10]
    expect_rows(rows, want, html.axes_text)
    rows.nth(2).locator("button").click()
    expect(page.locator("#calc-plan-out h4")).to_have_text("Layout 3: where the step goes")
    parts, chosen = shown(page, "calc-plan-out"), want[2]
    seconds = {k: parts.pop(k) for k in chosen["parts"]}
    assert seconds == pytest.approx(chosen["parts"], abs=0.00051)
    states, activations = chosen["states"], chosen["memory"] - chosen["states"]
    want_gb = {"states": states / 1e9, "activations": activations / 1e9}
    assert parts == pytest.approx(want_gb, abs=0.0051)
    note = page.locator("#calc-plan-out .calc-note")
    expect(note).to_contain_text("GEMMs at 64.1 % of the dense peak")

    # Overlapping the data-parallel reduction: the ranking plan() gives with it.
    gpt3 = runs["GPT-3 175B"]
    same = ("cp", "a2a_overlap", "fused_attention", "fp8", "sequence_parallel")
    settings = {k: (getattr(gpt3["layout"], k),) for k in same} | {"dp_overlap": (True,)}
    model, cluster = published.MODELS[gpt3["model"]], published.CLUSTERS[gpt3["cluster"]]
    overlapped = planner.best_per_mesh(planner.plan(model, cluster, 1536, **settings))[:10]
    page.locator("#calc-plan-form [name=dp_overlap]").set_checked(True)
    expect_rows(rows, overlapped, html.axes_text)

    # Published runs: the preset fills their batch and settings; their rank as check() says.
    for name, axes in [("Llama 3 405B, 128K", "8×8×16, CP 16"), ("DeepSeek-V3", "128×1×16, EP 64")]:
        run = runs[name]
        set_inputs(page, "calc-plan-form", {"model": run["model"], "cluster": run["cluster"]})
        batch = page.locator("#calc-plan-form [name=global_batch]")
        expect(batch).to_have_value(str(run["global_batch"]))
        rank = published.check(run)["rank"]
        expect(note).to_contain_text(f"The published mesh {axes} ranks {rank}.")
    expect(note).to_contain_text("For this model the page searches only tp 1")
    assert page.problems == [], "\n".join(page.problems)
    page.context.close()


def expect_rows(rows, want, axes_text):
    """The page's ranked rows are ``want``'s (results of the planner), in order."""
    settled(rows.page, "calc-plan-out")
    expect(rows.first.locator("[data-key=mesh]")).to_have_text(axes_text(want[0]["layout"].axes))
    for i, result in enumerate(want):
        row = rows.nth(i)
        assert row.locator("[data-key=mesh]").inner_text() == axes_text(result["layout"].axes)
        assert float(row.locator("[data-key=memory]").inner_text()) == pytest.approx(
            result["memory"] / 1e9, abs=0.0051
        )
        assert float(row.locator("[data-key=step_s]").inner_text()) == pytest.approx(
            result["step_s"], abs=0.0051
        )
        assert float(row.locator("[data-key=tflops]").inner_text()) == pytest.approx(
            result["tflops"], abs=0.051
        )


# Every text the memory calculator's status line shows, in order.
STATUS_HISTORY = """document.addEventListener("DOMContentLoaded", () => {
  const status = document.querySelector("#calc-memory .calc-status");
  window.statusHistory = [status.textContent];
  new MutationObserver(() => window.statusHistory.push(status.textContent))
    .observe(status, {childList: true, characterData: true, subtree: true});
});"""


def test_the_calculators_work_from_the_keyboard_on_a_phone(phone, site_url):
    phone.add_init_script(STATUS_HISTORY + "\n" + LONG_TASKS)
    phone.goto(f"{site_url}/calculators.html")
    calculator_started(phone)
    history = phone.evaluate("window.statusHistory")
    assert history[1].startswith("Loading the calculator"), history  # while Python starts
    started_off_the_main_thread(phone)
    times = phone.evaluate(WHILE_IT_SEARCHES, 1024)
    assert times["free"] < times["drawn"], f"the page waited for the search: {times}"
    phone.locator("#calc-memory-form [name=model]").focus()
    reached = []
    for _ in range(20):
        reached.append(phone.evaluate("document.activeElement.name"))
        phone.keyboard.press("Tab")
    fields = {"model", "seq_len", "gpu", "dp", "tp", "pp", "cp", "ep", "zero", "recompute",
              "micro_batch", "micro_batches", "chunks", "sequence_parallel",
              "fused_attention"}  # fmt: skip
    assert fields <= set(reached), f"the Tab key never reaches {fields - set(reached)}"
    total = phone.locator("#calc-memory-out td[data-part=total]")
    before = total.inner_text()
    phone.locator("#calc-memory-form [name=zero]").focus()
    phone.keyboard.press("ArrowDown")  # ZeRO-0 to ZeRO-1: the optimizer states are sharded
    expect(total).not_to_have_text(before)
    assert float(total.inner_text()) < float(before)
    phone.locator("#calc-plan-out tr[data-row='1'] button").focus()
    phone.keyboard.press("Enter")
    expect(phone.locator("#calc-plan-out h4")).to_have_text("Layout 2: where the step goes")
    # Custom sizes: the fields a preset fixes open, in order, and a key changes the family.
    model = phone.locator("#calc-memory-form [name=model]")
    model.select_option("custom")
    model.focus()
    reached = []
    for _ in range(7):
        phone.keyboard.press("Tab")
        reached.append(phone.evaluate("document.activeElement.name"))
    assert reached == ["layers", "hidden", "heads", "vocab", "family", "ffn", "kv_heads"]
    note = phone.locator("#calc-memory-out .calc-note")
    expect(note).to_contain_text("(GPT, FFN width")
    phone.locator("#calc-memory-form [name=family]").focus()
    phone.keyboard.press("ArrowDown")  # GPT to Llama: SwiGLU, its own FFN width
    expect(note).to_contain_text("(Llama, FFN width")
    assert phone.evaluate("document.documentElement.scrollWidth") <= PHONE["viewport"]["width"]
    calculators = WIDER_THAN_THE_PAGE.replace('"main *"', '"main .calc *, main .calc-static *"')
    assert phone.evaluate(calculators) == []
    assert phone.problems == [], "\n".join(phone.problems)


def test_without_python_the_calculators_page_says_why_and_shows_its_tables(page, site_url):
    page.route("**/_static/calculator/**", lambda route: route.abort())
    page.goto(f"{site_url}/calculators.html", wait_until="networkidle")
    page.wait_for_function("document.documentElement.dataset.calculator", timeout=30_000)
    for panel in ("#calc-memory", "#calc-plan"):
        expect(page.locator(f"{panel} .calc-status")).to_contain_text(
            "The calculator is off: the page could not load Python (Pyodide)"
        )
        expect(page.locator(f"{panel} select").first).to_be_disabled()
    html = _site_modules()[0]
    memory_rows = page.locator(".calc-static").nth(0).locator("tbody tr")
    expect(memory_rows).to_have_count(len(html.MEMORY_ROWS))
    expect(memory_rows.first).to_contain_text("GPT-3 175B as published")
    plan_rows = page.locator(".calc-static").nth(1).locator("tbody tr")
    expect(plan_rows).to_have_count(3 * len(html.web.planner_presets()))
    failed = "console error: Failed to load resource: net::ERR_FAILED"
    assert page.problems.count(failed) == 6  # the six files under _static/calculator/
    others = [p for p in page.problems if "/_static/calculator/" not in p and p != failed]
    assert others == [], "\n".join(others)
