"""copy_blocks: block i of the destination holds exactly the source's block, whatever the runs, devices or dtypes."""

from __future__ import annotations

import pytest
import torch

from mooncake.engine.blockcopy import block_runs, copy_blocks


def _blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 2, 4, 3, generator=torch.Generator().manual_seed(seed))


def test_runs_are_maximal_and_consecutive_on_both_sides():
    assert block_runs([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 7]) == [(3, 0, 3), (9, 3, 2), (2, 7, 1)]
    assert block_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]  # the source alone being consecutive is not a run
    assert block_runs([], []) == []


@pytest.mark.parametrize(
    "pairs",
    [
        [(0, 10), (1, 11), (2, 12), (3, 13), (4, 14), (5, 15), (6, 16), (7, 17)],  # one run: copied run by run
        [(7, 0), (2, 1), (5, 2), (0, 3), (9, 4)],  # no runs: gathered and scattered
        [(4, 2), (5, 3), (6, 4), (7, 5), (1, 9), (2, 10), (3, 11), (8, 17)],  # runs and a stray block
    ],
)
def test_each_destination_block_gets_its_source_block_and_nothing_else_changes(pairs):
    src, dst = _blocks(12, 0), _blocks(20, 1)
    before = dst.clone()
    copy_blocks(dst, [d for _, d in pairs], src, [s for s, _ in pairs])
    for s, d in pairs:
        assert torch.equal(dst[d], src[s])
    untouched = sorted(set(range(20)) - {d for _, d in pairs})
    assert torch.equal(dst[untouched], before[untouched])


def test_a_cache_layer_viewed_by_its_block_dimension():
    """The callers' shape: one layer of a cache [2, blocks, bs, Hkv, D] transposed to its block dimension, from pool
    slots [slots, 2, bs, Hkv, D]."""
    pool = _blocks(6, 2)
    cache = torch.zeros(2, 9, 4, 3)
    copy_blocks(cache.transpose(0, 1), [4, 5, 6, 1], pool, [0, 1, 2, 5])
    assert torch.equal(cache[:, 5], pool[1]) and torch.equal(cache[:, 1], pool[5])
    assert not cache[:, [0, 2, 3, 7, 8]].any()


def test_another_dtype_is_converted_block_by_block():
    src = _blocks(5, 3)
    dst = torch.zeros(5, 2, 4, 3, dtype=torch.float64)
    copy_blocks(dst, [3, 4], src, [0, 1])
    assert torch.equal(dst[3], src[0].double()) and torch.equal(dst[4], src[1].double())
    assert not dst[:3].any()


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 source blocks for 3"):
        copy_blocks(torch.zeros(4, 2), [0, 1, 2], torch.zeros(4, 2), [0, 1])
