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


def test_listener_serves_only_its_address_and_holds_the_port() -> None:
    with net.listener("127.0.0.1") as sock:
        host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1"
        with socket.socket() as other, pytest.raises(OSError, match="in use"):  # held: nobody takes it in between
            other.bind(("127.0.0.1", port))
        external = net.host_address()
        if external != "127.0.0.1":  # the same port on the external address reaches nobody
            with socket.socket() as client:
                client.settimeout(2)
                assert client.connect_ex((external, port)) != 0
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass


def test_listener_on_a_foreign_address() -> None:
    foreign = "192.0.2.77"  # TEST-NET-1: never an address of this host
    with pytest.raises(OSError, match="assign"):  # EADDRNOTAVAIL: "Cannot assign requested address"
        net.listener(foreign)
    with net.listener(foreign, fallback_any=True) as sock:
        assert sock.getsockname()[0] in ("0.0.0.0", "::")


def test_torch_store_port_in_use_is_a_typed_error() -> None:
    pytest.importorskip("torch.distributed")
    from unidist.engines.torch.manager import store_listener
    from unidist.errors import LaunchEnvironmentError

    with net.listener("127.0.0.1") as taken:
        port = taken.getsockname()[1]
        with pytest.raises(LaunchEnvironmentError, match=f"MASTER_PORT={port}"):
            store_listener("127.0.0.1", port)


def test_local_only_env_names_the_loopback_interface() -> None:
    env = net.local_only_env()
    if net.loopback_interface() is None:
        assert env == {}
    else:
        assert set(env) == {"GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES", "FI_TCP_IFACE"}
        assert set(env.values()) == {net.loopback_interface()}
