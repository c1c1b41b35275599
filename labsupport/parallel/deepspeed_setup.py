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


#: What a learner sees while DeepSpeed compiles its CPU op: 43 s in one process and 50 s
#: when four ranks start at once, on two busy cores.
BUILDING_SHM_COMM = (
    "building DeepSpeed's C++ extension (deepspeed_shm_comm): first time only, about a minute"
)


def shm_comm_needs_building() -> bool:
    """Whether DeepSpeed will compile the C++ op its CPU accelerator's first process
    group loads, the shared-memory all-reduce (``build_shm_op`` in
    ``deepspeed/comm/torch.py``): the accelerator has it and can build it (the op's
    ``is_compatible``, which DeepSpeed's probe of every op asks; probing every op would
    run compilers whose errors a notebook shows), it was not installed with DeepSpeed,
    and torch's extension folder (``~/.cache/torch_extensions``) holds no build of it
    from this installation. ``torch.utils.cpp_extension.load`` writes the folder's
    ``build.ninja`` anew on every load, and ninja builds again when a command changed:
    when torch or DeepSpeed is now at another path. Call it with DeepSpeed's accelerator
    chosen (:func:`use_deepspeed_accelerator`, :func:`cpu_accelerator`)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory, include_paths

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        return False
    if installed_ops.get(builder.name, False):
        return False
    folder = _get_build_directory(builder.name, verbose=False)
    ninja = os.path.join(folder, "build.ninja")
    if not os.path.exists(os.path.join(folder, f"{builder.name}.so")) or not os.path.exists(ninja):
        return True
    with open(ninja, encoding="utf-8") as f:
        commands = f.read()
    paths = [os.path.dirname(deepspeed.__file__), include_paths()[0]]
    return not all(path in commands for path in paths)
