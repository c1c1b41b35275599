"""The rank side of :func:`labsupport.launch`: one process, one rank, one call.

The launcher's forkserver imports this module (and with it ``torch``) once; every rank
is then a fork of that clean, single-purpose process, which takes milliseconds where a
fresh interpreter takes seconds. :func:`rank_main` turns the fork into a rank:

1. a session of its own (so the launcher can stop it and anything it starts), and a
   parent-death signal (so it cannot outlive the forkserver);
2. standard output and error redirected into pipes the launcher reads;
3. the torchrun environment, then ``torch.distributed`` initialised from it;
4. the user's function called, and its return value or its traceback sent back.

The launcher and torchrun's elastic agent share this division of labour: see
``torch/distributed/elastic/agent/server/local_elastic_agent.py``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import time
import traceback

import cloudpickle
import torch
import torch.distributed as dist

from labsupport.launch import runtime

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the forkserver) exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher still kills ranks itself
        pass


def _redirect(fd: int, conn) -> None:
    os.dup2(conn.fileno(), fd)
    conn.close()


def _error_report(exc: BaseException) -> dict:
    """What the launcher shows for a rank that raised: the traceback from ``fn`` down."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _call.__code__:
        tb = tb.tb_next
    tb = tb.tb_next if tb is not None else exc.__traceback__  # start inside fn
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": text,
        "time": time.time(),
    }


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def rank_main(job: dict, result_conn, out_conn, err_conn) -> None:
    """Run one rank of a launch (the target of the launcher's ``Process``)."""
    os.setsid()
    _die_with_parent()
    _redirect(1, out_conn)
    _redirect(2, err_conn)
    sys.stdout = os.fdopen(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, encoding="utf-8", closefd=False)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=False)

    os.environ.clear()
    os.environ.update(job["env"])
    # torch.distributed read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it,
    # before this rank's environment existed: read it again, as a fresh torchrun worker would
    dist.set_debug_level_from_env()
    torch.set_num_threads(job["num_threads"])

    try:
        fn, args, kwargs = cloudpickle.loads(job["payload"])
        runtime.init_process_group(job["backend"], timeout=job["timeout"])
        try:
            result = _call(fn, args, kwargs)
        except SystemExit as exc:  # sys.exit(0) inside fn counts as success
            if exc.code not in (0, None):
                raise
            result = None
        try:
            message = ("ok", cloudpickle.dumps(result))
        except Exception as exc:
            raise TypeError(
                f"the return value of rank {os.environ['RANK']} cannot be pickled "
                f"({exc}); return tensors, numbers, strings or containers of them"
            ) from exc
        if dist.is_initialized():  # fn may have torn it down itself
            dist.destroy_process_group()
    except BaseException as exc:
        message = ("error", _error_report(exc))
    sys.stdout.flush()
    sys.stderr.flush()
    result_conn.send_bytes(cloudpickle.dumps(message))
    result_conn.close()
    if message[0] == "error":
        # Leave at once, without interpreter teardown: the peers blocked in a
        # collective with this rank see its sockets close and fail fast.
        os._exit(1)
