"""The address and port helper: never an address a peer on another node cannot reach."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from unidist import net


def test_free_port_is_bindable() -> None:
    port = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_single_node_uses_loopback() -> None:
    assert net.rendezvous_address(single_node=True) == "127.0.0.1"


def test_host_address_is_ipv4() -> None:
    ipaddress.IPv4Address(net.host_address())
    ipaddress.IPv4Address(net.rendezvous_address(single_node=False))


class _NoRoute(socket.socket):
    def connect(self, address: Any) -> None:
        raise OSError("Network is unreachable")


def test_debian_hosts_entry_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """/etc/hosts mapping the host name to 127.0.1.1 (Debian's default) must not be the answer: a mock of
    the resolver and of a machine without a route, as neither can be arranged for real here."""
    monkeypatch.setattr(net.socket, "socket", _NoRoute)
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in ("127.0.1.1", "169.254.0.5", "10.1.2.3")]
    monkeypatch.setattr(net.socket, "getaddrinfo", lambda *a, **k: answers)
    assert net.host_address() == "10.1.2.3"
    monkeypatch.setattr(net.socket, "getaddrinfo", lambda *a, **k: answers[:1])
    assert net.host_address() == "127.0.0.1"  # nothing routable: loopback, which works on one node
