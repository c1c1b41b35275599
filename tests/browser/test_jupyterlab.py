"""The labs in a real JupyterLab, driven in headless Chromium as a learner would.

The test starts a JupyterLab server on a copy of the labs (nothing is written into the
repository), on a free port, and drives it with Playwright through JupyterLab's own
commands: Run All, Interrupt, Restart. It checks what a learner sees: a lab runs to the
end, rank output appears while the ranks run, a failing rank shows the short
``LaunchError``, a widget answers its slider, an interrupt stops every rank, a restart
leaves no process behind. Processes are found with psutil below the server's own.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]
LABS = ROOT / "labs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A JupyterLab server on a copy of the labs; yields (base url, token, process)."""
    labs_before = _snapshot(LABS)
    home = tmp_path_factory.mktemp("jupyterlab")
    work = home / "labs"
    shutil.copytree(LABS, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    port, token = free_port(), secrets.token_hex(16)
    settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # render every cell, not only those in view, so the test can find any cell's output
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
        HOME=str(home),
    )
    env.pop("LABSUPPORT_THREADS", None)
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: JupyterLab's commands
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class="
        "jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = open(home / "server.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail(f"JupyterLab did not start:\n{(home / 'server.log').read_text()}")
            time.sleep(0.5)
    yield {"url": url, "token": token, "process": process, "work": work, "labs_before": labs_before}
    for child in psutil.Process(process.pid).children(recursive=True):
        child.kill()
    process.kill()
    process.wait()
    log.close()


def open_notebook(browser, server, name: str):
    """A page with notebook ``name`` open (a fresh workspace: ``?reset``), kernel idle."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{server['url']}/lab/tree/{name}?reset&token={server['token']}")
    page.wait_for_function(
        "(name) => window.jupyterapp?.shell.currentWidget?.context?.path === name"
        " && window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel"
        "?.status === 'idle'",
        arg=name,
        timeout=120_000,
    )
    return page


def command(page, name: str, args: dict | None = None) -> None:
    """Start JupyterLab command ``name`` (as its menu entry does); do not wait for it."""
    page.evaluate("([n, a]) => { window.jupyterapp.commands.execute(n, a); }", [name, args or {}])


def wait_idle(page, timeout: float) -> None:
    """Wait until Run All has finished: the kernel idle, no cell queued or running, for
    two seconds in a row (between two cells the kernel is idle for a moment)."""
    snapshot = (
        "() => { const w = window.jupyterapp.shell.currentWidget;"
        " const k = w?.sessionContext?.session?.kernel;"
        " const code = w.content.widgets.filter(c => c.model.type === 'code');"
        " return {idle: k?.status === 'idle',"
        " queued: code.some(c => (c.promptNode?.textContent || '').includes('*')),"
        " ran: code.filter(c => c.model.executionCount).length}; }"
    )
    deadline, quiet_since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        state = page.evaluate(snapshot)
        if state["idle"] and not state["queued"] and state["ran"]:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 2:
                return
        else:
            quiet_since = None
        time.sleep(0.25)
    raise AssertionError(f"Run All did not finish within {timeout} s: {state}")


def saved_cells(page, server, name: str) -> list:
    """Save the notebook and read its cells back from disk, with their outputs."""
    command(page, "docmanager:save")
    page.wait_for_function(
        "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000
    )
    deadline = time.monotonic() + 30
    while True:  # the server may still be writing the file
        try:
            return nbformat.read(server["work"] / name, as_version=4).cells
        except (nbformat.reader.NotJSONError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def launcher_processes(server) -> tuple[list, list]:
    """The kernels' children (forkservers, resource trackers) and everything below them
    (ranks, and what ranks started), alive, below the server."""
    helpers, ranks = [], []
    for proc in psutil.Process(server["process"].pid).children(recursive=True):
        try:
            if "ipykernel" not in " ".join(proc.cmdline()):
                continue
            for child in proc.children():
                helpers.append(child)
                ranks.extend(child.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return [p for p in helpers if _alive(p)], [p for p in ranks if _alive(p)]


def scratch(server, name: str, sources: list[str]) -> None:
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, server["work"] / name)


def output_text(page, index: int) -> str:
    return page.evaluate(
        "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node.innerText", index
    )


def test_rank_output_is_live_then_rank_ordered_and_an_interrupt_stops_every_rank(browser, server):
    scratch(
        server,
        "scratch.ipynb",
        [
            "import time\nfrom labsupport import launch\nfrom labsupport.launch.progress import "
            "progress\n\ndef tick():\n    import torch.distributed as dist\n"
            "    for step in progress(range(30), 'work'):\n        time.sleep(0.2)\n"
            "        if step % 10 == 0:\n            print('tick', step, flush=True)\n"
            "    return dist.get_rank()\n\nlaunch(tick, 3)",
            "def stuck():\n    time.sleep(600)\n\nlaunch(stuck, 3)",
            "launch(lambda: 'again', 2)",
        ],
    )
    page = open_notebook(browser, server, "scratch.ipynb")
    command(page, "notebook:run-all-cells")
    # live: rank lines and progress bars while the first cell still runs
    page.wait_for_function(
        "() => { const t = window.jupyterapp.shell.currentWidget.content.widgets[0]"
        ".node.innerText; return t.includes('[rank 2] tick 0') && t.includes('work |'); }",
        timeout=90_000,
    )
    assert "[0, 1, 2]" not in output_text(page, 0), "the cell had already finished"
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget.content.widgets[0]"
        ".node.innerText.includes('[0, 1, 2]')",
        timeout=90_000,
    )
    record = output_text(page, 0)
    assert "(output of the 3 ranks, in rank order)" in record
    assert record.index("[rank 0] tick 20") < record.index("[rank 1] tick 0")
    # the second cell hangs in its ranks: wait for them, interrupt, count the survivors
    deadline = time.monotonic() + 60
    while len(launcher_processes(server)[1]) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = launcher_processes(server)[1]
    assert len(ranks) == 3, f"expected 3 ranks running, found {ranks}"
    command(page, "notebook:interrupt-kernel")
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ranks if _alive(p)], "ranks still running 5 s after the interrupt"
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget.content.widgets[1]"
        ".node.innerText.includes('all 3 ranks were stopped')",
        timeout=30_000,
    )
    interrupted = output_text(page, 1)
    assert "KeyboardInterrupt" in interrupted
    assert "selectors.py" not in interrupted and "launcher.py" not in interrupted
    # the next launch works
    page.evaluate(
        "() => { const w = window.jupyterapp.shell.currentWidget; w.content.activeCellIndex = 2; }"
    )
    command(page, "notebook:run-cell")
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget.content.widgets[2]"
        ".node.innerText.includes(\"['again', 'again']\")",
        timeout=60_000,
    )
    # a restart leaves no forkserver and no rank behind
    command(page, "kernelmenu:restart")
    page.locator(".jp-Dialog-button.jp-mod-accept").click()
    deadline = time.monotonic() + 10
    while any(launcher_processes(server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launcher_processes(server) == ([], []), "a restart left a forkserver or rank behind"
    page.close()


def run_all(browser, server, name: str, timeout: float = 300):
    page = open_notebook(browser, server, name)
    command(page, "notebook:run-all-cells")
    wait_idle(page, timeout)
    return page


def errors(cells) -> list[tuple[int, str]]:
    return [
        (i, out.get("ename", ""))
        for i, cell in enumerate(cells)
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.output_type == "error"
    ]


def test_lab_6_runs_to_the_end_and_shows_the_short_launch_error(browser, server):
    page = run_all(browser, server, "06-launching.ipynb")
    cells = saved_cells(page, server, "06-launching.ipynb")
    code = [c for c in cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "Run All stopped before the end"
    expected = {i for i, c in enumerate(cells) if "raises-exception" in c.metadata.get("tags", [])}
    found = errors(cells)
    assert {i for i, _ in found} == expected, found
    for i in expected:
        error = next(o for o in cells[i].outputs if o.output_type == "error")
        text = "\n".join(error.traceback)
        assert error.ename == "LaunchError" and "root cause" in text
        assert len(text.splitlines()) < 40, "the LaunchError should be short"
    page.close()


def test_lab_3_widget_answers_its_slider(browser, server):
    page = run_all(browser, server, "03-walls.ipynb")
    cells = saved_cells(page, server, "03-walls.ipynb")
    assert errors(cells) == []
    report = page.locator(".widget-html-content pre").first
    try:
        report.wait_for(timeout=30_000)
    except Exception:
        page.screenshot(path=str(server["work"].parent / "lab3.png"), full_page=True)
        raise
    before = report.inner_text()
    slider = page.locator(".widget-slider .ui-slider-handle, .widget-slider .noUi-handle").nth(2)
    slider.focus()
    for _ in range(5):
        slider.press("ArrowLeft")
    page.wait_for_function(
        "(old) => { const e = document.querySelector('.widget-html-content pre');"
        " return e && e.innerText !== old; }",
        arg=before,
        timeout=30_000,
    )
    assert report.inner_text() != before
    page.close()


def test_a_checkers_wrong_answer_is_a_short_verdict(browser, server):
    scratch(
        server,
        "verdict.ipynb",
        [
            "from labsupport.labs import lab14_zero as lab\n\n"
            "def state_bytes(num_params, stage, dp):\n    return 16 * num_params",
            "lab.check_state_bytes(state_bytes)",
            "def state_bytes(num_params, stage, dp):\n    return {}[stage]\n\n"
            "lab.check_state_bytes(state_bytes)",
        ],
    )
    page = run_all(browser, server, "verdict.ipynb", timeout=120)  # stops at the wrong answer
    page.evaluate(
        "() => { const w = window.jupyterapp.shell.currentWidget; w.content.activeCellIndex = 2; }"
    )
    command(page, "notebook:run-cell")
    wait_idle(page, 60)
    cells = saved_cells(page, server, "verdict.ipynb")
    assert [name for _, name in errors(cells)] == ["AssertionError", "KeyError"]
    wrong = page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea-output").inner_text()
    assert wrong.strip().splitlines() == [
        "Not right yet: num_params=7.5e+09, stage=1, dp=64: got 1.2e+11 bytes, expected "
        "3.14062e+10 (sharding divides some of the states by dp)",
        "Change state_bytes() above, run its cell, then this one again.",
    ]
    raised = page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea-output").inner_text()
    assert raised.startswith("check_state_bytes() ran your state_bytes(), which raised:")
    assert "return {}[stage]" in raised and raised.rstrip().endswith("KeyError: 0")
    assert "labsupport" not in raised, raised
    page.close()


MERGE_WRONG = """\
from labsupport.labs import lab17_exercises as exercises


def merge(out, lse, block_out, block_lse):
    return (out + block_out) / 2, torch.logaddexp(lse, block_lse)
"""
MERGE_RIGHT = """\
def merge(out, lse, block_out, block_lse):
    new_lse = torch.logaddexp(lse, block_lse)
    weight = (lse - new_lse).exp().unsqueeze(-1)
    block_weight = (block_lse - new_lse).exp().unsqueeze(-1)
    return weight * out + block_weight * block_out, new_lse


exercises.check_merge(merge)
"""


def test_a_mechanism_exercise_on_ranks_says_wrong_then_correct(browser, server):
    """A learner's first attempt at lab 17's merge is wrong, the second right: the checker
    runs each inside ring attention on 4 ranks and says so, in a few lines."""
    scratch(
        server,
        "merge.ipynb",
        ["import torch\n\n" + MERGE_WRONG, "exercises.check_merge(merge)", MERGE_RIGHT],
    )
    page = run_all(browser, server, "merge.ipynb", timeout=180)  # stops at the wrong answer
    wrong = page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea").inner_text()
    assert wrong.strip().splitlines() == [
        "Not right yet: on two blocks, the merged output is not the softmax over both: a plain "
        "average gives each block the same weight; weight each by its share of the softmax's "
        "denominator over both blocks, exp(lse_i - new_lse)",
        "Change merge() above, run its cell, then this one again.",
    ]
    page.evaluate(
        "() => { const w = window.jupyterapp.shell.currentWidget; w.content.activeCellIndex = 2; }"
    )
    command(page, "notebook:run-cell")
    wait_idle(page, 180)
    right = page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea").inner_text()
    assert right.strip().splitlines()[-1] == (
        "Correct: inside ring attention on 4 ranks, your merge gives SDPA's output and gradients"
    ), right
    cells = saved_cells(page, server, "merge.ipynb")
    assert [name for _, name in errors(cells)] == ["AssertionError"]
    page.close()


def test_nothing_was_written_into_the_repository(server):
    for name in ("scratch.ipynb", "verdict.ipynb", "merge.ipynb"):
        assert not (LABS / name).exists(), name
    assert server["labs_before"] == _snapshot(LABS), "the test changed files in labs/"


def _snapshot(folder: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
