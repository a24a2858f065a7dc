"""KV blocks in shared memory, as tensors: pool slots and landing slots.

A pool node's DRAM tier and a decode worker's landing area are both segments of
block-sized slots, slot ``i`` at byte ``i * block_bytes``, each block in the pool layout
of DESIGN §4::

    slot i: [layers][2 (K, V)][block_size][kv_heads][head_dim]   (one layer: contiguous)

``slot_tensor`` views such a buffer as [num_slots, L, 2, bs, Hkv, D] without copying, so
workers on the segment's host read and write blocks (or one layer of them) directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from mooncake.engine.runner import ExternalKV


def slot_tensor(buffer, block_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """View ``buffer`` (a writable buffer of whole slots) as [num_slots, *block_shape]."""
    elem = torch.tensor([], dtype=dtype).element_size()
    block_bytes = elem
    for d in block_shape:
        block_bytes *= d
    view = memoryview(buffer).cast("B")
    slots = len(view) // block_bytes
    if slots == 0:
        raise ValueError(f"a buffer of {len(view)} bytes holds no block of {block_bytes} bytes")
    flat = torch.frombuffer(view[: slots * block_bytes], dtype=dtype)
    return flat.view(slots, *block_shape)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor of any dtype (bfloat16 too, which numpy has not), without copying: what a
    transfer writes from or reads into."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class SlotAllocator:
    """Free slots of a segment (thread-safe). ``allocate`` gives all ``n`` or none."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    def allocate(self, n: int) -> list[int] | None:
        with self._lock:
            if n > len(self._free):
                return None
            out = [self._free.pop() for _ in range(n)]
        return out

    def free(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    @property
    def num_free(self) -> int:
        return len(self._free)


class SlotKV(ExternalKV):
    """A request's leading blocks in slots of ``slots`` (a slot_tensor), read layer by layer.

    ``wait_layer(l)``, when given, blocks until layer ``l`` of every block is in place (a
    pull still landing); the engine calls ``layer`` right before that layer runs.
    """

    def __init__(
        self, slots: torch.Tensor, indices: Sequence[int], wait_layer: Callable[[int], None] | None = None
    ) -> None:
        self._slots = slots
        self._indices = torch.tensor(list(indices), dtype=torch.long)
        self._wait_layer = wait_layer
        self.shape = (len(self._indices), *slots.shape[1:])

    @property
    def indices(self) -> list[int]:
        """The slots holding the blocks, in order."""
        return self._indices.tolist()

    def wait(self, layer: int) -> None:
        """Block until layer ``layer`` of every block is in place (at once when nothing is landing)."""
        if self._wait_layer is not None:
            self._wait_layer(layer)

    def layer(self, layer: int, start: int, end: int) -> torch.Tensor:
        self.wait(layer)
        return self._slots[:, layer].index_select(0, self._indices[start:end])  # [n, 2, bs, Hkv, D]

    def source(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, list[int]]:
        self.wait(layer)
        return self._slots[:, layer], self._indices[start:end].tolist()
