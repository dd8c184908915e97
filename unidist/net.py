"""This host's reachable address and free TCP ports: the one place rendezvous code asks for either.

``gethostbyname(gethostname())`` is not an answer on clusters: Debian-style ``/etc/hosts`` maps the host
name to 127.0.1.1, which a peer on another node cannot reach. The address used here is the one the kernel
would route outgoing traffic from (a UDP "connect" sends nothing), then any non-loopback address of the host
name, then loopback; single-node jobs use loopback, which needs no interface at all.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["free_port", "host_address", "rendezvous_address"]

# Any routable address works for the UDP connect: nothing is sent, the kernel only picks a source interface.
_ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737), never a real peer


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (released before return: whoever binds it next should do so soon);
    ``host=""`` asks for one free on every interface, for servers that listen on all of them."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
