"""This host's reachable address, listening sockets and free TCP ports: the one place rendezvous code asks.

``gethostbyname(gethostname())`` is not an answer on clusters: Debian-style ``/etc/hosts`` maps the host
name to 127.0.1.1, which a peer on another node cannot reach. The address used here is the one the kernel
would route outgoing traffic from (a UDP "connect" sends nothing), then any non-loopback address of the host
name, then loopback; single-node jobs use loopback, which needs no interface at all.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import struct
import sys
from dataclasses import dataclass

__all__ = ["IFACE_VARS", "Interface", "free_port", "host_address", "interfaces", "listener", "local_only_env",
           "loopback_interface", "rendezvous_address"]

log = logging.getLogger("unidist")

# Any routable address works for the UDP connect: nothing is sent, the kernel only picks a source interface.
_ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737), never a real peer


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (released before return: whoever binds it next should do so soon);
    ``host=""`` asks for one free on every interface, for servers that listen on all of them."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listener(host: str, port: int = 0, *, fallback_any: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` and already listening.

    A store built on its descriptor (``TCPStore(master_listen_fd=...)``) serves on exactly this address, and the
    port stays held from the choice to the serving: no other process can take it in between, which a port from
    ``free_port`` cannot promise. (torch's own stores listen on every interface whatever address they are given.)

    Args:
        host: an address or name of this host; ``127.0.0.1`` keeps a single-node job off the network.
        port: 0 for any free port.
        fallback_any: when ``host`` is not an address of this host (a name the launcher resolved elsewhere, a
            NAT address), listen on every interface instead, with a warning, rather than fail.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT by a previous run
    try:
        try:
            sock.bind(sockaddr)
        except OSError as err:
            if err.errno != errno.EADDRNOTAVAIL or not fallback_any:
                raise
            log.warning("unidist: %s is not an address of this host; the rendezvous store listens on every "
                        "interface (set MASTER_ADDR to this host's address to restrict it)", host)
            sock.bind(("::" if family == socket.AF_INET6 else "", port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), None if neither."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


IFACE_VARS = {
    "GLOO_SOCKET_IFNAME": "gloo (torch, DeepSpeed and Horovod on CPU)",
    "UCX_NET_DEVICES": "MPICH's UCX transport",
    "FI_TCP_IFACE": "libfabric's TCP provider (MPICH's ofi device)",
    "NCCL_SOCKET_IFNAME": "NCCL's bootstrap and socket transport",
}
"""The engines' variables naming the network interface they use, and whose: a several-host job needs each one
unset (the engine picks) or naming an interface the hosts reach each other on, never loopback."""

_LOCAL_ONLY = ("GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES", "FI_TCP_IFACE")  # the CPU engines' (NCCL: GPUs only)


def local_only_env() -> dict[str, str]:
    """The engines' interface variables that keep a single-node job's listeners on loopback (measured: without
    them gloo's pairs, MPICH's UCX transport and libfabric's TCP provider listen on the external address). The
    managers set each only where the user set none, before the engine starts."""
    lo = loopback_interface()
    return dict.fromkeys(_LOCAL_ONLY, lo) if lo else {}


@dataclass(frozen=True)
class Interface:
    """One network interface of this host: its IPv4 address (None: it has none), whether it is up and loopback,
    and ``route``: whether it carries the address :func:`host_address` picks, the one a several-host job's
    rank 0 offers its peers."""

    name: str
    address: str | None
    up: bool
    loopback: bool
    route: bool


_SIOCGIFFLAGS, _SIOCGIFADDR, _IFF_UP, _IFF_LOOPBACK = 0x8913, 0x8915, 0x1, 0x8


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes | None:
    import fcntl  # POSIX only; Linux's request numbers

    try:
        return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:  # no IPv4 address on this interface
        return None


def interfaces() -> list[Interface]:
    """This host's network interfaces (Linux: addresses and flags from the kernel; elsewhere names only), what
    a several-host job could use and which one it would."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    routed = host_address()
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            addr = flags = None
            if sys.platform.startswith("linux"):
                raw = _ioctl(sock, _SIOCGIFADDR, name)
                addr = socket.inet_ntoa(raw[20:24]) if raw else None
                raw = _ioctl(sock, _SIOCGIFFLAGS, name)
                flags = struct.unpack("H", raw[16:18])[0] if raw else None
            loop = bool(flags & _IFF_LOOPBACK) if flags is not None else name in ("lo", "lo0")
            found.append(Interface(name, addr, bool(flags & _IFF_UP) if flags is not None else True, loop,
                                   addr is not None and addr == routed))
    return found


def _usable(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return ip.version == 4 and not (ip.is_loopback or ip.is_unspecified or ip.is_link_local)


def host_address(toward: str | None = None) -> str:
    """An IPv4 address of this host that peers on other nodes can reach.

    Args:
        toward: a peer's address, if known; the address of the interface that routes to it is returned.
    """
    for target in ((toward, 9), _ROUTE_PROBE) if toward else (_ROUTE_PROBE,):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(target)
                addr = str(s.getsockname()[0])
            if _usable(addr):
                return addr
        except OSError:  # no route (an isolated container): try the next way
            pass
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for *_, sockaddr in infos:
        if _usable(str(sockaddr[0])):
            return str(sockaddr[0])
    return "127.0.0.1"


def rendezvous_address(single_node: bool) -> str:
    """Where rank 0 should listen for its peers: loopback when every rank is on this node, else a routable
    address of this host.

    Args:
        single_node: whether the launcher put every rank on this node (``local_size == size``).
    """
    return "127.0.0.1" if single_node else host_address()
