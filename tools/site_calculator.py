"""The website's calculators: Pyodide and labsupport's calculators, as files the page loads.

``python -m tools.site_calculator`` (``make book`` runs it) writes:

* ``_build/_vendor/calculator/``: Pyodide, from the npm registry's ``pyodide`` package
  (the version and the registry's sha512 pinned below, checked on download; the
  tarball is kept in ``_build/downloads``), and the Python the page runs;
* ``_build/calculator/*.html``: the calculators' forms and the static tables the page
  shows when the calculator cannot run (computed here, by the same functions).

The page runs Python in a Web Worker (a thread of its own), so that the page stays
responsive while Python starts and computes. Chromium refuses ``fetch()`` and module
scripts from ``file://`` URLs, and the site must work from a folder as well as from a
server. So every file Pyodide needs is shipped as a classic script that stores it in
``self.calculatorData``: the WebAssembly binary and the standard library in base64, the
loader (``pyodide.mjs``), the runtime module (``pyodide.asm.mjs``) and the lock file as
text; the page (``_assets/calculator.js``) starts the worker (a module worker, from a
``data:`` URL, which Chromium allows from a folder) and posts it these files. Only
Pyodide's core is shipped: no packages (the calculators need no numpy).

The Python is labsupport's own files, unchanged (:data:`SHIPPED`), in a package whose
``__init__`` files the page provides (:data:`PAGE_INIT`): labsupport's real ones import
torch, which the browser does not have.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "314.0.8"
INTEGRITY = (  # the registry's "dist.integrity" of this version
    "sha512-74Wq1kXOC+CCEzAfxuRAO701nAcCMLjf8NrwvWpu8S41dVMXwXmLQ05dYB+F4e46AdnGo0oq7YHSVUpHsoarLQ=="
)
TARBALL = f"https://registry.npmjs.org/pyodide/-/pyodide-{VERSION}.tgz"
#: Pyodide's core: the binary, the stdlib; the loader, the runtime module, the lock file.
BINARY = ("pyodide.asm.wasm", "python_stdlib.zip")
TEXT = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide-lock.json")

SHIPPED = [
    "labsupport/models/recompute.py",
    "labsupport/comm/cost.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "labsupport/estimate").glob("*.py")),
]
"""labsupport's files the page holds: the whole ``estimate`` layer (the page imports
:mod:`labsupport.estimate.web` and what it imports; the rest is never imported) and the
two modules of lower layers it imports."""

PAGE_INIT = {
    path: f'"""labsupport{suffix} in the website: only the calculators\' modules."""\n'
    for path, suffix in [
        ("labsupport/__init__.py", ""),
        ("labsupport/comm/__init__.py", ".comm"),
        ("labsupport/models/__init__.py", ".models"),
    ]
}


def python_files() -> dict[str, str]:
    """What the page writes into Pyodide's file system: path -> source."""
    return PAGE_INIT | {path: (ROOT / path).read_text() for path in SHIPPED}


def tarball(cache: Path) -> bytes:
    """The pinned Pyodide package, downloaded once, checked against :data:`INTEGRITY`."""
    path = cache / f"pyodide-{VERSION}.tgz"
    if path.exists():
        data = path.read_bytes()
    else:
        print(f"downloading {TARBALL}", file=sys.stderr)
        with urllib.request.urlopen(TARBALL, timeout=120) as response:
            data = response.read()
    digest = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != INTEGRITY:
        path.unlink(missing_ok=True)
        raise SystemExit(f"{TARBALL}: sha512 {digest}, expected {INTEGRITY}: not used")
    cache.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _script(name: str, value: str) -> str:
    return f"(self.calculatorData ||= {{}})[{json.dumps(name)}] = {value};\n"


def write_vendor(out: Path, cache: Path) -> dict[str, int]:
    """Every file the worker needs, as a classic script; their sizes."""
    for stale in out.glob("*") if out.exists() else ():
        stale.unlink()  # a file an older build wrote (the loader was once shipped as it is)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tarball(cache))) as tar:
        members = {n: tar.extractfile(f"package/{n}").read() for n in (*BINARY, *TEXT)}
    for name in BINARY:
        encoded = json.dumps(base64.b64encode(members[name]).decode())
        (out / f"{name}.js").write_text(_script(name, encoded))
    for name in ("pyodide.mjs", "pyodide.asm.mjs"):
        (out / f"{name}.js").write_text(_script(name, json.dumps(members[name].decode())))
    (out / "pyodide-lock.json.js").write_text(
        _script("pyodide-lock.json", members["pyodide-lock.json"].decode())
    )
    (out / "labsupport.js").write_text(_script("labsupport", json.dumps(python_files())))
    return {p.name: p.stat().st_size for p in sorted(out.iterdir())}


def main(argv: list[str]) -> None:
    from tools.site_calculator_html import write_pages

    build = ROOT / "_build"
    sizes = write_vendor(build / "_vendor" / "calculator", build / "downloads")
    write_pages(build / "calculator")
    total = sum(sizes.values())
    print(f"calculator: Pyodide {VERSION} and labsupport, {total / 1e6:.1f} MB", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
