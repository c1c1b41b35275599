"""Communication: messages, collectives, all-reduce algorithms, their cost, measured.

* :mod:`~labsupport.comm.p2p`: the counted point-to-point exchange every algorithm uses;
* :mod:`~labsupport.comm.collectives`: broadcast, reduce, scatter, gather, all-gather,
  reduce-scatter and all-to-all, from point-to-point messages;
* :mod:`~labsupport.comm.allreduce`: all-reduce five ways, and the bytes each sends;
* :mod:`~labsupport.comm.cost`: the alpha-beta model and the cost of each collective;
* :mod:`~labsupport.comm.measure`: ping-pong and all-reduce timings on real ranks;
* :mod:`~labsupport.comm.flat`: where each piece lies in a flat buffer (buckets, shards,
  chunks).
"""

from labsupport.comm.allreduce import all_reduce
from labsupport.comm.collectives import (
    all_gather,
    all_to_all,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from labsupport.comm.p2p import count_traffic

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "count_traffic",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]
