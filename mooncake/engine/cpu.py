"""CPU process tuning for the engine (called once, at engine start)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Stop glibc from returning large freed buffers to the OS after every step.

    PyTorch's CPU allocator has no cache: every activation over glibc's mmap threshold
    is a fresh mmap whose pages fault in on first touch, then an munmap. An engine step
    allocates and frees the same sizes over and over, so raising both thresholds lets
    those buffers be reused from the heap instead of faulting fresh pages in on every
    step. Process-wide; returns False off glibc.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    except (OSError, AttributeError):
        return False
    if not ok:
        log.info("mallopt refused; large buffers keep being mapped per allocation")
    return ok
