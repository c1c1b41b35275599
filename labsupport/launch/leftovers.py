"""What a launch can leave behind, found and stopped.

The launcher stops its ranks however a launch ends, and a rank's session with them
(:meth:`~labsupport.launch.ranks.RankProcess.kill`). A process that a rank started in a
session of its own escapes that: torchrun's workers, a DeepSpeed launcher's, or any
``subprocess.Popen(..., start_new_session=True)``. When its rank is killed it is
re-parented to ``init``, outside the kernel's process tree, and runs on.

It still carries its rank's environment, and with it ``TORCHELASTIC_RUN_ID``, which the
launcher makes unique to one launch (``labsupport-<launcher's pid>-<n>``): that is how
:func:`started_by` finds it. torchrun's agent finds its workers by process group
instead (``torch/distributed/elastic/multiprocessing/api.py``), which a process in a
session of its own leaves too.
"""

from __future__ import annotations

import contextlib

import psutil

#: How long a process gets to exit on SIGTERM before it is killed.
TERMINATE_GRACE_S = 1.0


def _run_id(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error, OSError):
        return proc.environ().get("TORCHELASTIC_RUN_ID", "")
    return ""


def started_by(run_id: str, prefix: bool = False) -> list[psutil.Process]:
    """The running processes whose ``TORCHELASTIC_RUN_ID`` is ``run_id`` (or starts with
    it, with ``prefix``): a launch's ranks and everything they started, wherever it
    now sits in the process tree. Only this user's processes can be read, and only they
    can have been started by this user's launches."""
    found = []
    for proc in psutil.process_iter():
        run = _run_id(proc)
        if run == run_id or (prefix and run.startswith(run_id)):
            found.append(proc)
    return found


def describe(proc: psutil.Process) -> str:
    """``pid 1234 (sleep 600)``: a process as a reader can tell it apart."""
    with contextlib.suppress(psutil.Error):
        return f"pid {proc.pid} ({' '.join(proc.cmdline())[:60] or proc.name()})"
    return f"pid {proc.pid}"


def stop(processes: list[psutil.Process]) -> list[str]:
    """SIGTERM each process, SIGKILL those still running after :data:`TERMINATE_GRACE_S`;
    the descriptions of those that were running."""
    stopped = []
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            stopped.append(describe(proc))
            proc.terminate()
    _, alive = psutil.wait_procs(processes, timeout=TERMINATE_GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=TERMINATE_GRACE_S)
    return stopped
