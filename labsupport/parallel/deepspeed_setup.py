"""DeepSpeed set-up: which accelerator it runs on, chosen before it is imported.

DeepSpeed picks its *accelerator* when it is first imported: CUDA where torch sees a
GPU, the CPU otherwise, and ``DS_ACCELERATOR`` chooses explicitly
(``deepspeed/accelerator/real_accelerator.py``). Its CPU accelerator talks over oneCCL when
``oneccl_bindings_for_pytorch`` is installed and over gloo otherwise.
"""

from __future__ import annotations

import contextlib
import os

from labsupport.launch.runtime import device


def use_deepspeed_accelerator() -> str:
    """Tell DeepSpeed which accelerator to use (before it is imported): the device the
    course's code computes on, this rank's GPU or the CPU."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device().type == "cuda" else "cpu")
    return os.environ["DS_ACCELERATOR"]


@contextlib.contextmanager
def cpu_accelerator():
    """DeepSpeed's CPU accelerator in this process, without leaving ``DS_ACCELERATOR``
    in the environment that ranks started later inherit (they choose their own)."""
    before = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = before
