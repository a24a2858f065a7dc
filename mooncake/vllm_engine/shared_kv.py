"""vLLM at tensor-parallel size N > 1: its cache in the pool layout, every head, in shared memory.

At N > 1 vLLM's model runs in N rank processes of its own (its multiprocessing executor), each holding its share of
every layer's KV heads, while the worker (what it loads, what it pushes, the decode write-behind) lives in the
process that schedules: the connector's scheduler side. One copy of the cache joins them, ``[num_blocks, L, 2,
block_size, Hkv, D]`` in a shared-memory file that every process maps:

    loads        the scheduler side writes a request's prefix (from the pool or its landing slots) into the copy at
                 the request's blocks as the step is built; each rank reads its heads of it, layer by layer, into its
                 own cache (the backend's writer, as at one rank)
    new KV       each rank writes its heads of every block a step wrote, layer by layer, into the copy (a rank whose
                 head another rank holds too, where vLLM replicates heads, leaves it to the first), and then the
                 step's id into its slot of ``done``
    pushes       after the step, the scheduling process waits for every rank's ``done`` and pushes the step's
                 completed blocks from the copy: the prefill pusher's ``export``, the decode write-behind's read

So rank r of N holds KV heads ``[r*H/N, (r+1)*H/N)`` (vLLM's split), or head ``r*H//N`` where H < N. The copy costs the
cache's size once more in host memory, as our own engine's rank 0 keeps (mooncake.engine.ranks' Mirror); pushes leave
after the step, not layer by layer as at one rank.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from pathlib import Path

import torch

DONE_POLL_S = 0.0005


def shared_dir() -> Path:
    """Where the copies live: tmpfs where there is one (/dev/shm), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _mapped(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` mapped from ``path``, made that size where it is new (any process may come
    first; one that comes later maps what is there). RuntimeError where the file has another size."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            os.ftruncate(fd, nbytes)
        elif size != nbytes:
            raise RuntimeError(f"{path} holds {size} bytes where {nbytes} were expected: the ranks disagree")
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def bind_cpu_ranks(world: int) -> None:
    """vLLM binds each CPU rank's threads to a NUMA node of its own and refuses where there are fewer nodes than ranks:
    there the usable cores are split evenly among the ranks (VLLM_CPU_OMP_THREADS_BIND, unless it is set). ValueError
    with fewer cores than ranks."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or len(glob.glob("/sys/devices/system/node/node[0-9]*")) >= world:
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < world:
        raise ValueError(f"tensor-parallel size {world} on {len(cpus)} usable cores: each CPU rank needs a core")
    per = len(cpus) // world
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(c) for c in cpus[r * per : (r + 1) * per]) for r in range(world)
    )


def heads_of(rank: int, world: int, num_kv_heads: int) -> tuple[slice, bool]:
    """Rank ``rank``'s KV heads of ``num_kv_heads`` at size ``world`` (vLLM's split) and whether it writes them to the
    copy (the first of the ranks that hold a replicated head)."""
    if num_kv_heads >= world:
        per = num_kv_heads // world
        return slice(rank * per, (rank + 1) * per), True
    replicas = world // num_kv_heads
    head = rank // replicas
    return slice(head, head + 1), rank % replicas == 0


class SharedKV:
    """The copy (``kv``: [num_blocks, L, 2, bs, Hkv, D]) and each rank's last finished step (``done``: [world])."""

    def __init__(self, name: str, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, world: int):
        directory = shared_dir()
        self.paths = (directory / f"mooncake-{name}.kv", directory / f"mooncake-{name}.done")
        self.block_shape = tuple(block_shape)  # (L, 2, bs, Hkv, D)
        numel = num_blocks
        for n in self.block_shape:
            numel *= n
        self.kv = _mapped(self.paths[0], numel, dtype).view(num_blocks, *self.block_shape)
        self.done = _mapped(self.paths[1], world, torch.int64)

    def unlink(self) -> None:
        """Remove the files (every process that maps them keeps its mapping)."""
        for path in self.paths:
            path.unlink(missing_ok=True)

    def wait_for(self, step_id: int, alive=None, timeout_s: float = 600.0) -> None:
        """Until every rank finished step ``step_id``. ``alive()`` False (a rank died) or the timeout: RuntimeError."""
        deadline = time.monotonic() + timeout_s
        while int(self.done.min()) < step_id:
            if (alive is not None and not alive()) or time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM's ranks did not finish step {step_id} (their last: {self.done.tolist()}): a rank died?"
                )
            time.sleep(DONE_POLL_S)
