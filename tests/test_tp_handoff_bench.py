"""benchmarks/tp_handoff_bench.py on a small hand-off: each rank's slices put its heads where the destination's layout
says (the run reads every byte back and fails on a wrong one), and a rank moves 1/TP of the bytes."""

from __future__ import annotations

import json

import pytest

from benchmarks import tp_handoff_bench


def test_each_rank_lands_its_heads_in_either_layout_and_moves_a_tp_th_of_the_bytes(tmp_path):
    out = tmp_path / "handoff.json"
    argv = ["--backend", "shm", "--tp", "1,2", "--blocks", "3", "--layers", "2", "--kv-heads", "4"]
    assert tp_handoff_bench.main([*argv, "--head-dim", "8", "--repeat", "1", "--json", str(out)]) == 0
    rows = {(r["layout"], r["tp"]): r for r in json.loads(out.read_text())["rows"]}
    total = 3 * 2 * 2 * 16 * 4 * 8 * 2  # blocks x layers x (K, V) x tokens x heads x head dim x 2 bytes
    for (layout, tp), row in rows.items():
        assert row["bytes_total"] == total
        assert [r["bytes"] for r in row["ranks"]] == [total // tp] * tp, (layout, tp)
    # a layer of a block is one run at TP 1; at TP N the pool layout cuts a rank's heads into a run per K or V and
    # token, the head-major one keeps them one run
    assert [r["slices"] for r in rows["pool", 2]["ranks"]] == [3 * 2 * 2 * 16] * 2
    assert [r["slices"] for r in rows["headmajor", 2]["ranks"]] == [3 * 2] * 2
    assert rows["pool", 1]["ranks"][0]["slices"] == 3 * 2


def test_sizes_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(SystemExit) as e:
        tp_handoff_bench.parse_args(["--tp", "1,3", "--kv-heads", "8"])
    assert e.value.code == 2
