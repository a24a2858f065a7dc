"""A prefill worker stalled mid-write past the write grace changes no other request's tokens.

A real prefill worker process (of a LocalCluster) writes prompts straight into the cache of a decode worker on its host
(mapped shared memory). A fault makes it stall inside its copy of one prompt's layer (``STALL_ENV``: the copy lands
after the stall, as a worker stalled mid-step or one whose cancellation never reaches it would) while another prompt
shares its step (both queued behind a first prompt stalled a moment, so one step takes them together). That prompt's
client leaves during the stall: the decode worker gives up on the prefill and asks it to stop, which it cannot say
while stalled. Meanwhile requests computed on the decode worker itself run one after another,
for longer than twice the grace. Each must give one engine alone's tokens: the stalled prefill's late writes must land
in blocks nobody else holds (decode/fence.py holds them until the prefill worker says its writes are over). Once the
stall ends, the held blocks come back.

Before the fence (blocks went back ``write_grace_s`` after an unanswered abort, and key-less freed blocks are handed
out first), the late copy landed in the blocks of whichever of these requests was decoding then.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent import futures

import grpc
import torch
from clusters import reference_tokens, start_cluster

from decode.config import DecodeConfig
from decode.server import DecodeMetrics, DecodeServicer
from decode.worker import DecodeWorker
from mooncake import tls
from prefill.landing import STALL_ENV
from protos import conductor_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

STALL_S = 6.0
GRACE_S = 0.3


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(rid: str, prompt: list[int], max_tokens: int, placement: cpb.Placement) -> wpb.GenerateRequest:
    sampling = wpb.Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return wpb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, placement=placement)


def streamed_tokens(stub, req: wpb.GenerateRequest) -> list[int]:
    return [t for chunk in stub.Generate(req, timeout=120) for t in chunk.token_ids]


def test_a_prefill_stalled_inside_a_shared_step_past_the_grace_changes_no_other_requests_tokens(
    tiny_dir, tmp_path, shm_dir, monkeypatch
):
    monkeypatch.setenv(STALL_ENV, f"first:1.5,stalled:{STALL_S}")  # the cluster's prefill worker inherits it
    cluster = start_cluster(tiny_dir, tmp_path)
    worker = DecodeWorker(
        DecodeConfig(
            id=f"decode-{uuid.uuid4().hex[:6]}",
            model=str(tiny_dir),
            block_size=16,
            num_kv_blocks=40,
            max_model_len=256,
            enable_prefix_caching=False,  # a decode worker's (DECODE_ENGINE_DEFAULTS): freed blocks are reused first
            write_behind=False,
            write_grace_s=GRACE_S,
            shm_dir=shm_dir,
        )
    )
    server = grpc.server(futures.ThreadPoolExecutor(16))
    wpb_grpc.add_DecodeServicer_to_server(DecodeServicer(worker, DecodeMetrics(worker)), server)
    port = tls.grpc_add_port(server, "127.0.0.1:0")  # mutual TLS, as every component of the tests' clusters
    server.start()
    stub = wpb_grpc.DecodeStub(tls.grpc_channel(f"127.0.0.1:{port}"))
    try:
        prefill = cpb.Placement(prefill_id="prefill-0", prefill_address=cluster.address("prefill-0"))
        local = cpb.Placement(local_prefill=True)
        stalled, shared = random_prompt(80, seed=1), random_prompt(160, seed=2)
        log = cluster.run_dir / "logs" / "prefill-0.log"

        def stalled_on(rid: str) -> None:
            deadline = time.monotonic() + 60
            while f"the copy of {rid}#" not in (log.read_text() if log.exists() else ""):
                assert time.monotonic() < deadline, f"the prefill worker never stalled on {rid}"
                time.sleep(0.02)

        first = threading.Thread(
            target=lambda: streamed_tokens(stub, request("first", random_prompt(20, seed=3), 4, prefill)), daemon=True
        )
        first.start()
        stalled_on("first")  # the prefill worker's engine is busy: the next two wait, and share its next step
        # B shares the stalled prompt's step and must come out whole
        b_tokens: list[int] = []
        b = threading.Thread(
            target=lambda: b_tokens.extend(streamed_tokens(stub, request("shared", shared, 24, prefill))), daemon=True
        )
        a = stub.Generate(request("stalled", stalled, 24, prefill), timeout=120)
        b.start()
        stalled_on("stalled")
        a.cancel()  # its client leaves while its prefill is stalled mid-write
        gave_up = time.monotonic()
        served, n = [], 0
        while time.monotonic() - gave_up < 2 * GRACE_S + STALL_S:  # requests that need blocks, while the stall lasts
            prompt = random_prompt(40, seed=100 + n)
            served.append((prompt, streamed_tokens(stub, request(f"local-{n}", prompt, 48, local))))
            n += 1
        b.join(timeout=120)
        first.join(timeout=120)
        assert "stopped mid-way" not in log.read_text()  # the stalled prompt's step went on, for the other one
        assert len(served) >= 3
        for prompt, got in served:
            assert got == reference_tokens(tiny_dir, prompt, 48), "a stalled prefill's late write changed a request"
        assert b_tokens == reference_tokens(tiny_dir, shared, 24)
        # the stall over, the prefill worker says its writes are over: what was held comes back
        deadline = time.monotonic() + 30
        while worker.fence.quarantined_blocks or worker.kv_held != (0, 0):
            assert time.monotonic() < deadline, f"still held: {worker.kv_held}"
            time.sleep(0.1)
        assert worker.engine.num_free_blocks == 40
    finally:
        server.stop(0)
        worker.close()
        cluster.stop()
