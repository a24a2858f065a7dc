"""Chunked pipeline parallelism across processes: each stage a process, a chunk's hidden states through the transfer
engine into the next stage's inbox (shm on one host, tcp across hosts), control messages over pipes.

    driver --plan--> stage 0 --hidden (transfer engine) + "chunk k in slot s" (pipe)--> stage 1 --> ...
                     stage 0 <--"slot s is free" (pipe)----------------------------------- stage 1
    driver <--first token (and, when asked, each stage's KV)-------------------------- every stage

Each stage allocates an inbox segment of ``SLOTS`` chunk-sized slots; a sender writes
chunk k into slot k % SLOTS once the receiver has freed it (the receiver copies a slot
out before it computes), so a stage computes chunk k + 1 while the next one computes
chunk k. Each stage process computes with one thread (``torch.set_num_threads(1)``).
The prefill worker group will drive its stages the same way; this module is what the
CPP benchmark and tests run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
from dataclasses import dataclass

import torch

SLOTS = 2  # chunks in flight between two stages


@dataclass(frozen=True, slots=True)
class StageSpec:
    model_dir: str
    layers: range
    num_blocks: int
    block_size: int
    max_model_len: int
    max_chunk: int  # tokens: sizes the inbox slots
    shm_dir: str = "/dev/shm/mooncake"


class ProcessPipeline:
    """X stage processes (``specs`` in layer order). One prefill at a time; :meth:`close` ends the processes, and a
    prefill that fails (a stage raised, or died) closes them too, after every stage has answered."""

    def __init__(self, specs: list[StageSpec], start_timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self._specs = specs
        self._procs, self._drivers = [], []
        links = [ctx.Pipe() for _ in range(len(specs) - 1)]  # forward: "chunk k in slot s"
        acks = [ctx.Pipe() for _ in range(len(specs) - 1)]  # backward: "slot s is free"
        for i, spec in enumerate(specs):
            mine, theirs = ctx.Pipe()
            prev_in = links[i - 1][1] if i else None
            next_out = links[i][0] if i + 1 < len(specs) else None
            ack_out = acks[i - 1][0] if i else None
            ack_in = acks[i][1] if i + 1 < len(specs) else None
            proc = ctx.Process(target=_stage_main, args=(i, len(specs), spec, theirs, prev_in, next_out, ack_out, ack_in),
                               name=f"cpp-stage-{i}", daemon=True)  # fmt: skip
            proc.start()
            self._procs.append(proc)
            self._drivers.append(mine)
        segments = []
        for i, conn in enumerate(self._drivers):
            if not conn.poll(start_timeout_s):
                self.close()
                raise RuntimeError(f"pipeline stage {i} did not start within {start_timeout_s} s")
            segments.append(_reply(conn))
        for i, conn in enumerate(self._drivers[:-1]):
            conn.send(("next_inbox", segments[i + 1]))  # where stage i writes its hidden states

    def prefill(self, request_id: str, prompt: list[int], temperature: float = 0.0, seed: int | None = None,
                chunk: int = 512, export: bool = False, timeout_s: float = 3600.0, prefix_kv: torch.Tensor | None = None,
                num_prefix_tokens: int = 0) -> tuple[int, torch.Tensor | None]:  # fmt: skip
        """The first token of ``prompt`` (greedy, or seeded sampling) and, with ``export``, its KV in the pool layout.

        ``prefix_kv`` [n, L, 2, bs, Hkv, D] holds the KV of its first ``num_prefix_tokens`` (a reused prefix): each
        stage gets its layers of it, and the chunks start after it."""
        if not 0 <= num_prefix_tokens < len(prompt):
            raise ValueError(f"num_prefix_tokens must be in [0, {len(prompt) - 1}], got {num_prefix_tokens}")
        for spec, conn in zip(self._specs, self._drivers):
            prefix = prefix_kv[:, spec.layers.start : spec.layers.stop] if num_prefix_tokens else None
            conn.send(("prefill", request_id, prompt, chunk, temperature, seed, export, prefix, num_prefix_tokens))
        replies, errors = [], []
        for i, conn in enumerate(self._drivers):
            if not conn.poll(timeout_s):
                errors.append(f"stage {i} did not answer within {timeout_s} s")
                break
            try:
                replies.append(_reply(conn))
            except RuntimeError as e:
                errors.append(str(e))
        if errors:  # every stage answered (or one hung): the pipeline is closed, a new one serves the next prefill
            self.close()
            raise RuntimeError("; ".join(errors))
        token = replies[-1][0]
        kv = torch.cat([r[1] for r in replies], dim=1) if export else None
        return token, kv

    def close(self) -> None:
        for conn in self._drivers:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


class _Aborted(Exception):
    """A neighbouring stage failed this prefill."""


def _ack(ack_in, index: int) -> int:
    slot = ack_in.recv()
    if slot < 0:
        raise _Aborted(f"stage {index + 1} failed")
    return slot


def _reply(conn):
    try:
        kind, *payload = conn.recv()
    except (EOFError, OSError):
        raise RuntimeError("a pipeline stage died") from None
    if kind == "error":
        raise RuntimeError(f"a pipeline stage failed: {payload[0]}")
    return payload[0] if len(payload) == 1 else payload


def _stage_main(index, num_stages, spec: StageSpec, driver, prev_in, next_out, ack_out, ack_in) -> None:
    torch.set_num_threads(1)
    from mooncake.engine.pipeline import chunk_bounds
    from mooncake.engine.request import SamplingParams
    from mooncake.engine.sampler import History
    from mooncake.engine.stage import PipelineStage
    from transfer import Slice, TransferConfig, TransferEngine

    try:
        stage = PipelineStage(spec.model_dir, spec.layers, num_blocks=spec.num_blocks, block_size=spec.block_size,
                              max_model_len=spec.max_model_len)  # fmt: skip
        hidden_size = stage.model.args.hidden_size
        elem = stage.kv_cache.element_size()
        slot_bytes = spec.max_chunk * hidden_size * elem
        engine = TransferEngine(TransferConfig(node=f"cpp{index}-{os.getpid()}-{uuid.uuid4().hex[:6]}", serve=False,
                                               shm_dir=spec.shm_dir))  # fmt: skip
        inbox = engine.allocate("inbox", slot_bytes * SLOTS) if index else None
        driver.send(("ready", inbox))
        next_inbox = None
        if next_out is not None:
            kind, next_inbox = driver.recv()
            engine.add_segment(next_inbox)
        inbox_view = engine.buffer("inbox") if inbox is not None else None
    except BaseException as e:  # noqa: BLE001 - the driver reports it
        driver.send(("error", f"stage {index} could not start: {e!r}"))
        return
    while True:
        msg = driver.recv()
        if msg[0] == "stop":
            engine.close()
            return
        _, request_id, prompt, chunk, temperature, seed, export, prefix, num_prefix_tokens = msg
        try:
            if num_prefix_tokens:
                stage.import_prefix(request_id, prefix, num_prefix_tokens)
            free = list(range(SLOTS))  # of the next stage's inbox
            last = None
            for k, (a, b) in enumerate(chunk_bounds(num_prefix_tokens, len(prompt), chunk)):
                n = b - a
                if index == 0:
                    out = stage.run_chunk(request_id, a, token_ids=prompt[a:b])
                else:
                    kind, got_k, slot = prev_in.recv()
                    if kind != "chunk" or got_k != k:
                        raise _Aborted(f"stage {index - 1} failed") if kind == "abort" else RuntimeError(
                            f"stage {index} expected chunk {k}, got {kind} {got_k}")  # fmt: skip
                    raw = torch.frombuffer(inbox_view, dtype=stage.kv_cache.dtype, count=n * hidden_size,
                                           offset=slot * slot_bytes).view(n, hidden_size).clone()  # fmt: skip
                    ack_out.send(slot)  # copied out: the previous stage may reuse it
                    out = stage.run_chunk(request_id, a, hidden=raw)
                if next_out is not None:
                    while not free:
                        free.append(_ack(ack_in, index))
                    slot = free.pop(0)
                    data = out.contiguous()
                    engine.write(memoryview(data.numpy()).cast("B"),
                                 [Slice(0, next_inbox.name, slot * slot_bytes, n * hidden_size * elem)]).wait(timeout=60)  # fmt: skip
                    next_out.send(("chunk", k, slot))
                last = out
            while next_out is not None and len(free) < SLOTS:  # the next stage copied out every chunk
                free.append(_ack(ack_in, index))
            token = None
            if index == num_stages - 1:
                params = SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
                token = stage.sample_first(last[-1], params, History(prompt, ()))
            kv = stage.export(request_id) if export else None
            stage.release(request_id)
            driver.send(("done", token, kv))
        except BaseException as e:  # noqa: BLE001 - the driver reports it
            stage.release(request_id)
            if not isinstance(e, _Aborted):  # tell the neighbours, so that none waits for this stage forever
                if next_out is not None:
                    next_out.send(("abort", -1, -1))
                if ack_out is not None:
                    ack_out.send(-1)
            driver.send(("error", f"stage {index}: {e!r}"))
            return  # a failed pipeline is closed by its driver: its pipes may hold a dead request's messages
