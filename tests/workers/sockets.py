"""The TCP addresses this process listens on, read from /proc (Linux): issue 12 wants none on a non-loopback
interface in a single-host job."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))
    words = struct.unpack("<4I", raw)  # /proc prints IPv6 as four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def listening() -> list[tuple[str, int]]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                hex_addr, hex_port = cols[1].split(":")
                found.append((_address(hex_addr), int(hex_port, 16)))
    return sorted(found)


def is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback
