"""Layer-granular KV connector hooks (shaped after vLLM's KV connector, worker side).

The engine calls these around every forward pass; a prefill or decode worker plugs in a
connector that moves KV between the paged cache and the pool while layers compute:

    start_step(step)                    before layer 0; kick off async loads
    for layer in 0 .. L-1:
        wait_for_layer_load(layer)      before the layer's attention reads the cache
        ... attention writes the new tokens' K/V at step.slot_mapping ...
        save_layer(layer, k, v, step)   after the layer; push this layer's new K/V
    wait_for_save()                     after the last layer; the step ends after it

A hook may raise ``StepCancelled`` when every request of the step is cancelled: the step stops
there (a cancelled 512-token prefill on the CPU frees its blocks after a layer, not seconds later).

``step.requests`` says, per scheduled request, which cache slots its new tokens were
written to (``slots``) and its whole block table, so a connector can copy one layer of
the new tokens (``k_cache.view(-1, Hkv, D)[slots]``) or whole finished blocks.
Hooks run on the engine's thread, once per layer per step: keep them cheap and
asynchronous. The default connector (``KVConnector`` itself) does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepRequest:
    """One request's part of a forward step, as the connector sees it."""

    request_id: str
    num_computed_tokens: int  # tokens whose KV was in the cache before this step
    num_new_tokens: int  # tokens computed in this step
    slots: torch.Tensor  # [num_new_tokens] long: cache slots written in this step
    block_ids: list[int]  # the request's whole block table after this step


@dataclass(slots=True)
class ConnectorStep:
    """What a connector learns about one forward step (built once per step)."""

    step_id: int
    requests: list[StepRequest]


class StepCancelled(Exception):
    """Raised by a connector's hook mid-step when every request of the step has been cancelled by its caller: the
    engine drops the rest of the step and aborts those requests (the blocks it was filling were never offered to the
    prefix cache, so nothing half-computed is ever read). The connector settles what the step started (pushes still
    reading the cache) before it raises."""


class KVConnector:
    """Base connector: every hook is a no-op. Subclass and override what you need."""

    stops_cancelled_steps = False  # its engine catches StepCancelled (ours sets it; vLLM's forward must not break off)

    def bind(self, kv_cache: torch.Tensor) -> None:
        """The engine's paged cache, once built (a connector that moves KV out of it keeps it)."""

    def start_step(self, step: ConnectorStep) -> None:
        """Called before the first layer of every step."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until KV this step needs in ``layer`` is in the cache."""

    def save_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, step: ConnectorStep) -> None:
        """Called after ``layer`` wrote this step's K/V; caches are [num_blocks, bs, Hkv, D]."""

    def wait_for_save(self) -> None:
        """Block until every save of this step is safe to overwrite (end of step)."""

    def request_finished(self, request_id: str, block_ids: list[int]) -> bool:
        """Called when a request finishes or is aborted, before its blocks are freed. True: the connector keeps
        ``block_ids`` (it still reads them, off the engine's critical path) and hands them back through
        ``released_blocks``; the engine frees them then."""
        return False

    def released_blocks(self) -> list[int]:
        """Blocks kept by ``request_finished`` that the connector is done with (the engine frees them before each
        step). Thread-safe: any thread may finish with them."""
        return []
