"""labsupport: the code the labs of *Distributed Training, Hands-On* run.

Every distributed function here runs on several real processes, started from a
notebook cell by :func:`launch` or on a cluster by ``torchrun -m labsupport.run``.
"""

from labsupport.launcher import LaunchError, LaunchTimeout, launch, warm_up
from labsupport.runtime import device

__all__ = ["LaunchError", "LaunchTimeout", "device", "launch", "warm_up"]
