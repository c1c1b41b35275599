"""Run a command with busy processes beside it: ``python -m tools.busy N -- COMMAND...``.

Each busy process spins on one core for as long as the command runs, as another job
on a shared machine would. The course's stored outputs and asserts must hold under
such load; ``make nbval-portable`` and the launch stress test use this.
"""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m tools.busy N -- COMMAND...")
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(argv[0]))
    ]
    try:
        return subprocess.call(argv[2:])
    finally:
        for process in busy:
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
