"""A transient transfer fault in a prefill's push to its decode worker costs one resend, never the request or the pair.

One prompt is pushed three times by a prefill engine's PoolConnector into landing slots of another node's segment,
over each transfer backend: undisturbed, then with one fault, then undisturbed again. The fault is the backend's own:

    tcp    the connection carrying the push is shut down as it sends (a reset: every request on it fails)
    shm    one copy into the mapped segment fails (the OSError a mapping gone bad raises)
    rdma   one work request fails on tests/fakeverbs.py's fabric (IBV_WC_RETRY_EXC_ERR: its queue pair errs out)

The faulted push is sent again (prefill/connector.py ``PUSH_ATTEMPTS``): the job ends without an error and lands the
same bytes as the undisturbed push; the next push goes through with no resend (the backend reconnected). A prefix
pulled from another pool node layer by layer is pulled again the same way (prefill/leases.py ``Held.wait_layer``).
"""

from __future__ import annotations

import socket
import uuid

import pytest
import torch
from conftest import make_engine

from mooncake.blocks import blocks_for
from mooncake.engine.request import SamplingParams
from prefill.connector import PoolConnector, PrefillJob
from prefill.server import PushRetries
from transfer import MemoryRegistry, TransferConfig, TransferEngine

BS = 8  # make_engine's block size
PROMPT = [(7 * i + 3) % 280 + 10 for i in range(37)]  # 5 blocks, the last partial; 3 engine steps of 16 tokens
BLOCKS = blocks_for(len(PROMPT), BS)


class OneFault:
    """Arms one fault of the backend's kind; ``hits`` counts the faults that happened."""

    def __init__(self, backend: str, monkeypatch, request) -> None:
        self.armed, self.hits = False, 0
        if backend == "rdma":
            self.fabric = request.getfixturevalue("fabric")
            return
        self.fabric = None
        if backend == "tcp":
            import transfer.tcp

            real = transfer.tcp.send_all

            def send_all(sock, buffers, deadline):
                if self.armed and deadline is not None:  # a client's request (answers go without a deadline)
                    self.armed, self.hits = False, self.hits + 1
                    sock.shutdown(socket.SHUT_RDWR)
                return real(sock, buffers, deadline)

            monkeypatch.setattr(transfer.tcp, "send_all", send_all)
        else:
            import transfer.backend

            real = transfer.backend.copy_bytes

            def copy_bytes(dst, src):
                if self.armed:
                    self.armed, self.hits = False, self.hits + 1
                    raise OSError(14, "Bad address")
                return real(dst, src)

            monkeypatch.setattr(transfer.backend, "copy_bytes", copy_bytes)

    def arm(self) -> None:
        if self.fabric is not None:
            self.fabric.fail_next = True
        self.armed = True

    def happened(self) -> int:
        if self.fabric is not None:
            return 0 if self.fabric.fail_next else 1
        return self.hits


def two_nodes(backend: str, shm_dir: str) -> tuple[TransferEngine, TransferEngine]:
    """(the node whose segment is written or read, as it configures itself; the node moving the bytes, forced to
    ``backend``), sharing a registry."""
    registry = MemoryRegistry()
    owner = TransferEngine(TransferConfig(node=f"owner-{uuid.uuid4().hex[:6]}", shm_dir=shm_dir), registry)
    mover = TransferEngine(
        TransferConfig(node=f"mover-{uuid.uuid4().hex[:6]}", backend=backend, shm_dir=shm_dir), registry
    )
    return owner, mover


@pytest.mark.parametrize("backend", ["tcp", "shm", "rdma"])
def test_a_push_that_fails_once_is_sent_again_and_the_pair_pushes_on(
    backend, tiny_llama, shm_dir, monkeypatch, request
):
    fault = OneFault(backend, monkeypatch, request)
    decode_node, prefill_node = two_nodes(backend, shm_dir)
    try:
        connector = PoolConnector(prefill_node, None, BS, io_timeout_s=10)
        prefill = make_engine(tiny_llama.path, connector=connector, max_num_batched_tokens=16)
        connector.bind(prefill.runner.kv_cache)
        slot_bytes = prefill.block_bytes
        landing = decode_node.allocate("landing", 3 * BLOCKS * slot_bytes)
        slots = torch.frombuffer(decode_node.buffer(landing.name), dtype=torch.uint8).view(3, BLOCKS, slot_bytes)

        def push(i: int) -> PrefillJob:
            rid = f"push-{i}"
            offsets = [(i * BLOCKS + b) * slot_bytes for b in range(BLOCKS)]
            connector.jobs[rid] = job = PrefillJob(rid, len(PROMPT), BLOCKS, landing.name, offsets)
            prefill.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid)
            while prefill.has_unfinished():
                prefill.step()
            return job

        job = push(0)
        assert job.error is None and job.pushed == BLOCKS and slots[0].any()
        assert connector.push_retries == 0

        fault.arm()
        job = push(1)
        assert fault.happened() == 1
        assert job.error is None and job.pushed == BLOCKS  # the request goes on
        assert connector.push_retries >= 1  # every push the fault broke was sent again (one or more)
        assert torch.equal(slots[1], slots[0])  # and landed the same bytes
        [family] = PushRetries(connector).collect()  # what the worker's /metrics shows
        assert family.name == "mooncake_prefill_push_retries" and family.samples[0].value == connector.push_retries

        retries = connector.push_retries
        job = push(2)
        assert job.error is None and torch.equal(slots[2], slots[0])
        assert connector.push_retries == retries  # the pair is whole again: nothing sent twice
        moved = prefill_node.moved()
        assert {kind for kind, op in moved if op == "write"} == {backend}  # the backend under test carried it all
    finally:
        prefill_node.close()
        decode_node.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", "rdma"])
def test_a_prefix_pull_that_fails_once_is_pulled_again_before_its_layer_runs(backend, shm_dir, monkeypatch, request):
    """A prefill pulling a prefix from another pool node waits for each layer just before the engine runs it
    (``Held.wait_layer``): a layer whose pull a fault broke is pulled again, and the engine reads the right bytes."""
    import os

    from prefill.leases import Held
    from transfer import Slice

    fault = OneFault(backend, monkeypatch, request)
    owner, reader = two_nodes(backend, shm_dir)
    try:
        layers, layer_bytes = 4, 256 << 10
        pool = owner.allocate("pool", layers * layer_bytes)
        owner.buffer(pool.name)[:] = os.urandom(layers * layer_bytes)
        local = bytearray(layers * layer_bytes)
        slices = [[Slice(i * layer_bytes, pool.name, i * layer_bytes, layer_bytes)] for i in range(layers)]
        fault.arm()
        held = Held(
            io_timeout_s=10,
            fetch_slices=slices,
            fetch_batches=[reader.read(local, s) for s in slices],
            fetch_read=lambda s: reader.read(local, s),
        )
        for layer in range(layers):
            held.wait_layer(layer)
        assert fault.happened() == 1
        assert bytes(local) == bytes(owner.buffer(pool.name))
        assert held.fetch_seconds > 0  # the last layer landed
    finally:
        reader.close()
        owner.close()
