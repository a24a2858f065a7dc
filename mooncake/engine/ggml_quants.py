"""Vectorised dequantisation of GGML tensor encodings (the payloads of GGUF files).

Every quantised type stores a tensor's last dimension in fixed-size *blocks*; each
block is ``type_size`` bytes holding ``block_size`` values. We decode all blocks of a
tensor at once with numpy array ops (no Python loop over blocks), in float32, and in
exactly the arithmetic order of ggml's reference ``dequantize_row_*`` (as mirrored by
``gguf.quants``), so results are bit-for-bit identical to it.

Block layouts (little-endian; ``f16`` is IEEE half)::

    Q4_0  (32 values, 18 B)  | d:f16 | qs[16] nibbles |            x = (q - 8) * d
    Q4_1  (32 values, 20 B)  | d:f16 | m:f16 | qs[16] |            x = q * d + m
    Q5_0  (32 values, 22 B)  | d:f16 | qh:u32 | qs[16] |           x = (q - 16) * d
    Q5_1  (32 values, 24 B)  | d:f16 | m:f16 | qh:u32 | qs[16] |  x = q * d + m
    Q8_0  (32 values, 34 B)  | d:f16 | qs:i8[32] |                x = q * d
    Q4_K (256 values, 144 B) | d:f16 | dmin:f16 | scales[12] (8 x 6-bit sc, 8 x 6-bit m) | qs[128] |
                             x = (d * sc_j) * q - (dmin * m_j), sub-block j of 32 values
    Q5_K (256 values, 176 B) | d | dmin | scales[12] | qh[32] | qs[128] |  as Q4_K with a 5th bit
    Q6_K (256 values, 210 B) | ql[128] | qh[64] | scales:i8[16] | d:f16 |
                             x = (d * sc_j) * (q - 32), sub-block j of 16 values

In the 32-value types, byte ``i`` of ``qs`` holds value ``i`` in its low nibble and
value ``i + 16`` in its high nibble; bit ``i`` of ``qh`` is the 5th bit of value ``i``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256


def _f16(column: np.ndarray) -> np.ndarray:
    """Bytes [n, 2] holding little-endian halves -> float32 [n, 1]."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Bytes [n, k*group] -> uint8 [n, k, 2*group]: low nibbles of each group, then high."""
    n = qs.shape[0]
    grouped = qs.reshape(n, -1, 1, group)
    shifted = grouped >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape(n, -1, 2 * group)


def _fifth_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit field [n, count/8 bytes] -> uint8 [n, count] of 0/1 (bit i = value i)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[:, :count]


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:18], 16).reshape(-1, 32).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:20], 16).reshape(-1, 32).astype(np.float32)
    return d * q + m


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    high = _fifth_bits(blocks[:, 2:6], 32)
    low = _nibbles(blocks[:, 6:22], 16).reshape(-1, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    high = _fifth_bits(blocks[:, 4:8], 32)
    low = _nibbles(blocks[:, 8:24], 16).reshape(-1, 32)
    q = (low | (high << np.uint8(4))).astype(np.float32)
    return d * q + m


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    q = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.float32)
    return q * d


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte K-quant scale field into 8 scales and 8 mins (6 bits each).

    Bytes 0-3: low 6 bits = sc[0..3], top 2 bits = high bits of sc[4..7];
    bytes 4-7: low 6 bits = m[0..3],  top 2 bits = high bits of m[4..7];
    bytes 8-11: low nibble = low 4 bits of sc[4..7], high nibble = low 4 bits of m[4..7].
    """
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = (d * sc).reshape(n, 8, 1)
    offset = (dmin * mn).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:144], 32).reshape(n, 8, 32).astype(np.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = (d * sc).reshape(n, 8, 1)
    offset = (dmin * mn).reshape(n, 8, 1)
    # qh byte i holds the 5th bit of value i of sub-block j in bit j.
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    low = _nibbles(blocks[:, 48:176], 32).reshape(n, 8, 32)
    q = (low | ((qh & np.uint8(1)) << np.uint8(4))).astype(np.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql = blocks[:, 0:128]
    qh = blocks[:, 128:192]
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    scale = (d * sc).reshape(n, 16, 1)
    # Two halves of 128 values; each uses 64 ql bytes (low/high nibbles) and 32 qh bytes
    # (four 2-bit fields), giving 4 runs of 32 values per half.
    low = _nibbles(ql, 64).reshape(n, 2, 4, 32)
    high = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (low | ((high & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (scale * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(blocks).view(np.int16).astype(np.int32) << 16).view(np.float32)


def _f16_values(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks).view(np.float16).astype(np.float32)


def _f32_values(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks).view(np.float32)


_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.F32: _f32_values,
    GGMLQuantizationType.F16: _f16_values,
    GGMLQuantizationType.BF16: _bf16,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DECODERS)

# Decode at most this many blocks per numpy pass, to bound temporaries (~32 MiB of output).
_CHUNK_VALUES = 8 * 1024 * 1024


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a GGML tensor payload into a float32 array of ``shape``.

    ``raw`` is the tensor's data as ``gguf.GGUFReader`` exposes it (any dtype; its bytes
    are what count), ``qtype`` its GGML type, ``shape`` the logical shape in row-major
    (PyTorch) order, i.e. GGUF's ``ne`` reversed. Returns a new float32 array.
    Raises ``ValueError`` for an unsupported type or a payload of the wrong size.
    Called once per tensor during GGUF conversion.
    """
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        name = getattr(qtype, "name", str(qtype))
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"unsupported GGML tensor type {name}; supported: {supported}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel % block_size:
        raise ValueError(f"{numel} values are not a whole number of {qtype.name} blocks of {block_size}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    n_blocks = numel // block_size
    if data.size != n_blocks * type_size:
        raise ValueError(
            f"{qtype.name} payload has {data.size} bytes, expected {n_blocks * type_size} for shape {tuple(shape)}"
        )
    blocks = data.reshape(n_blocks, type_size)
    out = np.empty((n_blocks, block_size), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // block_size)
    # A corrupt file can hold inf/NaN scales; decode them as ggml would, without warnings.
    with np.errstate(all="ignore"):
        for start in range(0, n_blocks, step):
            out[start : start + step] = decoder(blocks[start : start + step]).reshape(-1, block_size)
    return out.reshape(shape)
