"""Counting the FLOPs a model really runs, with PyTorch's ``FlopCounterMode``.

``torch.utils.flop_counter.FlopCounterMode`` intercepts every operation at the
dispatcher and counts matrix multiplications (2 FLOPs per multiply-add) and
convolutions: the operations :mod:`labsupport.estimate.flops` counts. Elementwise
operations, softmax and layer norms are left out, as in the formulas.
"""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode


def count_flops(fn, *args, **kwargs) -> int:
    """FLOPs of matrix multiplications run by ``fn(*args, **kwargs)``, forward and backward
    alike (a ``.backward()`` inside ``fn`` is counted too)."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()
