"""What one lab needs and nothing else: one module per lab, named after it.

``labNN_slug`` holds the lab's own helpers (labelled runs, tables) and the checkers of
its exercises; :mod:`~labsupport.labs.cells` what every lab's cells share. These modules
may use every other layer of the package, widgets and plotting included; nothing else
imports them. :func:`reset` (:mod:`~labsupport.labs.attempts`) starts an exercise afresh
after an attempt that crashed or hung.
"""

from labsupport.labs.attempts import reset

__all__ = ["reset"]
