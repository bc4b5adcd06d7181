"""Which transport NCCL chose between nodes, read from NCCL_DEBUG=INFO lines.

The first thing an operator checks when bandwidth is low: channels between
nodes should run ``via NET/IB/<n>/GDRDMA`` (InfiniBand with GPUDirect RDMA);
``via NET/IB/<n>`` lacks GPUDirect RDMA, and ``via NET/Socket/<n>`` means
NCCL fell back to TCP sockets.  ``NET/IB : Using [0]mlx5_0:1/IB …`` names the
HCAs each host offered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PREFIX = re.compile(r"^\s*\d+:\s?")
HEAD = re.compile(r"^(?P<host>[^\s:]+):(?P<pid>\d+):\d+\s+\[(?P<dev>\d+)\]\s+NCCL INFO\s+"
                  r"(?P<msg>.*)$")
CHANNEL = re.compile(r"Channel\s+\d+(?:/\d+)?\s*:\s*(?P<src>\d+)\[\d+\]\s*->\s*(?P<dst>\d+)\[\d+\]"
                     r"\s*(?:\[(?P<dir>send|receive)\])?\s*via\s+(?P<via>\S+)")
USING = re.compile(r"NET/(?P<net>IB|IBext|Socket)\s*:\s*Using\s+(?P<list>.*?)(?:\s*;\s*OOB.*)?$")
DEVICE = re.compile(r"\[(\d+)\]([^\s:\[\]]+)")


@dataclass
class RankTransport:
    rank: int
    host: str
    transports: set[str] = field(default_factory=set)  # ib-gdrdma | ib | socket
    hcas: set[str] = field(default_factory=set)

    @property
    def verdict(self) -> str:
        if "socket" in self.transports:
            return "socket"
        if "ib" in self.transports:
            return "ib"
        if "ib-gdrdma" in self.transports:
            return "ib-gdrdma"
        return "none"


@dataclass(frozen=True)
class TransportReport:
    status: str  # ok | warn | none
    reason: str
    ranks: list[RankTransport]


def analyze(text: str) -> TransportReport:
    host_devices: dict[tuple[str, str], list[str]] = {}
    ranks: dict[int, RankTransport] = {}
    for raw in text.splitlines():
        line = PREFIX.sub("", raw, count=1)
        head = HEAD.match(line)
        if not head:
            continue
        message = head.group("msg")
        if using := USING.search(message):
            names = [name for _, name in DEVICE.findall(using.group("list"))]
            host_devices[(head.group("host"), using.group("net"))] = names
            continue
        channel = CHANNEL.search(message)
        if not channel or not channel.group("via").startswith("NET/"):
            continue  # P2P, SHM, NVLS: inside a node
        rank = int(channel.group("dst") if channel.group("dir") == "receive"
                   else channel.group("src"))
        entry = ranks.setdefault(rank, RankTransport(rank, head.group("host")))
        parts = channel.group("via").split("/")  # NET, IB|Socket, index, [GDRDMA]
        kind = parts[1] if len(parts) > 1 else ""
        index = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
        if kind.startswith("IB"):
            entry.transports.add("ib-gdrdma" if "GDRDMA" in parts[3:] else "ib")
            devices = host_devices.get((entry.host, kind)) or host_devices.get(
                (entry.host, "IB"), [])
            if index is not None and index < len(devices):
                entry.hcas.add(devices[index])
        else:
            entry.transports.add("socket")
    found = sorted(ranks.values(), key=lambda r: r.rank)
    if not found:
        return TransportReport("none", "no inter-node channels in the log (one node, or "
                               "NCCL_DEBUG=INFO was not set)", [])
    sockets = [r.rank for r in found if r.verdict == "socket"]
    plain_ib = [r.rank for r in found if r.verdict == "ib"]
    if sockets:
        return TransportReport("warn", f"inter-node traffic fell back to sockets on rank(s) "
                               f"{_ranks(sockets)}: check the HCAs and NCCL_IB_HCA", found)
    if plain_ib:
        return TransportReport("warn", f"InfiniBand without GPUDirect RDMA on rank(s) "
                               f"{_ranks(plain_ib)}: check nvidia-peermem and the "
                               "GPU-HCA topology", found)
    return TransportReport("ok", "every inter-node channel uses InfiniBand with GPUDirect "
                           "RDMA", found)


def _ranks(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:8]))
    return shown + (f" and {len(numbers) - 8} more" if len(numbers) > 8 else "")
