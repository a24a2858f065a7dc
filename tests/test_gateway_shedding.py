"""The gateway's memory of the prompt sizes the Conductor refused (mooncake.gateway.shedding), alone and in a
ClusterBackend talking to a real Conductor."""

from __future__ import annotations

import asyncio
import os

import pytest
from kvnodes import start_conductor

from mooncake import tls
from mooncake.blocks import model_fingerprint
from mooncake.gateway.cluster_backend import ClusterBackend
from mooncake.gateway.shedding import RefusedSizes
from mooncake.serving.types import GenerationRequest, Rejected
from protos import conductor_pb2 as pb
from protos import conductor_pb2_grpc as pb_grpc

DEFAULT = ("default", 0, "", 0.0, 0.0)
BUSY = Rejected("every decode worker is full", code="decode_busy", retry_after_s=2.0)


def test_a_refusal_of_300_tokens_refuses_longer_prompts_of_its_class_for_a_moment_and_not_shorter_ones():
    sizes = RefusedSizes(hold_s=1.0)
    sizes.note_refused(DEFAULT, 300, BUSY, now=10.0)
    refused = sizes.refuses(DEFAULT, 350, now=10.5)
    assert refused is not None and refused.code == "decode_busy" and refused.retry_after_s == 2.0
    assert "refused at the gateway" in refused.message and "300 prompt tokens" in refused.message
    assert sizes.refuses(DEFAULT, 300, now=10.5) is not None
    assert sizes.refuses(DEFAULT, 299, now=10.5) is None
    assert sizes.refuses(("default", 1, "", 0.0, 0.0), 350, now=10.5) is None  # another priority asks for itself
    assert sizes.refuses(("default", 0, "acme", 0.0, 0.0), 350, now=10.5) is None  # so does another tenant
    assert sizes.refuses(("default", 0, "", 60.0, 0.0), 350, now=10.5) is None  # and one with its own targets
    assert sizes.refuses(DEFAULT, 350, now=11.0) is None  # lapsed: the next one asks the Conductor


def test_a_newer_refusal_of_fewer_tokens_lowers_the_bar_and_a_placement_lifts_it():
    sizes = RefusedSizes(hold_s=1.0)
    sizes.note_refused(DEFAULT, 300, BUSY, now=10.0)
    sizes.note_refused(DEFAULT, 200, BUSY, now=10.25)
    assert sizes.refuses(DEFAULT, 250, now=10.5) is not None
    sizes.note_refused(DEFAULT, 400, BUSY, now=11.0)
    assert sizes.refuses(DEFAULT, 250, now=11.125) is not None  # the refusal of 200 at 10.25 stands until 11.25
    assert sizes.refuses(DEFAULT, 250, now=11.5) is None
    assert sizes.refuses(DEFAULT, 450, now=11.5) is not None  # the one of 400, until 12
    sizes.note_placed(DEFAULT, 500)  # the Conductor took 500 tokens: every refusal up to that is old news
    assert sizes.refuses(DEFAULT, 450, now=11.625) is None


def test_refusals_for_the_tenant_or_the_queue_do_not_say_anything_about_the_size():
    sizes = RefusedSizes(hold_s=1.0)
    for code in ("fair_share", "queue_full", "overloaded"):
        sizes.note_refused(DEFAULT, 10, Rejected("no", code=code), now=1.0)
    assert sizes.refuses(DEFAULT, 1000, now=1.5) is None
    for code in ("ttft_slo", "tbt_slo", "overload", "decode_busy"):
        sizes = RefusedSizes(hold_s=1.0)
        sizes.note_refused(DEFAULT, 10, Rejected("no", code=code), now=1.0)
        assert sizes.refuses(DEFAULT, 1000, now=1.5) is not None


BLOCK_TOKENS = 16
FP = model_fingerprint("gateway-shedding-test")


def test_a_cluster_backend_refuses_a_prompt_as_long_as_one_the_conductor_just_refused_without_asking_it_again():
    # one decode worker whose prompts land in 4 blocks: a 100-token prompt (7 blocks) is refused (decode_busy) while a
    # one-token request would fit, so the Conductor's shed verdict stays off and only the size says no
    node = start_conductor("--heartbeat-timeout", "60", "--local-prefill", "never")
    try:
        stub = pb_grpc.ConductorStub(tls.grpc_channel(node.info["grpc"]))
        stub.Register(pb.RegisterRequest(id="kv0", role=pb.KVSTORE, address="127.0.0.1:1", node="kv0"))
        stub.Register(pb.RegisterRequest(id="p0", role=pb.PREFILL, address="127.0.0.1:2", node="kv0"))
        stub.Register(
            pb.RegisterRequest(id="d0", role=pb.DECODE, address="127.0.0.1:3", node="kv0", capacity=64, kv_blocks=4)
        )
        backend = ClusterBackend(node.info["grpc"], "m", 4096, BLOCK_TOKENS, FP)

        def req(tokens: int) -> GenerationRequest:
            return GenerationRequest.of(os.urandom(4).hex(), list(range(tokens)), 4)

        async def go() -> list[str]:
            try:
                with pytest.raises(Rejected) as first:
                    await backend.schedule(req(100))
                assert first.value.code == "decode_busy" and "refused at the gateway" not in first.value.message
                assert backend.shedding() is None  # not every request is refused: no shed verdict
                with pytest.raises(Rejected) as second:  # the next one as long never reaches the Conductor
                    await anext(backend.generate(req(120)))
                assert second.value.code == "decode_busy" and "refused at the gateway" in second.value.message
                placement = await backend.schedule(req(20))  # a shorter one still asks, and is placed
                return [placement.decode_id, second.value.message]
            finally:
                await backend.close()

        decode_id, _ = asyncio.run(go())
        assert decode_id == "d0"
        decided = stub.ListInstances(pb.ListInstancesRequest())
        assert decided.instances  # the Conductor is still up and answering
    finally:
        node.stop()
