"""A pool node's blocks moved before the node goes: ``mooncake pool drain kv1``, scaling its prefill workers down, or
the node itself as it stops on SIGTERM (``--hand-off-s``, on by default: the helm chart's pod deleted or evicted;
Deregister with ``hand_off``, the node serving its blocks until the call returns).

The Conductor knows from its index every chain the leaving node holds whole (``conductor.index.chains_of``). It asks
the pool nodes that stay to copy them (each node pulls a chain from the leaving one: kvstore's ``Pull``, the bytes
moving node to node over the transfer engine, never through the Conductor), the chains with most blocks in DRAM first,
each to the node with the most free DRAM, and no more than their free DRAM holds: a hand-off does not evict what the
nodes that stay serve. The copies reach the index through those nodes' event streams, so the next request for one of
those prefixes reads it there. Then the leaving node is taken out of the index; once the reads in flight on it have
ended (its leases at 0) the provider stops it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvstore.client import KVStoreClient, KVStoreUnavailable, StoreFull

log = logging.getLogger(__name__)

PULL_TIMEOUT_S = 30.0  # one chain's copy
LEASES_WAIT_S = 30.0  # how long the reads in flight on a leaving node are waited for (the pool's lease lifetime)


@dataclass
class Moved:
    """What a hand-off moved: chains and blocks copied, blocks the other node had already, and chains left behind
    (no room on the nodes that stay, or a copy that failed)."""

    chains: int = 0
    blocks: int = 0
    already: int = 0
    left: int = 0
    seconds: float = 0.0


def rehome(
    chains: list[list[bytes]],
    source: str,
    targets: dict[str, str],
    deadline: float = float("inf"),
    timeout_s: float = PULL_TIMEOUT_S,
) -> Moved:
    """Copy ``chains`` from the node at ``source`` (a gRPC address) to ``targets`` (node -> gRPC address), until
    ``deadline`` (monotonic): the chains not begun by then are left."""
    started = time.monotonic()
    moved = Moved()
    clients = {node: KVStoreClient(address, control="grpc", timeout_s=timeout_s) for node, address in targets.items()}
    try:
        room = {}
        for node, client in clients.items():
            try:
                dram = client.stats().dram
                room[node] = dram.capacity_blocks - dram.used_blocks - dram.reserved_blocks
            except KVStoreUnavailable as e:
                log.warning("pool node %s does not answer (%s): not moving blocks there", node, e)
        for chain in chains:
            node = max(room, key=room.get, default=None)
            left_s = deadline - time.monotonic()
            if node is None or room[node] < len(chain) or left_s <= 0:
                moved.left += 1
                continue
            try:
                got = clients[node].pull(source, chain, min(timeout_s, left_s))
            except StoreFull:
                room[node] = 0
                moved.left += 1
                continue
            except KVStoreUnavailable as e:  # the target (or, as it says, the source) did not answer
                log.warning("copying a chain of %d blocks to %s failed: %s", len(chain), node, e)
                room.pop(node)
                moved.left += 1
                continue
            room[node] -= got.pulled
            moved.chains += 1
            moved.blocks += got.pulled
            moved.already += got.already
    finally:
        for client in clients.values():
            client.close()
    moved.seconds = time.monotonic() - started
    return moved


def wait_leases_ended(address: str, quiet_s: float, deadline: float = float("inf")) -> bool:
    """Wait ``quiet_s`` (a plan made just before the node left the index may not have reached its worker yet), then
    until the node at ``address`` holds no lease or reservation; False if that took more than ``LEASES_WAIT_S`` or
    passed ``deadline`` (monotonic). A node that does not answer has nothing to wait for."""
    deadline = min(deadline, time.monotonic() + quiet_s + LEASES_WAIT_S)
    time.sleep(max(0.0, min(quiet_s, deadline - time.monotonic())))
    with KVStoreClient(address, control="grpc", timeout_s=5) as client:
        while True:
            try:
                s = client.stats()
            except KVStoreUnavailable:
                return True
            if not s.leases and not s.reservations:
                return True
            if time.monotonic() > deadline:
                log.warning(
                    "%s still holds %d leases and %d reservations: stopping it anyway", s.node, s.leases, s.reservations
                )
                return False
            time.sleep(0.2)
