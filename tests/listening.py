"""What a process tree listens on: every TCP socket in ``LISTEN`` and every bound UDP
socket of a process and its descendants (psutil, which reads ``/proc/net``), so a test
can require that nothing but loopback is reachable (issue 39 item 13)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listening:
    """One listening socket: the owning process (pid, name), ``tcp``/``udp``, address."""

    pid: int
    name: str
    proto: str
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        """Whether only this host can reach it (127.0.0.0/8, ::1, ::ffff:127.x)."""
        addr = ipaddress.ip_address(self.ip.split("%", 1)[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return addr.is_loopback


def listening(pid: int) -> list[Listening]:
    """The listening TCP and bound UDP sockets of ``pid`` and all its descendants
    (processes that exit while being read are skipped)."""
    root = psutil.Process(pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns, name = proc.net_connections(kind="inet"), proc.name()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for c in conns:
            tcp = c.type == socket.SOCK_STREAM
            if (tcp and c.status == psutil.CONN_LISTEN) or (not tcp and not c.raddr):
                out.append(Listening(proc.pid, name, "tcp" if tcp else "udp",
                                     c.laddr.ip, c.laddr.port))
    return out


def exposed(pid: int) -> list[Listening]:
    """The sockets of :func:`listening` that are reachable from other hosts."""
    return [s for s in listening(pid) if not s.loopback]
