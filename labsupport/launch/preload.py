"""What the launcher's forkserver imports once, so that no rank imports it again.

Every rank is a fork of the forkserver (:mod:`~labsupport.launch.launcher`): a module
the server imported, every rank has for free; one it did not, every rank of every launch
imports anew. ``torch`` alone is not enough. The first ``torch.optim`` optimizer a rank
creates calls functions wrapped in ``torch._disable_dynamo``, which import
``torch._dynamo`` (and with it ``torch._inductor``, ``sympy`` and some 800 modules) on
first use: 2.5 to 3.5 s per launch on 2 cores, against about 0.1 s for the launch itself.
A first forward and backward, a first collective, DDP and the course's GPT import
nothing more.

Only modules are imported here; no tensor is computed. A fork of a process that runs
threads is unsafe (a lock held by another thread stays locked in the child), and running
a backward pass or touching CUDA would start threads or a CUDA context that every rank
would inherit. The one thread an import does start, OpenBLAS's worker pool (numpy's
BLAS, started when numpy is loaded), is stopped by :func:`stop_blas_threads` before the
server forks anything: it is what OpenBLAS's own ``pthread_atfork`` handler does before
every fork, and a rank that multiplies numpy matrices starts the pool again.
"""

from __future__ import annotations

import ctypes
import importlib

import torch  # noqa: F401  - every rank needs it; the worker imports it too

#: Imported in the forkserver, in this order: (module, why).
MODULES = [
    ("labsupport.launch.worker", "the rank side: torch, torch.distributed, cloudpickle"),
    ("torch._dynamo", "the first torch.optim optimizer a rank creates imports it: 2.5-3.5 s"),
    ("torch.distributed.checkpoint", "labsupport.parallel.checkpoint (labs 14, 16): 0.15 s"),
    ("torch.distributed.optim", "ZeroRedundancyOptimizer, compared against in tests: 0.5 s"),
]


def stop_blas_threads() -> int:
    """Stop OpenBLAS's idle worker threads in this process; return how many libraries
    did so. OpenBLAS exports ``blas_thread_shutdown_`` and calls it itself before a
    fork; the pool starts again at the next multithreaded BLAS call."""
    stopped = 0
    for path in _loaded_libraries("openblas"):
        shutdown = getattr(ctypes.CDLL(path), "blas_thread_shutdown_", None)
        if shutdown is not None:
            shutdown()
            stopped += 1
    return stopped


def _loaded_libraries(name: str) -> list[str]:
    """Paths of the shared libraries this process has loaded whose file name has ``name``."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:  # not Linux: nothing to stop
        return []
    return sorted(p for p in paths if name in p.rsplit("/", 1)[-1].lower())


for _name, _why in MODULES:
    importlib.import_module(_name)
stop_blas_threads()
