"""Network hosts on one machine: a network namespace per host, each linked by a veth pair into one bridge.

    root namespace:  bridge <name> 10.N.0.1 ------+------------+----------  (the Conductor, the gateway)
                                                  |            |
    host "p0":       namespace <name>-p0   eth0 10.N.0.2   (kv0 + prefill-0: one pool node's host)
    host "d0":       namespace <name>-d0   eth0 10.N.0.3   (decode-0)

Every process of a host runs in its namespace under its own hostname (``unshare --uts``),
so the transfer engine sees different hosts (tcp between them, shared memory within one)
and calls between hosts cross a real, if virtual, network. ``cut(host)`` takes the host's
link down: its peers get no reset, only silence, as when a machine drops off a real network;
``heal(host)`` brings it back. Needs root (``ip netns``); ``available()`` says whether it works.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class VirtualNetwork:
    """Hosts on a bridge; ``wrap`` an argv to run it on a host. ``close`` removes everything it made."""

    def __init__(self, name: str | None = None) -> None:
        self.octet = random.randrange(80, 250)  # 10.<octet>.0.0/24: unlikely to meet another run's
        self.name = name or f"mc{self.octet}"
        self.gateway_ip = f"10.{self.octet}.0.1"  # the bridge, in the root namespace
        self.hosts: dict[str, str] = {}  # host -> its address
        _ip("link", "add", self.name, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.gateway_ip}/24", "dev", self.name)
            _ip("link", "set", self.name, "up")
        except Exception:
            self.close()
            raise

    @staticmethod
    def available() -> bool:
        """Whether this process may make namespaces and bridges (root, with ``ip`` and ``unshare``)."""
        return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare") is not None

    def _veth(self, host: str) -> str:
        return f"{self.name}-{host}"[:15]  # an interface name has at most 15 characters

    def add_host(self, host: str) -> str:
        """Make host ``host`` (a short name such as "p0"); return its address."""
        if host in self.hosts:
            return self.hosts[host]
        ns, veth = f"{self.name}-{host}", self._veth(host)
        address = f"10.{self.octet}.0.{len(self.hosts) + 2}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.name, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.hosts[host] = address
        return address

    def wrap(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host`` (its namespace, hostname ``host``); the process keeps the PID the caller sees."""
        ns = f"{self.name}-{host}"
        return [
            "ip",
            "netns",
            "exec",
            ns,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            f'hostname {host} && exec "$@"',
            "sh",
            *argv,
        ]

    def shape(self, host: str, mbit: float) -> None:
        """Limit ``host``'s link to ``mbit`` megabits a second each way (a token bucket on both ends of its veth):
        what a real network's bandwidth is, where the bridge would otherwise move bytes at memory speed."""
        for prefix, dev in (((), self._veth(host)), (("-n", f"{self.name}-{host}"), "eth0")):
            tc = ["tc", *prefix, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit"]
            subprocess.run([*tc, "burst", "256kb", "latency", "200ms"], check=True, capture_output=True, timeout=10)

    def cut(self, host: str) -> None:
        """Take ``host`` off the network: packets to and from it are dropped from now on, without a reset."""
        _ip("link", "set", self._veth(host), "down")

    def heal(self, host: str) -> None:
        _ip("link", "set", self._veth(host), "up")

    def close(self) -> None:
        for host in list(self.hosts):
            subprocess.run(["ip", "netns", "del", f"{self.name}-{host}"], capture_output=True, timeout=10)
        self.hosts.clear()
        subprocess.run(["ip", "link", "del", self.name], capture_output=True, timeout=10)
