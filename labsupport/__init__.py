"""labsupport: the code the labs of *Distributed Training, Hands-On* run.

Every distributed function here runs on several real processes, started from a
notebook cell by :func:`launch` or on a cluster by ``torchrun -m labsupport.run``.
The package is layered; a layer imports only the ones above it in this list:

* ``launch``: :func:`launch`, the rank side, :func:`device`, the torchrun entry;
* ``comm``: point-to-point exchange, the collectives, all-reduce algorithms, cost models;
* ``models``: one GPT, an MLP, a CNN, and data made in code;
* ``parallel``: one module per strategy (data, pipeline, tensor parallel, ZeRO, ...);
* ``estimate``: the calculators, and every datasheet number with its source;
* ``measure``: timing, memory tracking, FLOP counting, machine probes;
* ``viz``: the course's one figure style and its drawings;
* ``labs``: what one lab needs and nothing else, one module per lab.

``launch``, ``comm``, ``parallel`` and ``models`` are what a user takes to a cluster:
they never import matplotlib or ipywidgets.
"""

from labsupport.launch import LaunchError, LaunchTimeout, device, launch, warm_up

__all__ = ["LaunchError", "LaunchTimeout", "device", "launch", "warm_up"]
