"""Nothing a launch on one machine starts is reachable from another machine.

The rendezvous store has no authentication: whoever reaches its port can read and write
the keys through which the ranks find each other. On a cluster it must listen where the
other nodes reach it (a private network); on a laptop, on a café's Wi-Fi, nothing outside
the machine should reach it at all. Two things stand in the way:

* torch's ``TCPStore`` server listens on **every** interface, whatever host it is given:
  ``TCPStore("127.0.0.1", 0, is_master=True)`` binds ``::`` (torch 2.13,
  ``torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp``). It also accepts a socket
  that is already listening (``master_listen_fd``): :func:`store_server` binds one to
  127.0.0.1 and hands it over. With ``multi_tenant=True`` torch keeps one server per port
  in a process (``TCPServer::start``), so a store that torch's own ``env://`` or
  ``tcp://`` rendezvous, or torchrun's c10d rendezvous, creates afterwards for the same
  port in the same process is served by this one: :func:`host_env_store` and
  :func:`host_store` open it first.
* gloo listens on the address the machine's host name resolves to, often the LAN address
  (``ProcessGroupGloo::createDefaultDevice``), and NCCL's bootstrap on the first
  non-loopback interface: :func:`environment` points both at the loopback interface
  (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).

:func:`listening` lists what a process and its descendants listen on, as ``ss -ltnp``
does; the tests hold every kind of launch to it.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import socket
import threading
from datetime import timedelta

import psutil

#: The address every store of a launch on one machine listens on.
LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name, ``localhost``) is this machine's loopback."""
    addresses = _addresses(host)
    return bool(addresses) and all(_loopback_address(a) for a in addresses)


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()


def _loopback_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])  # fe80::1%eth0: drop the scope
    if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        ip = ip.ipv4_mapped
    return ip.is_loopback


def store_server(port: int = 0, timeout: float = 300):
    """A ``TCPStore`` server listening on 127.0.0.1 only, at ``port`` (0: any free port).

    The socket is bound here and handed to the store, which owns it from then on and
    closes it when the last store using its server goes (so the socket object is
    detached: Python must not close it under the running server). ``multi_tenant``: a
    store torch creates later in this process for the same port shares this server.
    Raises ``OSError`` if the port is taken.
    """
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
        store = TCPStore(
            LOOPBACK,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            multi_tenant=True,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server closes the descriptor when it stops
    return store


def host_store(host: str, port: int):
    """:func:`store_server` on ``port`` if ``host`` is a loopback address, else ``None``.

    Call it, on the process that is to host the store, before torch creates its own
    server for ``host:port``, and keep the result until the process group exists. A
    port already taken (by a server of this process torch shares, or by another process)
    gives ``None``: torch's own attempt then reports or shares it as before. So does a
    host that does not resolve to 127.0.0.1 (``::1``): its clients would not reach it.
    """
    if not port or not is_loopback(host) or LOOPBACK not in _addresses(host):
        return None
    try:
        return store_server(port)
    except OSError:
        return None


def host_env_store():
    """The store ``env://`` would make this process host, opened first on loopback.

    Under ``init_method="env://"`` rank 0 hosts the store at ``MASTER_ADDR:MASTER_PORT``
    unless a launcher's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``, as
    torchrun's and :func:`~labsupport.launch.launch`'s ranks see). ``None`` when this
    process does not host it or ``MASTER_ADDR`` is not a loopback address.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or env.get("RANK", "0") != "0":
        return None
    return host_store(env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT") or 0))


@functools.cache
def interface() -> str:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return "lo"


def environment() -> dict:
    """Variables that make gloo and NCCL listen on the loopback interface only."""
    name = interface()
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


def listening(pid: int) -> set[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket that process ``pid`` and its
    descendants listen on (what ``ss -ltnp`` shows for them)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            for conn in proc.net_connections("tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((proc.pid, conn.laddr.ip, conn.laddr.port))
    return found


@contextlib.contextmanager
def watch_listening(pid: int | None = None, interval: float = 0.02):
    """Collect :func:`listening` of ``pid`` (this process) every ``interval`` seconds
    while the block runs; yields the set it fills."""
    pid = os.getpid() if pid is None else pid
    seen: set[tuple[int, str, int]] = set()
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            seen.update(listening(pid))
            stop.wait(interval)

    thread = threading.Thread(target=poll, name="watch_listening", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()
        seen.update(listening(pid))


def exposed(sockets) -> set[tuple[int, str, int]]:
    """The sockets of :func:`listening` that another machine could reach."""
    return {s for s in sockets if not _loopback_address(s[1])}
