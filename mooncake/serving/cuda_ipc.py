"""A decode engine's CUDA KV cache shared with prefill workers on its host, by CUDA IPC.

The decode worker exports its cache once (``export_cuda_tensor``); the bytes travel in each
Prefill call's ``Landing.cuda_ipc``; a prefill worker on the same host maps the cache once per
decode worker (``CudaCaches.open``) and writes a prompt's KV into the granted blocks with
device-to-device copies (prefill/connector.py). Two processes may share one GPU or use two
(the copy then crosses by peer access).

The handle is torch's own (``torch.multiprocessing.reductions.reduce_tensor``: the allocator
block's cudaIpcMemHandle, its offset, the producer's reference counter), encoded as JSON
rather than pickled, so a Prefill call carries data, never code. The exporter keeps the tensor
alive for as long as the process runs (the engine's cache does).
"""

from __future__ import annotations

import json
import threading

import torch

_FIELDS = (
    "size",
    "stride",
    "offset",
    "dtype",
    "device",
    "handle",
    "storage_bytes",
    "storage_offset",
    "requires_grad",
    "ref_handle",
    "ref_offset",
    "event_handle",
    "event_sync",
)


def export_cuda_tensor(tensor: torch.Tensor) -> bytes:
    """The IPC description of a CUDA tensor, for ``open_cuda_tensor`` in another process on this host."""
    if tensor.device.type != "cuda":
        raise ValueError("only a CUDA tensor is exported by CUDA IPC")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (
        _,
        size,
        stride,
        offset,
        _,
        dtype,
        device,
        handle,
        storage_bytes,
        storage_offset,
        requires_grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    values = (
        list(size),
        list(stride),
        offset,
        str(dtype).removeprefix("torch."),
        device,
        handle,
        storage_bytes,
        storage_offset,
        requires_grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    )
    out = {}
    for name, value in zip(_FIELDS, values):
        out[name] = {"hex": value.hex()} if isinstance(value, bytes) else value
    return json.dumps(out).encode()


def open_cuda_tensor(data: bytes) -> torch.Tensor:
    """Map a tensor exported by ``export_cuda_tensor`` in another process (cudaIpcOpenMemHandle).

    Raises ValueError for a description that does not parse, RuntimeError where CUDA refuses it (another host,
    another boot, no peer access)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        raw = json.loads(data)
        v = {name: bytes.fromhex(raw[name]["hex"]) if isinstance(raw[name], dict) else raw[name] for name in _FIELDS}
        dtype = getattr(torch, v["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{v['dtype']!r} is not a torch dtype")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"not a CUDA IPC tensor description: {e}") from None
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(v["size"]),
        tuple(v["stride"]),
        v["offset"],
        torch.UntypedStorage,
        dtype,
        v["device"],
        v["handle"],
        v["storage_bytes"],
        v["storage_offset"],
        v["requires_grad"],
        v["ref_handle"],
        v["ref_offset"],
        v["event_handle"],
        v["event_sync"],
    )


class CudaCaches:
    """Decode engines' caches mapped into this process, one mapping per exported description (thread-safe)."""

    def __init__(self) -> None:
        self._open: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    def open(self, data: bytes) -> torch.Tensor:
        with self._lock:
            tensor = self._open.get(data)
            if tensor is None:
                tensor = self._open[data] = open_cuda_tensor(data)
            return tensor
