"""First writes into a fresh shared-memory mapping against writes into one already touched, and what reserving
(posix_fallocate) and populating (MAP_POPULATE) the region at creation change: why transfer.region commits regions up
front.

    python -m benchmarks.shm_fault_bench [--mib 256]

Prints, for each way of making the region, the time to map it and to write it twice (numpy copies, as the shm
transfer backend does).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="region size")
    ap.add_argument("--dir", default="/dev/shm", help="a tmpfs directory")
    args = ap.parse_args(argv)
    size = args.mib << 20
    src = np.ones(size, dtype=np.uint8)
    ways = {"sparse (ftruncate)": (False, False), "fallocate": (True, False), "fallocate + MAP_POPULATE": (True, True)}
    for label, (reserve, populate) in ways.items():
        fd, path = tempfile.mkstemp(dir=args.dir)
        os.ftruncate(fd, size)
        if reserve:
            os.posix_fallocate(fd, 0, size)
        t = time.perf_counter()
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
        t_map = time.perf_counter() - t
        os.close(fd)
        os.unlink(path)
        dst = np.frombuffer(mm, dtype=np.uint8)
        writes = []
        for _ in range(2):
            t = time.perf_counter()
            np.copyto(dst, src)
            writes.append(time.perf_counter() - t)
        print(
            f"{label:<26} map {t_map * 1e3:7.1f} ms   first write {writes[0] * 1e3:7.1f} ms "
            f"({size / writes[0] / 1e9:5.1f} GB/s)   second {writes[1] * 1e3:7.1f} ms "
            f"({size / writes[1] / 1e9:5.1f} GB/s)"
        )
        del dst
        mm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
