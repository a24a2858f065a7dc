"""Build a ready-to-run CausalLM from a model directory, and fingerprint that directory."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mooncake.engine.model import CausalLM
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.parallel import SINGLE, TensorParallel
from mooncake.engine.weights import (
    _check_safetensors_size,
    load_hf_config,
    read_json_object,
    weight_files,
)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    layers: range | None = None,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """Read config and weights, build the model (or, with ``layers``, one pipeline stage of it: only those layers'
    weights are read; with ``tp``, this tensor-parallel rank's shard of it) in ``dtype`` on ``device``, eval mode.

    The model is made on the meta device and given memory once, in ``dtype`` on ``device``; the checkpoint's
    tensors are then read one at a time and copied into place (``CausalLM.load_hf_tensors``), so the peak is the
    weights in ``dtype`` and one checkpoint tensor more, not two copies of the model
    (benchmarks/load_memory.py measures it).

    Raises FileNotFoundError / ValueError (from weights.py and ModelArgs) for a missing
    directory, an unsupported architecture, or weights that do not fit it.
    """
    args = ModelArgs.from_hf_config(load_hf_config(model_dir))
    with torch.device("meta"):
        model = CausalLM(args, layers, tp)
    _materialize(model, dtype, device)
    model.load_hf_tensors(stream_hf_tensors(model_dir, model.owns))
    return model.eval()


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give a model made on the meta device uninitialised memory on ``device``, floating tensors in ``dtype`` (what
    ``model.to(dtype).to_empty(device=device)`` does, without the Python reference kernels that the meta tensors'
    ``empty_like`` goes through: their first use costs about half a second of a worker's start on a CPU); a quantized
    layer's values and scales keep their own dtypes."""
    made: dict[int, torch.Tensor] = {}  # by the meta tensor's id: a tensor two modules share stays shared
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            keep = table is module._buffers and getattr(module, "keeps_dtypes", False)  # quant.QuantLinear's
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    to = dtype if t.is_floating_point() and not keep else t.dtype
                    new = torch.empty(t.shape, dtype=to, device=device)
                    made[id(t)] = (
                        nn.Parameter(new, requires_grad=t.requires_grad) if table is module._parameters else new
                    )
                table[name] = made[id(t)]


def stream_hf_tensors(model_dir: str | Path, only: Callable[[str], bool]) -> Iterator[tuple[str, "FileTensor"]]:
    """(name, FileTensor) of each checkpoint tensor ``only`` accepts, file after file, each read when the loader
    copies it. ValueError naming the file for a truncated or corrupt one (weights._check_safetensors_size)."""
    for file in weight_files(model_dir):
        _check_safetensors_size(file)
        with file.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_len))
            base = 8 + header_len
            for name, info in header.items():
                if name == "__metadata__" or not only(name):
                    continue
                dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
                if dtype is None:
                    raise ValueError(f"safetensors file {str(file)!r}: tensor {name} has dtype {info.get('dtype')!r}")
                begin, end = (int(x) for x in info["data_offsets"])
                shape = torch.Size(int(d) for d in info["shape"])
                if end - begin != shape.numel() * dtype.itemsize:
                    raise ValueError(f"safetensors file {str(file)!r} is corrupt: {name} holds {end - begin} bytes")
                yield name, FileTensor(handle.fileno(), base + begin, dtype, shape)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_READ_CHUNK = 1 << 30  # bytes per pread (Linux moves at most ~2 GiB a call)


@dataclass(frozen=True, slots=True)
class FileTensor:
    """A tensor of a safetensors file, read on demand with plain reads rather than through safetensors' memory map:
    a mapped file's pages count in the process's resident memory while it is open (and in its container's limit),
    read pages only in the kernel's cache. The file stays open while its tensors are read (``stream_hf_tensors``)."""

    fd: int
    offset: int
    dtype: torch.dtype
    shape: torch.Size

    def rows(self, part: slice) -> FileTensor:
        """Rows ``part`` of dimension 0 (a contiguous stretch of the file): a tensor-parallel rank's share."""
        start, stop, _ = part.indices(self.shape[0])
        row_bytes = self.shape[1:].numel() * self.dtype.itemsize
        return FileTensor(
            self.fd, self.offset + start * row_bytes, self.dtype, torch.Size((stop - start, *self.shape[1:]))
        )

    def read_into(self, dest: torch.Tensor) -> None:
        """Fill ``dest`` (this shape) with the tensor: read straight into it when it is a dense CPU tensor of this
        dtype, else into one staging tensor converted by ``copy_``."""
        direct = dest.device.type == "cpu" and dest.dtype == self.dtype and dest.is_contiguous()
        target = dest if direct else torch.empty(self.shape, dtype=self.dtype)
        raw = memoryview(target.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(raw):
            n = os.preadv(self.fd, [raw[done : done + _READ_CHUNK]], self.offset + done)
            if n <= 0:
                raise ValueError(f"a weight file ended {len(raw) - done} bytes early (truncated while loading?)")
            done += n
        if not direct:
            dest.copy_(target)


def generation_eos_ids(model_dir: str | Path) -> frozenset[int]:
    """EOS ids from generation_config.json (some models list extra stop ids only there)."""
    eos = read_json_object(Path(model_dir) / "generation_config.json").get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, list) else [eos]))
