"""Starting ranks: :func:`launch` from a notebook, the rank side, the device each rank uses.

* :mod:`~labsupport.launch.launcher`: :func:`launch`, ranks forked from a forkserver that
  imported torch once, with the environment torchrun gives its workers;
* :mod:`~labsupport.launch.ranks`: the launcher's view of each rank and its live output;
* :mod:`~labsupport.launch.errors`: :class:`LaunchError`, naming the root-cause rank;
* :mod:`~labsupport.launch.worker`: what runs inside each rank;
* :mod:`~labsupport.launch.runtime`: the backend (gloo, or gloo + NCCL on GPUs), the rank's
  :func:`device`, :func:`init_process_group` for torchrun.

``python -m labsupport.run module:function`` runs the same functions under torchrun.
"""

from labsupport.launch.errors import LaunchError, LaunchTimeout
from labsupport.launch.launcher import launch, warm_up
from labsupport.launch.runtime import device, init_process_group, resolve_backend, synchronize

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "device",
    "init_process_group",
    "launch",
    "resolve_backend",
    "synchronize",
    "warm_up",
]
