"""``python -m bench.compare OLD.json NEW.json``: two runs of ``make bench`` (two commits,
or two machines) line by line: each line's median and its value over the floor, old and
new, and the machines and loads they ran under."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(old: dict, new: dict) -> list[tuple]:
    """``(bench, line, old median, new median, old x floor, new x floor)`` for every line
    of either run (``None`` where a run lacks it)."""
    out = []
    for bench in dict.fromkeys([*old["benches"], *new["benches"]]):
        lines = [{ln["name"]: ln for ln in run["benches"].get(bench, {}).get("lines", [])}
                 for run in (old, new)]  # fmt: skip
        for name in dict.fromkeys([*lines[0], *lines[1]]):
            a, b = (ln.get(name) for ln in lines)
            out.append(
                (bench, name, *(ln and ln["value"] for ln in (a, b)),
                 *(ln and ln["of_floor"] and ln["of_floor"]["median"] for ln in (a, b)))
            )  # fmt: skip
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m bench.compare OLD.json NEW.json (files make bench wrote)")
        return 2
    old, new = (json.loads(Path(path).read_text()) for path in argv)
    for label, run in (("old", old), ("new", new)):
        m = run["machine"]
        print(f"{label}: {run['started']}, {m['cpu_model']}, {m['cores']} cores, load average "
              f"{m['load_average_before'][0]:.1f}, {run['seconds']:.0f} s")  # fmt: skip
    print(f"{'bench':17s} {'line':52s} {'old':>10s} {'new':>10s} {'old x fl':>9s} {'new x fl':>9s}")
    for bench, name, *values in rows(old, new):
        print(f"{bench:17s} {name[:52]:52s} " + " ".join(f"{_fmt(v):>9s}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
