"""Prefill and decode workers at different tensor-parallel sizes (issue 64), on a real cluster: every component its
own process, each worker's ranks processes of their own (gloo on the CPU).

A prompt prefilled by two ranks is decoded by one, and one prefilled by one rank is decoded by two: the greedy tokens
equal one engine alone's, cold and again with the prompt's prefix read back from the pool (written at the prefill's
size, read at the same size, imported at the other by heads). The pool keeps every KV head of a block whatever the
sizes (DESIGN §4), so no conversion happens anywhere: a rank reads its heads of what the pool holds.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from clusters import backend, generate, instances, reference_tokens, start_cluster, tokens, vllm_served_as_alone
from replays import replay, undisturbed_run, wait_idle, wait_restarted
from tp_ranks import rank_processes
from typer.testing import CliRunner

from mooncake.cli.main import app
from mooncake.cli.pool_cmd import _plan_line
from mooncake.cluster.launcher import LocalCluster
from mooncake.engine.tiny import make_tiny
from protos import conductor_pb2 as cpb

REQUESTS = 24  # the chaos replay's: a third streaming when a rank is killed (tests/replays.py runs 60)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("model") / "llama", "llama")


def served_cold_and_warm(model, cluster, name: str) -> None:
    rng = random.Random(len(name))
    prompt = [rng.randrange(10, 440) for _ in range(70)]
    reference = reference_tokens(model, prompt, 12)
    be = backend(cluster)
    cold = generate(be, f"{name}-cold", prompt, 12, temperature=0.0, ignore_eos=True)
    assert tokens(cold) == reference and cold[-1].cached_tokens == 0
    deadline = time.monotonic() + 10  # the prompt's blocks reach the pool after the answer (a background write)
    for attempt in range(100):
        warm = generate(be, f"{name}-warm-{attempt}", prompt, 12, temperature=0.0, ignore_eos=True)
        assert tokens(warm) == reference
        if warm[-1].cached_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert warm[-1].cached_tokens == 64  # four whole blocks of 16 from the pool


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_a_prompt_prefilled_at_one_size_and_decoded_at_another_gives_one_engines_tokens(
    model, tmp_path, prefill_tp, decode_tp
):
    cluster = start_cluster(model, tmp_path, prefill_tp=prefill_tp, decode_tp=decode_tp, gateway=False, threads=1)
    try:
        served_cold_and_warm(model, cluster, f"p{prefill_tp}d{decode_tp}")
        sizes = {name: i.tensor_parallel_size for name, i in instances(cluster).items() if i.engine}  # the workers
        assert sizes == {"prefill-0": prefill_tp, "decode-0": decode_tp}
        argv = [sys.executable, "-m", "mooncake.cli.main", "status", "--conductor", cluster.conductor_address]
        status = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=os.environ | {"COLUMNS": "300"})
        assert status.returncode == 0, status.stderr
        (split,) = [line for line in status.stdout.splitlines() if "TP 2" in line]  # the worker at two ranks only
        assert ("prefill-0" if prefill_tp == 2 else "decode-0") in split
    finally:
        cluster.stop()


@pytest.mark.vllm
def test_vllm_workers_split_over_two_ranks_give_vllm_alones_tokens_cold_and_from_the_pool(tmp_path):
    """Stock vLLM at tensor-parallel size 2 in both workers (its own rank processes; the KV crosses to the worker
    through the shared copy, vllm_engine/shared_kv.py): prompt to pool to decode, and a prefix read back from the pool,
    give vLLM alone's greedy tokens at two ranks (no connector, no cluster: tests/vllm_alone.py)."""
    pytest.importorskip("vllm", reason="vLLM is installed by `make test` (the project's vllm extra)")
    # vLLM's CPU attention wants head size 64 or more; 4 query heads over 2 KV heads split into 2 ranks of 1
    model = make_tiny(
        tmp_path / "model", "llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=256, head_dim=64
    )
    prompts = [[(7 * i + 3) % 440 + 5 for i in range(n)] for n in (7, 70, 300)]  # 70's 64 tokens lead 300's
    cluster = vllm_served_as_alone(
        tmp_path / "run", model, prompts, {"tensor_parallel_size": 2}, prefill_tp=2, decode_tp=2
    )
    try:
        assert {name: i.tensor_parallel_size for name, i in instances(cluster).items() if i.engine} == {
            "prefill-0": 2,
            "decode-0": 2,
        }
    finally:
        cluster.stop()


def kill_a_rank(cluster, victim: str) -> None:
    """SIGKILL one of ``victim``'s tensor-parallel ranks (not rank 0: the worker's own process)."""
    (rank,) = rank_processes(cluster.component(victim).proc.pid)
    os.kill(rank, signal.SIGKILL)


def test_a_decode_workers_rank_killed_mid_run_loses_no_request_and_changes_no_token(tiny_dir, tmp_path):
    """The chaos replay (tests/replays.py: 24 streamed greedy requests, 6 at a time) on two decode workers of two
    ranks each: one rank of decode-0 killed while it streams. Its worker goes down whole (RANK_LOST_EXIT), its streams
    resume on decode-1 with the tokens of the undisturbed run, and the launcher restarts it."""
    cluster = start_cluster(
        tiny_dir, tmp_path, decode=2, decode_tp=2, max_model_len=512, hold_s=30.0, gateway=False, threads=1
    )
    try:
        expected, idle = undisturbed_run(cluster, count=REQUESTS)
        outputs, errors, recoveries = replay(cluster, "decode-0", strike=kill_a_rank, count=REQUESTS)
        assert errors == {}, f"{len(errors)} requests failed after a rank of decode-0 was killed"
        assert outputs == expected
        assert any(r.resumes for r in recoveries), recoveries  # it struck mid-stream: streams resumed elsewhere
        wait_restarted(cluster, "decode-0")
        log = (cluster.run_dir / "logs" / "decode-0.log").read_text()
        assert "a tensor-parallel rank is gone" in log
        assert wait_idle(cluster, idle, 40) == idle
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (
            ["--prefill-tp", "3", "--engine", "vllm", "--block-size", "32"],
            "--prefill-tp 3: Total number of attention heads (4) must be divisible by tensor parallel size (3)",
        ),
        (["--prefill-tp", "2", "--prefill-groups", "1"], "--prefill-tp above 1 and pipelined prefill groups"),
        (["--decode-tp", "0"], "--decode-tp"),
        (["--decode-tp", "3"], "--decode-tp 3: the attention heads (4) cannot be split evenly among 3 tensor-parallel"),
    ],
)
def test_mooncake_up_refuses_ranks_it_cannot_start_in_one_line(tiny_dir, flags, why, monkeypatch):
    """In this process (the console script's app), with a cluster's start failing the test: each refusal comes
    before anything starts, in one line, status 2."""

    def started(self):
        raise AssertionError(f"mooncake up {flags} started the cluster")

    monkeypatch.setattr(LocalCluster, "start", started)
    done = CliRunner().invoke(app, ["up", "--model", str(tiny_dir), *flags], env={"COLUMNS": "400"})
    assert done.exit_code == 2 and why in done.stderr, done.stderr
    assert isinstance(done.exception, SystemExit), done.exception  # no traceback: a line and the status


@pytest.mark.parametrize(
    ("flags", "size"),
    [
        ([], 1),
        (["--tensor-parallel-size", "2"], 2),
        (["--engine", "vllm", "--vllm-arg", "tensor_parallel_size=2"], 2),  # vLLM's own keyword: the same size
        (["--vllm-arg", "tensor_parallel_size=2"], 1),  # (our engine reads no vLLM keyword)
    ],
)
def test_a_worker_runs_and_registers_the_size_its_flags_give(flags, size):
    from mooncake.cluster.components import component_parser
    from mooncake.serving.worker_args import engine_fields

    args = component_parser("decode").parse_args(["--model", "m", "--conductor", "127.0.0.1:1", *flags])
    assert engine_fields(args)["tensor_parallel_size"] == size


def test_the_console_script_refuses_in_one_line_with_status_2(tiny_dir):
    argv = [sys.executable, "-m", "mooncake.cli.main", "up", "--model", str(tiny_dir), "--decode-tp", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--decode-tp 3: the attention heads (4)" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_status_line_counts_a_plans_devices_at_the_pools_sizes():
    plan = cpb.PlanResponse(prefill=2, decode=3, forecast_rate=1.5)
    split = [
        cpb.InstanceInfo(id="p", role=cpb.PREFILL, tensor_parallel_size=2),
        cpb.InstanceInfo(id="d", role=cpb.DECODE),
    ]
    assert "2 prefill, 3 decode (7 devices at their TP sizes) for 1.50 req/s" in _plan_line(plan, split)
    whole = [cpb.InstanceInfo(id="p", role=cpb.PREFILL, tensor_parallel_size=1)]
    assert "devices" not in _plan_line(plan, whole)  # one device each: the counts say it
