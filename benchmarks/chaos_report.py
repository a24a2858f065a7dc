"""What benchmarks/chaos.py records of each replay, and what it makes of them: rows per replay and per kind of fault,
the goals, the tables."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise

from rich.console import Console
from rich.table import Table

from benchmarks.benchutil import percentile
from benchmarks.replay import tail_tbt
from mooncake.blocks import blocks_for

GOAL_RECOMPUTED_BLOCKS = 1  # a resumed stream recomputes at most this many blocks
GOAL_GAP_S = 2.0  # the gap between two tokens of a resumed stream, across the failure, under this
GOAL_EXTRA_P99_S = 5.0  # under load: the extra latency p99 of the requests that outlived a kill, under this


@dataclass
class RequestRecord:
    """One request of one replay; times in seconds, ``arrival_s`` after the replay began, token times after arrival."""

    request_id: str
    prompt_tokens: int
    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)  # one per token: when its chunk arrived
    e2e_s: float | None = None  # arrival -> last chunk (or the error)
    finish_reason: str | None = None
    error: str | None = None
    refused: bool = False  # turned away before any work (429 with Retry-After), not a failure after admission
    recovery: dict | None = None  # mooncake.serving.types.Recovery of the last chunk, as a dict

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None

    def max_gap_s(self) -> float | None:
        t = self.token_times_s
        return max((b - a for a, b in pairwise(t)), default=None)

    def within(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        """Served, its first token within ``ttft_slo_s`` and its TBT (the paper's: the mean of the longest 10% of its
        gaps) within ``tbt_slo_s``."""
        t = self.token_times_s
        return self.ok and bool(t) and t[0] <= ttft_slo_s and tail_tbt([b - a for a, b in pairwise(t)]) <= tbt_slo_s


@dataclass
class Replay:
    """Every request once, ``victim`` (None: undisturbed) SIGKILLed once a third of them stream."""

    name: str  # warm-up, baseline, or the victim
    victim: str | None
    wall_s: float = 0.0
    kill_s: float | None = None  # after the replay began
    killed_pid: int | None = None
    streaming_at_kill: int = 0
    back_after_s: float | None = None  # kill -> the launcher's "is back" (READY again)
    registered_after_s: float | None = None  # kill -> the Conductor lists every instance alive
    load_average: float = 0.0  # 1-minute, at the end
    cpu_machine_s: float = 0.0  # CPU time every process of the machine used during the replay
    cpu_cluster_s: float = 0.0  # of which the cluster's components and this process
    decode_ok: dict[str, int | None] = field(
        default_factory=dict
    )  # requests each decode worker finished (a restarted one: since its restart)
    requests: list[RequestRecord] = field(default_factory=list)


@dataclass
class Report:
    command: str
    started_at: str
    machine: dict[str, object]
    model: str
    quick: bool
    git: str  # the commit checked out, "+ changes" when the working tree differs from it
    requests: int
    concurrency: int
    max_tokens: int
    block_size: int
    victims: list[str]
    config: dict[str, object] = field(default_factory=dict)
    load: float | None = None  # --load: the trace open loop at this multiple of the cluster's capacity (None: quiet)
    slo: tuple[float, float] = (0.0, 0.0)  # the cluster's (TTFT, TBT) SLOs, s: what counts toward goodput
    startup_s: float = 0.0
    replays: list[Replay] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # the launcher's, seconds after the cluster started
    code_changed: list[str] = field(default_factory=list)  # files the components import that changed during the run
    total_wall_s: float = 0.0


# -- the numbers -----------------------------------------------------------------------------------


def fault_kinds(rec: RequestRecord) -> list[str]:
    """The kinds of fault ``rec`` outlived (conductor, no_instance, prefill, decode, busy), each once."""
    return sorted({f.split(":", 1)[0] for f in rec.recovery["faults"]}) if rec.recovery else []


def summarize(report: Report) -> tuple[list[dict], list[dict], dict]:
    """Rows per replay, rows per (victim, kind of fault), and the goals."""
    baseline = next(r for r in report.replays if r.name == "baseline")
    base = {r.request_id: r for r in baseline.requests}
    bs = report.block_size
    rows, kind_rows = [], []
    resumed_all: list[RequestRecord] = []
    good_base = sum(r.within(*report.slo) for r in baseline.requests)
    for rep in report.replays:
        if rep.name == "warm-up":
            continue
        ok = [r for r in rep.requests if r.ok]
        refused = [r for r in rep.requests if r.refused]
        good = sum(r.within(*report.slo) for r in rep.requests)
        outlived = [r for r in ok if r.recovery]
        extra = {r.request_id: r.e2e_s - base[r.request_id].e2e_s for r in outlived if base[r.request_id].ok}
        resumed = [r for r in ok if r.recovery and r.recovery["resumes"] > 0]
        resumed_all += resumed
        recomputed = [r.recovery["recomputed_tokens"] for r in resumed]
        gaps = [r.max_gap_s() for r in resumed if r.max_gap_s() is not None]
        differ = [r.request_id for r in ok if base[r.request_id].ok and r.token_ids != base[r.request_id].token_ids]
        rows.append(
            {
                "replay": rep.name,
                "victim": rep.victim,
                "ok": len(ok),
                "refused": len(refused),
                "failed": len(rep.requests) - len(ok) - len(refused),  # after admission: the number that must be 0
                "failed_ids": [r.request_id for r in rep.requests if not r.ok and not r.refused],
                "good": good,  # served within both SLOs
                "goodput_vs_baseline": good / good_base if good_base else None,
                "outlived": len(outlived),
                "faults": dict(Counter(f for r in outlived for f in r.recovery["faults"])),
                "extra_latency_s": extra,
                "extra_p50_s": percentile(list(extra.values()), 50),
                "extra_p99_s": percentile(list(extra.values()), 99),
                "resumed": len(resumed),
                "recomputed_tokens": sum(recomputed),
                "loaded_tokens": sum(r.recovery["loaded_tokens"] for r in resumed),
                "max_recomputed_tokens": max(recomputed, default=None),
                "max_recomputed_blocks": blocks_for(max(recomputed), bs) if recomputed else None,
                "gap_p50_s": percentile(gaps, 50),
                "gap_max_s": max(gaps, default=None),
                "differ_from_baseline": differ,
                "e2e_p50_s": percentile([r.e2e_s for r in ok], 50),
                "wall_s": rep.wall_s,
                "kill_s": rep.kill_s,
                "streaming_at_kill": rep.streaming_at_kill,
                "back_after_s": rep.back_after_s,
                "registered_after_s": rep.registered_after_s,
                "decode_ok": rep.decode_ok,
                "load_average": rep.load_average,
                "cpu_machine_s": rep.cpu_machine_s,
                "cpu_others_s": rep.cpu_machine_s - rep.cpu_cluster_s,
            }
        )
        for kind in sorted({k for r in outlived for k in fault_kinds(r)}):
            got = [extra[r.request_id] for r in outlived if kind in fault_kinds(r) and r.request_id in extra]
            instances = sorted(
                {f.split(":", 1)[1] for r in outlived for f in r.recovery["faults"] if f.startswith(f"{kind}:")}
            )
            kind_rows.append(
                {
                    "victim": rep.victim,
                    "kind": kind,
                    "instances": instances,
                    "requests": len(got),
                    "extra_p50_s": percentile(got, 50),
                    "extra_p99_s": percentile(got, 99),
                }
            )
    recomputed = [r.recovery["recomputed_tokens"] for r in resumed_all]
    gaps = [g for r in resumed_all if (g := r.max_gap_s()) is not None]
    warm = next((r for r in report.replays if r.name == "warm-up"), None)
    unstable = (
        [
            r.request_id
            for r in warm.requests
            if r.ok and base[r.request_id].ok and r.token_ids != base[r.request_id].token_ids
        ]
        if warm
        else None
    )
    goals = {
        "resumed_streams": len(resumed_all),
        "max_recomputed_tokens": max(recomputed, default=None),
        "recompute_goal_tokens": GOAL_RECOMPUTED_BLOCKS * bs,
        "recompute_met": (max(recomputed) <= GOAL_RECOMPUTED_BLOCKS * bs) if recomputed else None,
        "max_gap_s": max(gaps, default=None),
        "gap_goal_s": GOAL_GAP_S,
        "gap_met": (max(gaps) < GOAL_GAP_S) if gaps else None,
        "warmup_differs_from_baseline": unstable,
    }
    killed = [r for r in rows if r["victim"]]
    if report.load is not None and killed:
        p99 = [r["extra_p99_s"] for r in killed if r["extra_p99_s"] is not None]
        goals |= {
            "failed_after_admission": sum(r["failed"] for r in killed),
            "differ_from_baseline": sum(len(r["differ_from_baseline"]) for r in killed),
            "max_extra_p99_s": max(p99, default=None),
            "extra_goal_s": GOAL_EXTRA_P99_S,
        }
    return rows, kind_rows, goals


def render(report: Report, rows: list[dict], kind_rows: list[dict], goals: dict, console: Console) -> None:
    m = report.machine

    def s(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}"

    load = report.load is not None
    how = (
        f"the trace open loop at x{report.load:g} of the cluster's capacity, SLOs TTFT {report.slo[0]:g} s / TBT "
        f"{report.slo[1]:g} s"
        if load
        else f"{report.concurrency} at a time, {report.max_tokens} output tokens"
    )
    table = Table(
        title=f"Chaos: components SIGKILLed once a third of {report.requests} requests stream; {report.model}, {how}, "
        f"block size {report.block_size}, {m['cpu_model']} ({m['logical_cores']} cores)",
        caption="failed: after admission (refused: 429 before any work, apart); good: served within both SLOs "
        "(x the baseline's); extra = e2e latency minus the same request's in the baseline (requests that "
        "outlived a fault), s; "
        "recomputed / loaded: resumed streams' tokens computed again / loaded from the pool; gap: the "
        "largest gap between two tokens of a resumed stream, s; back / registered: kill -> the victim "
        "READY again / the Conductor lists every instance alive, s; e2e p50 over all requests of the "
        "replay, s; others' CPU: CPU s other processes of the machine used during the replay / CPU s "
        "used by all",
    )
    for col in (
        "victim",
        "ok",
        *(("refused",) if load else ()),
        "failed",
        *(("good",) if load else ()),
        "outlived",
        "extra p50",
        "extra p99",
        "resumed",
        "recomputed / loaded",
        "max recomputed",
        "gap p50",
        "gap max",
        "= baseline",
        "back / registered",
        "e2e p50",
        "others' CPU",
    ):
        table.add_column(col, justify="left" if col == "victim" else "right")
    for r in rows:
        same = "" if r["victim"] is None else (f"{r['ok'] - len(r['differ_from_baseline'])}/{r['ok']}")
        most = (
            ""
            if r["max_recomputed_tokens"] is None
            else f"{r['max_recomputed_tokens']} ({r['max_recomputed_blocks']} blk)"
        )
        rl = f"{r['recomputed_tokens']} / {r['loaded_tokens']}" if r["resumed"] else ""
        back = f"{s(r['back_after_s'])} / {s(r['registered_after_s'])}" if r["back_after_s"] is not None else ""
        failed = f"[red]{r['failed']}[/]" if r["failed"] else "0"
        ratio = "" if r["victim"] is None or r["goodput_vs_baseline"] is None else f" ({r['goodput_vs_baseline']:.2f}x)"
        table.add_row(
            r["victim"] or "baseline",
            str(r["ok"]),
            *((str(r["refused"]),) if load else ()),
            failed,
            *((f"{r['good']}{ratio}",) if load else ()),
            str(r["outlived"]) if r["victim"] else "",
            s(r["extra_p50_s"]),
            s(r["extra_p99_s"]),
            str(r["resumed"]) if r["victim"] else "",
            rl,
            most,
            s(r["gap_p50_s"]),
            s(r["gap_max_s"]),
            same,
            back,
            s(r["e2e_p50_s"]),
            f"{r['cpu_others_s']:.0f} / {r['cpu_machine_s']:.0f}",
        )
    console.print(table)
    if kind_rows:
        kinds = Table(title="Extra latency by kind of fault outlived (s; a request outliving two kinds counts in both)")
        for col in ("victim", "fault", "failed instance", "requests", "extra p50", "extra p99"):
            kinds.add_column(col, justify="left" if col in ("victim", "fault", "failed instance") else "right")
        for k in kind_rows:
            kinds.add_row(
                k["victim"],
                k["kind"],
                ", ".join(k["instances"]),
                str(k["requests"]),
                s(k["extra_p50_s"]),
                s(k["extra_p99_s"]),
            )
        console.print(kinds)

    def mark(met: bool | None) -> str:
        return (
            "[yellow]not measured[/] (no resumed stream)"
            if met is None
            else ("[green]PASS[/]" if met else "[red]FAIL[/]")
        )

    n = goals["resumed_streams"]
    most = goals["max_recomputed_tokens"]
    console.print(
        f"goal: a resumed stream recomputes at most {GOAL_RECOMPUTED_BLOCKS} block "
        f"({goals['recompute_goal_tokens']} tokens): "
        + (
            f"at most {most} tokens ({blocks_for(most, report.block_size)} block(s)) over {n} resumed streams "
            if n
            else ""
        )
        + mark(goals["recompute_met"])
    )
    console.print(
        f"goal: gap across the failure < {GOAL_GAP_S:g} s: "
        + (f"largest {goals['max_gap_s']:.2f} s over {n} resumed streams " if n else "")
        + mark(goals["gap_met"])
    )
    if "failed_after_admission" in goals:
        p99 = goals["max_extra_p99_s"]
        console.print(
            f"goal: 0 failed after admission: {goals['failed_after_admission']} "
            + mark(goals["failed_after_admission"] == 0)
        )
        console.print(
            f"goal: every completed output equals the baseline's: {goals['differ_from_baseline']} differ "
            + mark(goals["differ_from_baseline"] == 0)
        )
        console.print(
            f"goal: survivors' extra latency p99 < {GOAL_EXTRA_P99_S:g} s: "
            + ("none outlived a fault " if p99 is None else f"at most {p99:.2f} s ")
            + mark(None if p99 is None else p99 < GOAL_EXTRA_P99_S)
        )
    if goals["warmup_differs_from_baseline"]:
        console.print(
            f"[yellow]note[/]: the two undisturbed replays differ on {len(goals['warmup_differs_from_baseline'])} "
            f"requests ({', '.join(goals['warmup_differs_from_baseline'][:8])}): outputs are not "
            "stable even without faults"
        )
    if report.code_changed:
        console.print(
            f"[red]warning[/]: {len(report.code_changed)} files the components import changed during the run "
            f"({', '.join(report.code_changed[:10])}): a component restarted after that runs other code"
        )
    for r in rows:
        if r["failed_ids"] or r["differ_from_baseline"]:
            console.print(
                f"[red]{r['replay']}[/]: failed {r['failed_ids']}, outputs differing from the baseline "
                f"{r['differ_from_baseline']}"
            )
    console.print(
        f"code {report.git}; cluster start-up (not counted) {report.startup_s:.1f} s; load average "
        f"{m['load_average'][0]:.2f}; total wall {report.total_wall_s:.0f} s"
    )
