"""``python -m labsupport.launch.local_torchrun ARGS``: torchrun for "nodes" that all run on
this machine, with everything it listens on bound to the loopback interface.

``ARGS`` are torchrun's own, and torchrun (``torch.distributed.run.main``) runs them. On a
cluster the nodes must reach each other's stores, so torchrun's stores listen on every
interface; when every node is this machine, nothing needs to, and this module keeps them
on 127.0.0.1 (see :mod:`~labsupport.launch.loopback`):

1. ``--local-addr`` defaults to 127.0.0.1, the address this node announces to the others
   and gives its workers as ``MASTER_ADDR`` (torchrun's default is the machine's FQDN);
2. when the rendezvous endpoint (``--rdzv-endpoint`` for c10d, ``--master-addr`` and
   ``--master-port`` for the static rendezvous on node 0) is a loopback address, this
   node first tries to host that store on loopback; torchrun's own store for the same
   port, in the same process (``multi_tenant=True``), is then this one. If another node
   holds the port already, this node joins it, as torchrun would;
3. the store that the node of rendezvous rank 0 starts for the workers, on a port of its
   own (``DynamicRendezvousHandler._create_tcp_store_server`` in torch 2.13, which listens
   on every interface), is started on loopback when the node's address is loopback;
4. the workers' gloo and NCCL sockets go to the loopback interface.

Nothing else changes: the agent, the rendezvous, the restarts and the workers'
environment are torchrun's.
"""

from __future__ import annotations

import os
import sys


def _endpoint(args) -> tuple[str, int]:
    """The host and port of the store this node may host, from torchrun's arguments."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if args.standalone or args.rdzv_backend == "static":
        if args.standalone or args.node_rank != 0:
            return "", 0
        return args.master_addr, args.master_port
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return "", 0
    return parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)


def _loopback_worker_store(original):
    def create(self, master_addr, master_port):
        from labsupport.launch import loopback

        if loopback.is_loopback(master_addr):
            return loopback.store_server(master_port)
        return original(self, master_addr, master_port)

    return create


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from labsupport.launch import loopback

    argv = list(sys.argv[1:] if argv is None else argv)
    args = run.get_args_parser().parse_args(argv)
    if args.local_addr is None:
        argv.insert(0, f"--local-addr={loopback.LOOPBACK}")
    os.environ.update(loopback.environment())  # the workers inherit it
    server = loopback.host_store(*_endpoint(args))  # noqa: F841 - kept for the agent's life
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    handler._create_tcp_store_server = _loopback_worker_store(handler._create_tcp_store_server)
    run.main(argv)


if __name__ == "__main__":
    main()
