"""``python -m bench`` (``make bench``): every bench in turn, each in a process of its own,
its tables printed as it goes; then all their figures, with what the machine is and how
loaded it was, in one JSON file (``_build/bench.json``), so that two runs, or two
machines, can be compared line by line.

Every rank and every single process computes with one thread (``LABSUPPORT_THREADS=1``,
unless set): on a machine others share, a process's second thread waits at each
kernel's end for the first, which a busy core holds up; one thread each keeps the
comparisons between the benches' runs fair at any load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.report import RECORD_ENV

BENCHES = (
    "launch",
    "allreduce",
    "ddp",
    "three_d",
    "zero_memory",
    "context_parallel",
    "expert_parallel",
)
ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    """What the figures were measured on, and the load average when they started."""
    from labsupport.measure.probe import machine_info

    return machine_info() | {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "load_average_before": os.getloadavg(),
        "labsupport_threads": os.environ["LABSUPPORT_THREADS"],
    }


def run(name: str) -> dict:
    """Run bench ``name`` in a process of its own; its record, exit code and seconds."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.json"
        load = os.getloadavg()
        start = time.perf_counter()
        code = subprocess.call(
            [sys.executable, "-m", f"bench.{name}"],
            cwd=ROOT,
            env=os.environ | {RECORD_ENV: str(path)},
        )
        seconds = time.perf_counter() - start
        record = json.loads(path.read_text()) if path.exists() else {"bench": name}
    return record | {"exit_code": code, "seconds": round(seconds, 1), "load_average_before": load}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benches", nargs="*", default=BENCHES, help="which (default: all)")
    parser.add_argument("--out", default=str(ROOT / "_build" / "bench.json"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.benches) - set(BENCHES))
    if unknown:
        parser.error(f"no bench {unknown}; the benches: {', '.join(BENCHES)}")
    os.environ.setdefault("LABSUPPORT_THREADS", "1")
    out = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    start = time.perf_counter()
    records = [run(name) for name in args.benches]
    out |= {
        "seconds": round(time.perf_counter() - start, 1),
        "load_average_after": os.getloadavg(),
        "benches": {r["bench"]: r for r in records},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    failed = [r["bench"] for r in records if r["exit_code"]]
    before, after = out["machine"]["load_average_before"], out["load_average_after"]
    cores = out["machine"]["cores"]
    print(
        f"\n{len(records)} benches in {out['seconds']:.0f} s on {cores} cores (load average "
        f"{before[0]:.1f} before, {after[0]:.1f} after); figures in {os.path.relpath(args.out)}"
    )
    if failed:
        print(f"targets MISSED or benches failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
