"""Debian's Chromium, driven by Playwright, for the website and JupyterLab tests.

The browser is started with background networking off, as this machine has no network
beyond its package registries: every asset a page needs must come from the page's own
server. (A test tool's own browser download is not available here.)
"""

from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("Chromium not found: install Debian's `chromium` package (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # Playwright hides scrollbars by default; the website's tests look for them.
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, ignore_default_args=["--hide-scrollbars"]
        )
        yield browser
        browser.close()
