"""Re-execute labs in place and store their outputs: ``python -m tools.execute LAB...``.

Uses nbclient, the executor nbval and Jupyter Book build on, with widget state stored
so that interactive figures still render on the static website. Each lab gets a kernel
of its own that talks over Unix sockets in a temporary folder (IPC), as ``make lab``'s
do: no TCP port, no "running over TCP without encryption" warning. Prints each lab's
run time (the course's budget is about a minute per lab on two cores).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient


def ipc_kernel_manager(folder) -> KernelManager:
    """A manager for a Python kernel reached through Unix sockets in ``folder`` (IPC): no
    TCP port that another program could take or reach, no connection file among other
    kernels'. nbclient shuts down only the kernels it makes itself: whoever starts this
    one shuts it down."""
    return KernelManager(
        kernel_name="python3",
        transport="ipc",
        ip=os.path.join(folder, "channel"),
        connection_file=os.path.join(folder, "kernel.json"),
    )


def execute(path: Path, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timestamps would churn every diff
    with tempfile.TemporaryDirectory(prefix="execute-") as folder:
        manager = ipc_kernel_manager(folder)
        client = NotebookClient(
            nb,
            km=manager,
            timeout=timeout,
            resources={"metadata": {"path": str(path.parent)}},
            store_widget_state=True,
            record_timing=False,
        )
        start = time.perf_counter()
        try:
            client.execute()
        finally:
            if manager.has_kernel:
                manager.shutdown_kernel(now=True)
        elapsed = time.perf_counter() - start
    nbformat.write(nb, path)
    return elapsed


def main(paths: list[str]) -> None:
    for name in paths:
        elapsed = execute(Path(name))
        print(f"{name}: executed in {elapsed:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
