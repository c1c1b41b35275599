"""What every bench shares: runs timed in turns, the one statistic of a comparison, the
line that holds a figure against its floor, the target line, and the JSON record.

One statistic everywhere: the **median of paired ratios**. Two runs that alternate, round
after round, see the same machine load; the ratio of each round's pair cancels what the
load did to both, and the median over the rounds discards the rounds a burst of load hit
one side of. Its spread is the smallest and the largest pair's ratio. The table and the
target line print the same :class:`Ratio`, so they cannot disagree.

A floor is what the machine allows, measured in the same run (a copy of the same bytes,
the same compute without communication, a bare ``fork``); "3.10x of the floor" is the
measured time over the floor's, so 1.00x is all there is to win.

``python -m bench`` (``make bench``) runs every bench with :data:`RECORD_ENV` naming a
file, into which :func:`record` writes the bench's figures as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

#: The environment variable naming the file :func:`record` writes (unset: none).
RECORD_ENV = "BENCH_RECORD"


@dataclass(frozen=True)
class Ratio:
    """The median of ``n`` ratios, with the smallest and the largest (the spread)."""

    median: float
    low: float
    high: float
    n: int
    over: str = "pairs"

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f}, {self.n} {self.over})"

    def as_dict(self) -> dict:
        return asdict(self)


def ratios(values, over: str = "pairs") -> Ratio:
    """The :class:`Ratio` of ratios already formed (one per pair, rank, ...)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no ratios to summarise: run at least one round")
    return Ratio(statistics.median(values), min(values), max(values), len(values), over)


def paired(numerators, denominators, over: str = "pairs") -> Ratio:
    """The median of ``numerators[i] / denominators[i]`` over the pairs, with its spread.

    Unlike the ratio of two medians, each ratio compares runs made side by side."""
    numerators, denominators = list(numerators), list(denominators)
    if len(numerators) != len(denominators):
        raise ValueError(
            f"paired runs must come in pairs: {len(numerators)} against {len(denominators)}"
        )
    if any(d <= 0 for d in denominators) or any(x < 0 for x in numerators):
        raise ValueError("times and sizes must be positive to form ratios")
    return ratios([x / d for x, d in zip(numerators, denominators, strict=True)], over)


def in_turns(runs: dict[str, Callable[[], float]], rounds: int, warmup: int = 0) -> dict:
    """Call every run in turns, round after round, each returning its own measurement;
    every other round in the reverse order (A B, B A, A B, ...), so that no run always
    follows the same one. The first ``warmup`` rounds are dropped. Returns each run's
    list, in round order."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    out: dict[str, list] = {name: [] for name in runs}
    for i in range(warmup + rounds):
        for name, run in list(runs.items())[:: -1 if i % 2 else 1]:
            value = run()
            if i >= warmup:
                out[name].append(value)
    return out


def slowest(fn: Callable[[], object]) -> Callable[[], float]:
    """``fn`` timed on every rank from a barrier to the slowest rank's end (a collective
    is done when every rank is); every rank gets the seconds."""
    import torch
    import torch.distributed as dist

    from labsupport.launch.runtime import synchronize

    def timed() -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        synchronize()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    return timed


def line(
    name: str,
    value: float,
    unit: str,
    of_floor: Ratio | None = None,
    floor: str | None = None,
    vs: tuple[str, Ratio] | None = None,
    detail: str | None = None,
) -> dict:
    """One bench line: a measured ``value`` (the median, in ``unit``: ``"s"``, ``"B"`` or
    any other), ``of_floor``, the value over the floor, which ``floor`` describes, and
    ``vs``, the peer's name and the ratio to it. The peer's own line (the reference the
    others are held against) has neither ratio. ``detail``, a figure printed beside the
    name (a bandwidth, a throughput), keeps ``name`` the same from run to run."""
    if (of_floor is None) != (floor is None):
        raise ValueError("give of_floor= with floor=, or neither")
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "vs": None if vs is None else {"peer": vs[0], **vs[1].as_dict()},
        "of_floor": None if of_floor is None else of_floor.as_dict(),
        "floor": floor,
        "detail": detail,
    }


def timed(
    name: str,
    seconds: list,
    floor_seconds: list,
    floor: str,
    vs: tuple[str, Ratio] | None = None,
    detail: str | None = None,
) -> dict:
    """The :func:`line` of a time measured round after round, ``seconds``, against its
    floor measured in the same rounds, ``floor_seconds``: their median, and the median of
    the rounds' pairs' ratios."""
    return line(
        name, statistics.median(seconds), "s", paired(seconds, floor_seconds), floor, vs, detail
    )


def against_floor(
    names: tuple[str, str], launches: list[dict], peers: list[list], floor: str
) -> list[dict]:
    """The lines of a parallel step held against the floor timed in turns with it in the
    same launch, and against one process, launched in turns with it: round ``i`` of
    :func:`in_turns` gave ``launches[i]``, the step's seconds and its floor's (``"step"``
    and ``"floor"``, in turns, one pair a round), and ``peers[i]``, one process's seconds.
    ``names``: the peer's line, the step's. Over its floor the step is the median of the
    pairs; against the peer, of the rounds' pairs of the two launches' medians."""
    step = [t for run in launches for t in run["step"]]
    under = [t for run in launches for t in run["floor"]]
    medians = [statistics.median(run["step"]) for run in launches]
    vs = ("one process", paired(medians, [statistics.median(p) for p in peers]))
    described = f"{floor}; median {statistics.median(under) * 1e3:.1f} ms"
    return [
        line(names[0], statistics.median([t for p in peers for t in p]), "s"),
        timed(names[1], step, under, described, vs),
    ]


def print_lines(lines: list[dict], peer: str = "x peer") -> None:
    """The lines as a table: the median, the ratio to the peer and the value over the
    floor, each with its spread; then what each floor is (once, if several share it)."""
    names = [ln["name"] + (f", {ln['detail']}" if ln["detail"] else "") for ln in lines]
    width = max(map(len, names))
    print(f"{'':{width}s} {'median':>10s}  {peer:31s} x of the floor")
    for ln, name in zip(lines, names, strict=True):
        vs, value = _ratio(ln["vs"]), _value(ln["value"], ln["unit"])
        print(f"{name:{width}s} {value:>10s}  {vs:31s} {_ratio(ln['of_floor'])}".rstrip())
    described = {}
    for ln in lines:
        if ln["floor"]:
            described.setdefault(ln["floor"], []).append(ln["name"])
    for text, names in described.items():
        text = f"floor{'' if len(described) == 1 else ' of ' + ', '.join(names)}: {text}"
        print(textwrap.fill(text, 92, initial_indent="  ", subsequent_indent="    "))


def _ratio(d: dict | None) -> str:
    return "" if d is None else str(Ratio(**{k: d[k] for k in FIELDS}))


FIELDS = ("median", "low", "high", "n", "over")


def _value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"
    if unit == "B":
        return f"{value:,.0f} B"
    return f"{value:.3g} {unit}"


def target(what: str, value: str, ok: bool) -> dict:
    """A target and whether it was met: ``what`` it asks, the ``value`` reached."""
    return {"text": f"target: {what} -> {value} ({'met' if ok else 'MISSED'})", "met": bool(ok)}


def record(bench: str, config: dict, lines: list[dict], targets: list[dict]) -> int:
    """Print the targets, write the bench's record where :data:`RECORD_ENV` says, and
    return the exit code: 0 if every target was met."""
    for t in targets:
        print(t["text"])
    rec = {"bench": bench, "config": config, "lines": lines, "targets": targets}
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(rec, f, indent=1)
    return 0 if all(t["met"] for t in targets) else 1
