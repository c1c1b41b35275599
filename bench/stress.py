"""Launch stress test: ``python -m bench.stress N``, N launches of a function that does
nothing; every failure is counted and its first line printed.

A function that does no collective is the hardest case for process-group setup: a
fast rank can finish and leave while a slow one is still connecting (the barrier at
the end of :func:`labsupport.launch.runtime.init_process_group` prevents it). Run
beside busy processes (``make stress``) to make the ranks slow and uneven.
"""

from __future__ import annotations

import collections
import sys
import time

from labsupport import LaunchError, launch


def noop():
    return None


def main(launches: int, world_size: int = 4) -> int:
    failures: collections.Counter = collections.Counter()
    start = time.perf_counter()
    for i in range(launches):
        try:
            launch(noop, world_size, timeout=120)
        except LaunchError as exc:
            failures[str(exc).splitlines()[0][:160]] += 1
        if (i + 1) % 100 == 0:
            print(f"{i + 1} launches, {sum(failures.values())} failed", flush=True)
    elapsed = time.perf_counter() - start
    print(
        f"{launches} launches of {world_size} ranks in {elapsed:.0f} s "
        f"({elapsed / launches * 1e3:.0f} ms each): {sum(failures.values())} failed"
    )
    for message, count in failures.most_common():
        print(f"  {count} x {message}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:])))
