"""Schedule over the Conductor's fast path (conductor/fastpath.py), against a real Conductor process.

The same decisions as over gRPC, pipelined answers matched to their calls, the same
status codes, a dead Conductor failing the calls at once, and the gateway's
ClusterBackend finding and using the fast path (and falling back to gRPC without it).
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from kvnodes import start_conductor

from conductor.fastpath import AsyncFastChannel
from mooncake import tls
from mooncake.blocks import block_keys, model_fingerprint
from mooncake.gateway.cluster_backend import ClusterBackend
from mooncake.runtime.framed import ControlError
from mooncake.serving.types import GenerationRequest, InvalidRequest, Rejected
from protos import conductor_pb2 as pb
from protos import conductor_pb2_grpc as pb_grpc

BLOCK_TOKENS = 16
FP = model_fingerprint("fastpath-test")


@pytest.fixture
def conductor():
    node = start_conductor(
        "--heartbeat-timeout", "60", "--local-prefill", "never"
    )  # predictions that do not move with the batch
    channel = tls.grpc_channel(node.info["grpc"])
    stub = pb_grpc.ConductorStub(channel)
    stub.Register(pb.RegisterRequest(id="kv0", role=pb.KVSTORE, address="127.0.0.1:1", node="kv0"))
    stub.Register(pb.RegisterRequest(id="p0", role=pb.PREFILL, address="127.0.0.1:2", node="kv0"))
    stub.Register(pb.RegisterRequest(id="d0", role=pb.DECODE, address="127.0.0.1:3", node="kv0", capacity=64))
    yield node, stub
    channel.close()
    node.stop()


def schedule_request(tokens: int, i: int = 0) -> pb.ScheduleRequest:
    keys = block_keys(list(range(tokens)), BLOCK_TOKENS, FP)
    return pb.ScheduleRequest(
        request_id=f"r{tokens}-{i}", key_chain=b"".join(keys), prompt_tokens=tokens, block_tokens=BLOCK_TOKENS
    )


def test_the_conductor_advertises_its_fast_path(conductor):
    node, stub = conductor
    host, _, port = node.info["control"].rpartition(":")
    assert host == "127.0.0.1" and stub.ListInstances(pb.ListInstancesRequest()).control_port == int(port) > 0


def test_pipelined_calls_on_one_connection_each_get_their_own_answer(conductor):
    node, stub = conductor
    sizes = [16 * (1 + i % 7) * 37 + 5 for i in range(40)]
    want = {t: stub.Schedule(schedule_request(t, -1)).predicted.prefill_s for t in set(sizes)}  # the same over gRPC
    assert len(set(want.values())) == len(want)  # every size predicts a different prefill time

    async def go():
        channel = AsyncFastChannel(node.info["control"])
        try:
            return await asyncio.gather(
                *(channel.call("Schedule", schedule_request(t, i), 10) for i, t in enumerate(sizes))
            )
        finally:
            await channel.close()

    answers = asyncio.run(go())
    assert [a.predicted.prefill_s for a in answers] == [want[t] for t in sizes]
    assert all(a.HasField("placement") and a.placement.prefill_id == "p0" for a in answers)


def test_errors_carry_the_grpc_status_codes_and_a_dead_conductor_fails_calls_at_once(conductor):
    node, _ = conductor

    async def go():
        channel = AsyncFastChannel(node.info["control"])
        bad = pb.ScheduleRequest(request_id="bad", key_chain=b"short", prompt_tokens=5, block_tokens=BLOCK_TOKENS)
        with pytest.raises(ControlError) as e:
            await channel.call("Schedule", bad, 10)
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "16-byte" in e.value.details
        beat = await channel.call("Heartbeat", pb.HeartbeatRequest(id="nobody", load=pb.Load()), 10)
        assert not beat.known
        node.proc.kill()
        node.proc.wait(10)
        with pytest.raises(ConnectionError):
            await channel.call("Schedule", schedule_request(100), 10)
        await channel.close()

    asyncio.run(go())


@pytest.mark.parametrize("fast", [True, False])
def test_the_gateway_schedules_over_the_fast_path_when_the_conductor_has_one(fast):
    node = start_conductor("--heartbeat-timeout", "60", *([] if fast else ["--control-port", "-1"]))
    try:
        stub = pb_grpc.ConductorStub(tls.grpc_channel(node.info["grpc"]))
        stub.Register(pb.RegisterRequest(id="p0", role=pb.PREFILL, address="127.0.0.1:2", node="kv0"))
        stub.Register(pb.RegisterRequest(id="d0", role=pb.DECODE, address="127.0.0.1:3", node="kv0", capacity=64))
        backend = ClusterBackend(node.info["grpc"], "m", 4096, BLOCK_TOKENS, FP)

        async def go():
            try:
                req = GenerationRequest.of(os.urandom(4).hex(), list(range(100)), 4)
                placement = await backend.schedule(req)
                using = backend._fast is not None
                with pytest.raises(InvalidRequest):  # an empty prompt: INVALID_ARGUMENT on either path
                    await backend.schedule(GenerationRequest.of("x", [], 4))
                return placement, using
            finally:
                await backend.close()

        placement, using = asyncio.run(go())
        assert (placement.prefill_id, placement.decode_id) == ("p0", "d0")
        assert using is fast
    finally:
        node.stop()


def test_a_gateway_sheds_while_the_conductor_refuses_everything_and_stops_when_it_drains():
    # prompts on prefill workers only: under auto the idle decode worker would take them (test_conductor_local)
    node = start_conductor("--heartbeat-timeout", "60", "--ttft-slo", "2", "--local-prefill", "never")
    try:
        stub = pb_grpc.ConductorStub(tls.grpc_channel(node.info["grpc"]))
        stub.Register(pb.RegisterRequest(id="p0", role=pb.PREFILL, address="127.0.0.1:2", node="kv0"))
        stub.Register(pb.RegisterRequest(id="d0", role=pb.DECODE, address="127.0.0.1:3", node="kv0", capacity=64))
        stub.Heartbeat(pb.HeartbeatRequest(id="p0", load=pb.Load(queued_s=100.0)))  # nothing starts within the SLO
        backend = ClusterBackend(node.info["grpc"], "m", 4096, BLOCK_TOKENS, FP)

        def req() -> GenerationRequest:
            return GenerationRequest.of(os.urandom(4).hex(), list(range(40)), 4)

        async def go():
            try:
                assert backend.shedding() is None
                with pytest.raises(Rejected) as first:
                    await backend.schedule(req())
                assert first.value.code == "ttft_slo"
                shed = backend.shedding()  # the next request is refused here, without asking
                assert shed is not None and shed.code == "ttft_slo" and "refused at the gateway" in shed.message
                await asyncio.sleep(1.0)  # the probe keeps the verdict alive while the queue stays long
                assert backend.shedding() is not None
                stub.Heartbeat(pb.HeartbeatRequest(id="p0", load=pb.Load(queued_s=0.0)))
                for _ in range(40):  # the next probe (within SHED_S) hears otherwise
                    if backend.shedding() is None:
                        break
                    await asyncio.sleep(0.05)
                assert backend.shedding() is None
                placement = await backend.schedule(req())
                assert placement.prefill_id == "p0"
            finally:
                await backend.close()

        asyncio.run(go())
        decided = stub.ListInstances(pb.ListInstancesRequest())
        assert decided.scheduled == 1 and decided.rejected["ttft_slo"] == 1  # the probes decided nothing
    finally:
        node.stop()
