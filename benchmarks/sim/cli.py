"""Cluster simulator: the Mooncake trace replayed on simulated prefill and decode instances, placed by the real
Conductor.

    python -m benchmarks.sim --trace PATH --prefill N --decode M --policy P --admission A --speed S
                             [--cache-blocks C --eviction lru|lfu|length] [--ssd-blocks B] [--tier-aware]
                             [--limit N] [--ttft-slo S] [--tbt-slo S] [--threshold X] [--seed N]
                             [--heartbeat-s S] [--no-calibrate] [--step-budget T] [--json PATH] [--plot PATH]
                             [--no-progress]
    python -m benchmarks.sim --reproduce [--json PATH] [--plot PATH]    the paper's three experiments

Every scheduling decision is made by ``conductor.core.Conductor`` (the same object the gRPC
service wraps), with its policies, admission, predictors and KV index; the simulator only
supplies time, the cost of work, and the reports a real cluster would send back
(conductor/planner/twin.py). The cost models are in conductor/planner/costs.py, the trace in benchmarks/sim/model.py.

Model and assumptions (sources in conductor/planner/costs.py, ModelConfig):

- Trace: Mooncake's conversation trace (benchmarks/traces/README.md). ``hash_ids`` name 512-token
  blocks and are already prefix-chained, so the key of id h is blake2b(h, 16 bytes); only
  the prompt's full blocks (input_length // 512, at most len(hash_ids)) get keys. Arrival
  times are divided by ``--speed``. Outputs of 0 tokens count as 1.
- Model: LLaMA3-70B-shaped (80 layers, hidden 8192, GQA with 8 KV heads: 320 KiB of KV per
  token, so one 512-token block is 160 MiB), on nodes of 8 x A800 (312 TFLOPS fp16, 2.04
  TB/s HBM, 80 GB each); one node is one instance.
- Prefill (compute-bound): a + b*n + k*n*(c + n/2) for n new tokens after c cached, with
  b = 2 * 70.6e9 / (8 * 312e12 * 0.4) = 0.141 ms per token and k the attention FLOPs at
  the same 40% MFU (2.6 ns per token pair); a = 20 ms. One request at a time, FIFO: the
  paper's chunked pipeline parallelism across nodes is abstracted as one server per instance.
- Decode (memory-bound): 141 GB of weights over 8 x 2.04 TB/s at 70% efficiency (12.4 ms a
  step), plus 0.1 ms per running request, plus each context token's 320 KiB at the same
  bandwidth (28.7 ns). ``--decode-profile slow`` (a decode-bound cluster, our assumption):
  30% of HBM bandwidth (28.9 ms a step) and 1 ms per running request. Continuous batching:
  a request joins at the next step boundary, first come first served, once its KV fits (it
  reserves prompt + output tokens of the 1.37M-token KV space) and the step it makes stays
  under ``--tbt-headroom`` x the TBT SLO (the decode worker's own cap, from its true step
  cost); until then it waits. It makes one token per step and leaves after its output
  length. TTFT = arrival -> end of its first decode step; TBT = mean of the longest 10% of
  its token gaps (the paper's).
- Transfers: 100 GB/s between nodes (8 x 200 Gbps RDMA is 200 GB/s of line rate; we take
  half) + 0.1 ms. The prompt's KV streams to decode layer by layer during prefill, so only
  the last layer's share (1/80) is left to send when prefill ends. Transfers do not
  contend for links (not modelled).
- Caches: each prefill node's DRAM (``--cache-blocks`` blocks, default unbounded) and an
  optional SSD (``--ssd-blocks``, 5 GB/s) with the kvstore's eviction policies; after a
  prefill every block of the prompt is stored on the node (fetched ones too: keep_fetched).
- Admission: the Conductor's own (none, baseline, early, early_predictive). Under the
  baseline the decode side checks the request when its prefill ends
  (``Conductor.admit_at_decode``) and turns it away if it would break the TBT SLO (the
  prefill is wasted); under early rejection the decode side takes what it is sent, and
  what the prediction got wrong waits for room (longer TTFT).
- The Conductor learns: its predictors start from their defaults (PredictorConfig) and are
  fed the simulated measurements, never the cost models' constants: first each prefill
  instance's calibration (a real worker's three timed made-up prompts as it starts, 1/8,
  1/2 and 1 step budget long: for a node alone ``--step-budget``, 4,096 tokens as a GPU
  worker's, so 512, 2,048 and 4,096; for a pipeline group its chunk; ``--no-calibrate``:
  none), then every prefill as it ends.
- Heartbeats: a prefill instance reports its queue every ``--heartbeat-s`` (2.5 s, a real
  worker's period; every 0.5 s while it holds prompts, and as each prefill ends, as a real
  worker does), and the Conductor drains it a second each second in between
  (``Instance.drain``); ``--heartbeat-s 0`` reports it on every change (fresher than real).
- TTFT predictions: as benchmarks/replay.py scores a real cluster's (``prediction_errors``):
  (predicted - measured) / measured over the served requests, at p10 / p50 / p90, and the
  share within 25%; measured = the TTFT above, predicted = the Conductor's at the decision.
- Hit ratio = reused blocks (own node + fetched) / key blocks, over the requests prefilled.
- SLO attainment = requests served with TTFT and TBT both under the SLO / all requests
  (rejected ones count as misses); "of served" divides by the served ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from benchmarks.replay import rate_profile
from benchmarks.sim.autoscale import AUTOSCALERS
from benchmarks.sim.run import (
    DEFAULT_TRACE,
    EVICTIONS,
    config_json,
    plot_run,
    public,
    records_json,
    run_table,
    simulate,
)
from conductor.admission import AdmissionKind
from conductor.forecast import ForecastKind
from conductor.local import LocalPrefill
from conductor.planner.costs import DECODE_PROFILES, model_config
from conductor.planner.state import HEARTBEAT_S, STEP_BUDGET_TOKENS, SimConfig
from conductor.policies import PolicyKind
from conductor.predictors import PredictorConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sim",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay the Mooncake trace on a simulated cluster whose every placement and admission "
        "decision is made by the real Conductor (conductor.core). Models and assumptions: "
        "the module docstring of benchmarks/sim/cli.py and benchmarks/README.md.",
        epilog="Model (every constant and its source: conductor/planner/costs.py, ModelConfig; benchmarks/README.md):\n"
        "  LLaMA3-70B-shaped model, 320 KiB of KV a token (a 512-token block is 160 MiB), one node of\n"
        "  8 x A800 per instance. Prefill: 20 ms + 0.141 ms a new token + attention (40% MFU), one\n"
        "  request at a time, FIFO. Decode: continuous batching, 12.4 ms + 0.1 ms a request + 28.7 ns\n"
        "  a context token per step. RDMA 100 GB/s, SSD 5 GB/s. TTFT = arrival to the end of the\n"
        "  first decode step; TBT = mean of a request's longest 10% of token gaps; a request is\n"
        "  effective when both are under their SLOs. Hit ratio = reused / key blocks.\n\n"
        "Examples:\n"
        "  python -m benchmarks.sim --prefill 8 --decode 8 --policy kvcache_centric --admission none --speed 1.5\n"
        "  python -m benchmarks.sim --prefill 8 --decode 8 --admission early_predictive --speed 2 --tbt-slo 0.04\n"
        "  python -m benchmarks.sim --cache-blocks 1000 --eviction length --limit 3000\n"
        "  python -m benchmarks.sim --reproduce --json benchmarks/results/sim_paper.json --plot "
        "benchmarks/results/sim_paper.png",
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file (JSON lines; default: %(default)s)")
    p.add_argument("--prefill", type=int, default=8, help="prefill nodes, each with its own pool node (default 8)")
    p.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="prefill nodes per chunked-pipeline group, one prefill instance each (default 1: every node alone)",
    )
    p.add_argument(
        "--pipeline-groups",
        type=int,
        default=None,
        help="with --group-size: this many groups, the other prefill nodes alone (default: every node in one)",
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=2048, help="a pipeline group's chunk of a prompt, tokens (default 2048)"
    )
    p.add_argument("--decode", type=int, default=8, help="decode instances (default 8)")
    p.add_argument(
        "--policy",
        default="kvcache_centric",
        choices=[k.value for k in PolicyKind],
        help="prefill placement (default kvcache_centric)",
    )
    p.add_argument(
        "--admission",
        default="none",
        choices=[k.value for k in AdmissionKind],
        help="none: never reject; baseline: TTFT check at schedule, TBT check after prefill (wasted); "
        "early: current loads; early_predictive: decode load predicted at prefill end (default none)",
    )
    p.add_argument(
        "--speed", type=float, default=1.0, help="replay speed: inter-arrival times are divided by it (default 1)"
    )
    p.add_argument(
        "--rate-profile",
        type=rate_profile,
        default=None,
        metavar="PROFILE",
        help="a rate that moves (benchmarks.rate_profile): step:1,3,1 or day:1,4 (over the run, on top of --speed)",
    )
    p.add_argument(
        "--autoscale",
        choices=AUTOSCALERS,
        default="none",
        help="who sizes the pools as the run goes (benchmarks.sim.autoscale): the Conductor's planner, the "
        "queue-length baseline (an HPA's rule), or none (--prefill and --decode throughout); instances start "
        "--start-s after they are asked for",
    )
    p.add_argument("--start-s", type=float, default=60.0, help="with --autoscale: seconds an instance takes to start")
    p.add_argument(
        "--cache-blocks",
        type=int,
        default=None,
        help="DRAM blocks (160 MiB each) per prefill node (default: unbounded)",
    )
    p.add_argument(
        "--eviction", default="lru", choices=EVICTIONS, help="eviction policy of every node's tiers (default lru)"
    )
    p.add_argument("--ssd-blocks", type=int, default=0, help="SSD blocks per prefill node (default 0: no SSD tier)")
    p.add_argument(
        "--tier-aware",
        action="store_true",
        help="PolicyConfig(tier_aware=True): price SSD prefix blocks by their load time",
    )
    p.add_argument(
        "--threshold", type=float, default=1.5, help="kvcache_balancing_threshold of kvcache_centric (default 1.5)"
    )
    p.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT SLO in seconds (default 30)")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO in seconds (default 0.1)")
    p.add_argument(
        "--decode-profile",
        default="roofline",
        choices=list(DECODE_PROFILES),
        help="decode cost model: roofline (70%% of HBM bandwidth, 0.1 ms a request a step) or slow "
        "(30%%, 1 ms: a decode-bound cluster) (default roofline)",
    )
    p.add_argument(
        "--tbt-headroom",
        type=float,
        default=0.9,
        help="the Conductor and every decode instance hold the predicted mean step under this share of "
        "the TBT SLO, since the SLO is on a request's slowest 10%% of gaps (default 0.9)",
    )
    p.add_argument(
        "--decode-forecast",
        default="survival",
        choices=[k.value for k in ForecastKind],
        help="early_predictive's decode forecast: survival (ours, the Conductor's default: measured "
        "durations by how long each request has run, and the joins to come) or uniform (the paper's: "
        "every decode lasts t_d) (default survival)",
    )
    p.add_argument(
        "--local-prefill",
        default="never",
        choices=[m.value for m in LocalPrefill],
        help="where prompts are computed: a prefill instance (never, default), the decode instance itself (always), "
        "or whichever the Conductor predicts sooner within the TBT SLO (auto; conductor.local)",
    )
    p.add_argument(
        "--local-chunk",
        type=int,
        default=STEP_BUDGET_TOKENS,
        help="a decode instance's step budget: the chunk of a prompt it computes itself "
        f"(default {STEP_BUDGET_TOKENS})",
    )
    p.add_argument(
        "--local-max-load",
        type=float,
        default=SimConfig.local_max_load,
        help="auto: a decode instance computes prompts only while its predicted step is at most this share of the "
        f"TBT limit (default {SimConfig.local_max_load})",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.05,
        help="log-normal sigma on prefill and decode step times (default 0.05; 0: exact)",
    )
    p.add_argument(
        "--decode-prior-s",
        type=float,
        default=None,
        help="the Conductor's decode step prior before it has measurements (PredictorConfig.decode_base_s; "
        "default: the Conductor's own, 0.02). Keep it under the TBT SLO: a prior over the SLO "
        "rejects every request and never learns",
    )
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=HEARTBEAT_S,
        help="a prefill instance reports its queue to the Conductor this often, as a real worker does "
        "(default %(default)s: the Conductor's 10 s heartbeat timeout x 0.25; every 0.5 s while it holds prompts, "
        "and as each prefill ends); 0: on every change of its queue (fresher than a real worker)",
    )
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="no calibration samples at start (a real prefill worker's --no-calibrate); by default each prefill "
        "instance sends the compute time of prompts of 1/8, 1/2 and 1 step budget (a pipeline group's: "
        "its chunk) before the first request",
    )
    p.add_argument(
        "--step-budget",
        type=int,
        default=STEP_BUDGET_TOKENS,
        help="a prefill node's step budget in tokens (a worker's --max-num-batched-tokens); only its calibration "
        "prompts follow it, since the cost model computes a prompt in one go (default %(default)s: a "
        "worker's on a GPU)",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy and of the noise (default 0)")
    p.add_argument("--json", type=Path, default=None, help="write every raw number (and the command) here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG here (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--jobs", type=int, default=1, help="--reproduce: simulations run at once, one process each (default 1)"
    )
    p.add_argument(
        "--reproduce",
        action="store_true",
        help="run the paper's three experiments (placement policies, admission at 2x, hit ratio by "
        "capacity) plus the tier-aware variant, and print them beside the paper's numbers "
        "(benchmarks/sim/paper.py); --trace, --json, --plot, --limit, --noise, --seed, --heartbeat-s, "
        "--no-calibrate, --step-budget, --jobs and --no-progress apply",
    )
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        prefill=args.prefill,
        decode=args.decode,
        group_size=args.group_size,
        pipeline_groups=args.pipeline_groups,
        prefill_chunk=args.prefill_chunk,
        policy=PolicyKind(args.policy),
        admission=AdmissionKind(args.admission),
        cache_blocks=args.cache_blocks,
        ssd_blocks=args.ssd_blocks,
        eviction=args.eviction,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        threshold=args.threshold,
        tier_aware=args.tier_aware,
        seed=args.seed,
        start_s=args.start_s,
        tbt_headroom=args.tbt_headroom,
        decode_forecast=ForecastKind(args.decode_forecast),
        heartbeat_s=args.heartbeat_s,
        calibrate=not args.no_calibrate,
        step_budget=args.step_budget,
        local_prefill=LocalPrefill(args.local_prefill),
        local_chunk=args.local_chunk,
        local_max_load=args.local_max_load,
        model=model_config(args.decode_profile, noise=args.noise),
        predictors=PredictorConfig()
        if args.decode_prior_s is None
        else PredictorConfig(decode_base_s=args.decode_prior_s),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for the tables
        console = Console(width=160)
    if args.reproduce:
        from benchmarks.sim import paper

        return paper.reproduce(args, console)
    try:
        cfg = config_from_args(args)
        cfg.validate()
    except ValueError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    summary = simulate(
        cfg,
        args.trace,
        args.speed,
        args.limit,
        progress=not args.no_progress,
        console=console,
        profile=args.rate_profile,
        autoscale=args.autoscale,
    )
    console.print(run_table(summary, cfg))
    if args.json:
        out = {
            "command": ["python", "-m", "benchmarks.sim", *(sys.argv[1:] if argv is None else argv)],
            "speed": args.speed,
            "limit": args.limit,
            "trace": str(args.trace),
            "config": config_json(cfg),
            "summary": public(summary),
            "records": records_json(summary["_records"]),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        console.print(f"JSON written to {args.json}")
    if args.plot:
        plot_run(summary, cfg, args.plot, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
