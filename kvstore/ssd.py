"""The SSD tier: pre-allocated files of fixed-size block slots, each with a checksummed header.

Layout of one slot file (``slots-0000.bin`` ...), every slot ``stride`` bytes, 4 KiB aligned:

    +-------------------- slot 0 ---------------------+-------- slot 1 --------- ...
    | header (64 B) | pad to 4 KiB | block data (block_bytes, padded to 4 KiB) | ...
    header = magic "MCKVBLK1" | version u32 | flags u32 | key[16] | length u64
             | data_xxh3_64 u64 | seq u64 | parent[16] | position u32 | pad u32 | header_xxh3_64 u64

``parent`` is the block before this one in its key chain (flags bit 0: known; the
Conductor's index needs it, conductor/index.py) and ``position`` the block's index in
the chain. Version 1 headers (before parent and position) still read: parent unknown.

A write first zeroes the slot's header, then writes the data, then the new header: a
crash (``kill -9`` or, with ``fsync``, power loss) at any point leaves either no valid
header or a header whose data checksum matches the data on disk. A read verifies the
header, the key and the data checksum; anything else is :class:`CorruptBlock`, never
data. On start, :meth:`adopt` scans the headers and returns the valid blocks (newest
``seq`` wins if a key appears twice), so a restarted node keeps what it had.

``meta.json`` records the geometry; a directory written with another block size or file
size is refused with a clear error instead of being misread.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

MAGIC = b"MCKVBLK1"
VERSION = 1  # of the directory's geometry (meta.json)
HEADER_VERSION = 2
HEADER_V1 = struct.Struct("<8sII16sQQQ")  # magic, version, flags, key, length, data checksum, seq
HEADER = struct.Struct("<8sII16sQQQ16sI4x")  # ... then parent, position
HEADER_BYTES = 128
PARENT_KNOWN = 1
ALIGN = 4096


class CorruptBlock(Exception):
    """A slot's header or data failed verification."""


@dataclass(frozen=True, slots=True)
class AdoptedBlock:
    slot: int
    key: bytes
    seq: int
    parent: bytes | None = None  # b"": a chain's first block; None: not known
    position: int = 0


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class SsdTier:
    """Block slots in pre-allocated files under ``directory``. Not thread-safe: the store serialises calls."""

    def __init__(
        self, directory: str | os.PathLike, block_bytes: int, num_blocks: int, file_blocks: int, fsync: bool = False
    ) -> None:
        if block_bytes <= 0 or num_blocks <= 0 or file_blocks <= 0:
            raise ValueError("block_bytes, num_blocks and file_blocks must be positive")
        self.dir = Path(directory)
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.file_blocks = file_blocks
        self.fsync = fsync
        self.data_offset = ALIGN
        self.stride = ALIGN + _round_up(block_bytes, ALIGN)
        self._seq = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._check_meta()
        self._fds: list[int] = []
        for i in range((num_blocks + file_blocks - 1) // file_blocks):
            path = self.dir / f"slots-{i:04d}.bin"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            size = min(file_blocks, num_blocks - i * file_blocks) * self.stride
            if os.fstat(fd).st_size < size:
                try:
                    os.posix_fallocate(fd, 0, size)  # reserve the space now, not at the first eviction
                except OSError:
                    os.ftruncate(fd, size)
            self._fds.append(fd)

    def _check_meta(self) -> None:
        meta_path = self.dir / "meta.json"
        want = {"version": VERSION, "block_bytes": self.block_bytes, "file_blocks": self.file_blocks}
        if meta_path.exists():
            have = json.loads(meta_path.read_text())
            if have != want:
                raise ValueError(
                    f"SSD directory {self.dir} holds blocks of another geometry ({have}); "
                    f"this node is configured for {want}: use another directory or empty this one"
                )
            return
        tmp = meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(want))
        os.replace(tmp, meta_path)

    def _where(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.num_blocks:
            raise ValueError(f"SSD slot {slot} out of range [0, {self.num_blocks})")
        return self._fds[slot // self.file_blocks], (slot % self.file_blocks) * self.stride

    @staticmethod
    def _pack(key: bytes, length: int, checksum: int, seq: int, parent: bytes | None, position: int) -> bytes:
        flags = PARENT_KNOWN if parent is not None else 0
        head = HEADER.pack(
            MAGIC, HEADER_VERSION, flags, key, length, checksum, seq, (parent or b"").ljust(16, b"\0"), position
        )
        return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))

    def write(self, slot: int, key: bytes, data: memoryview, parent: bytes | None = None, position: int = 0) -> None:
        """Store ``data`` (exactly ``block_bytes``) as ``key`` in ``slot``, crash-safely."""
        if len(data) != self.block_bytes:
            raise ValueError(f"block is {len(data)} bytes, the SSD tier stores {self.block_bytes}")
        fd, base = self._where(slot)
        os.pwrite(fd, bytes(HEADER_BYTES), base)  # the old block stops being valid first
        checksum = xxhash.xxh3_64_intdigest(data)
        os.pwrite(fd, data, base + self.data_offset)
        if self.fsync:
            os.fdatasync(fd)
        self._seq += 1
        os.pwrite(fd, self._pack(key, len(data), checksum, self._seq, parent, position), base)
        if self.fsync:
            os.fdatasync(fd)

    def read(self, slot: int, key: bytes, out: memoryview) -> None:
        """Read ``key``'s block from ``slot`` into ``out``; raise :class:`CorruptBlock` if it does not verify."""
        fd, base = self._where(slot)
        header = os.pread(fd, HEADER_BYTES, base)
        parsed = self._parse(header)
        if parsed is None:
            raise CorruptBlock(f"SSD slot {slot}: header is not valid")
        got_key, length, checksum = parsed[:3]
        if got_key != key or length != self.block_bytes or len(out) != length:
            raise CorruptBlock(f"SSD slot {slot}: holds another block or another size")
        n = os.preadv(fd, [out], base + self.data_offset)
        if n != length or xxhash.xxh3_64_intdigest(out) != checksum:
            raise CorruptBlock(f"SSD slot {slot}: data checksum mismatch (block {key.hex()})")

    def invalidate(self, slot: int) -> None:
        """Forget the block in ``slot`` (its header is zeroed)."""
        fd, base = self._where(slot)
        os.pwrite(fd, bytes(HEADER_BYTES), base)

    @staticmethod
    def _parse(header: bytes) -> tuple[bytes, int, int, int, bytes | None, int] | None:
        """(key, length, data checksum, seq, parent, position) of a valid header, else None."""
        if len(header) < HEADER_BYTES or header[:8] != MAGIC:
            return None
        (version,) = struct.unpack_from("<I", header, 8)
        layout = {1: HEADER_V1, HEADER_VERSION: HEADER}.get(version)
        if layout is None:
            return None
        body = header[: layout.size]
        (stored,) = struct.unpack_from("<Q", header, layout.size)
        if xxhash.xxh3_64_intdigest(body) != stored:
            return None
        if version == 1:
            _, _, _, key, length, checksum, seq = layout.unpack(body)
            return key, length, checksum, seq, None, 0
        _, _, flags, key, length, checksum, seq, parent, position = layout.unpack(body)
        if not flags & PARENT_KNOWN:
            parent_out = None
        else:
            parent_out = b"" if position == 0 else parent
        return key, length, checksum, seq, parent_out, position

    def adopt(self) -> list[AdoptedBlock]:
        """Scan every slot header; return the valid blocks (data is verified when read)."""
        best: dict[bytes, AdoptedBlock] = {}
        stale: list[int] = []
        for slot in range(self.num_blocks):
            fd, base = self._where(slot)
            parsed = self._parse(os.pread(fd, HEADER_BYTES, base))
            if parsed is None:
                continue
            key, length, _, seq, parent, position = parsed
            if length != self.block_bytes:
                stale.append(slot)
                continue
            self._seq = max(self._seq, seq)
            old = best.get(key)
            if old is None or seq > old.seq:
                if old is not None:
                    stale.append(old.slot)
                best[key] = AdoptedBlock(slot, key, seq, parent, position)
            else:
                stale.append(slot)
        for slot in stale:
            self.invalidate(slot)
        return sorted(best.values(), key=lambda b: b.seq)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
