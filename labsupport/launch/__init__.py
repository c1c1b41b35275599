"""Starting ranks: :func:`launch` from a notebook, the rank side, the device each rank uses.

* :mod:`~labsupport.launch.launcher`: :func:`launch`, ranks forked from a forkserver that
  imported torch once, with the environment torchrun gives its workers;
* :mod:`~labsupport.launch.preload`: what that forkserver imports, and why;
* :mod:`~labsupport.launch.ranks`: the launcher's view of each rank and its live output;
* :mod:`~labsupport.launch.leftovers`: what a launch's ranks started and left running;
* :mod:`~labsupport.launch.errors`: :class:`LaunchError`, naming the root-cause rank;
* :mod:`~labsupport.launch.worker`: what runs inside each rank;
* :mod:`~labsupport.launch.runtime`: the backend (gloo, or gloo + NCCL on GPUs), the rank's
  :func:`device`, :func:`init_process_group` for torchrun;
* :mod:`~labsupport.launch.loopback`: the stores and sockets of a launch on one machine
  listen on the loopback interface only;
* :mod:`~labsupport.launch.nodes`: several "nodes" on this machine, one launcher each
  (:func:`~labsupport.launch.nodes.torchrun_nodes`), and
  :mod:`~labsupport.launch.local_torchrun`, the torchrun they run.

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
