"""One default per setting: the SLO a cluster starts with is conductor.types.DEFAULT_SLO wherever it is started, and
`mooncake up`'s options take their defaults from ClusterConfig, the workers' engines from EngineConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from conductor.__main__ import parse_args as conductor_args
from conductor.config import ConductorConfig
from conductor.types import DEFAULT_SLO
from decode.config import DecodeConfig
from mooncake.cli.main import app
from mooncake.cluster.config import ClusterConfig
from mooncake.engine.config import EngineConfig
from prefill.config import PrefillConfig

CHART_VALUES = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "mooncake" / "values.yaml"


def test_the_default_slo_is_the_same_for_the_conductor_mooncake_up_and_the_chart():
    args = conductor_args([])
    assert (args.ttft_slo, args.tbt_slo) == (DEFAULT_SLO.ttft_s, DEFAULT_SLO.tbt_s)
    config = ClusterConfig(model="m", model_name="m")
    assert (config.ttft_slo_s, config.tbt_slo_s) == (DEFAULT_SLO.ttft_s, DEFAULT_SLO.tbt_s)
    assert ConductorConfig().slo_classes == {"default": DEFAULT_SLO}
    slo = yaml.safe_load(CHART_VALUES.read_text())["slo"]
    assert (slo["ttftSeconds"], slo["tbtSeconds"]) == (DEFAULT_SLO.ttft_s, DEFAULT_SLO.tbt_s)


def test_mooncake_up_shows_clusterconfigs_defaults_and_help():
    out = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "400"}).output
    for field, flag in (("tbt_slo_s", "--tbt-slo"), ("pool_dram_mib", "--pool-dram-mib"), ("hold_s", "--hold")):
        info = ClusterConfig.model_fields[field]
        line = next(line for line in out.splitlines() if f" {flag} " in line)
        assert info.description in line and f"[default: {info.default}]" in line, line


def test_a_workers_engine_is_an_engineconfig_with_the_workers_defaults():
    prefill = PrefillConfig(model="m", kvstore="k:1", block_size=32)
    assert isinstance(prefill.engine_config, EngineConfig)
    assert (prefill.engine_config.block_size, prefill.engine_config.max_num_seqs) == (32, 8)
    assert not prefill.engine_config.enable_prefix_caching and not prefill.engine_config.decode_graphs
    assert prefill.engine_config.max_num_batched_tokens == 512  # resolved for the CPU, once, by EngineConfig
    decode = DecodeConfig(model="m", engine_config={"model": "m", "max_num_seqs": 4})
    engine = decode.engine_config
    assert (engine.max_num_seqs, engine.num_kv_blocks, engine.kv_cache_memory_gib) == (4, None, 2.0)  # from memory


def test_a_workers_flags_are_read_off_its_config():
    from decode.config import DECODE_ENGINE_DEFAULTS
    from decode.server import parse_args as decode_args
    from prefill.config import PREFILL_ENGINE_DEFAULTS
    from prefill.server import parse_args as prefill_args

    d = decode_args(["--model", "m"])
    assert (d.detect_s, d.tbt_slo, d.shm_dir) == tuple(
        DecodeConfig.model_fields[f].default for f in ("detect_s", "tbt_slo_s", "shm_dir")
    )
    assert (d.max_num_seqs, d.num_kv_blocks, d.kv_cache_memory_gib) == (
        DECODE_ENGINE_DEFAULTS["max_num_seqs"],
        None,
        2.0,
    )
    p = prefill_args(["--model", "m", "--kvstore", "k:1", "--dtype", "bfloat16", "--enforce-eager"])
    assert (p.max_num_seqs, p.num_kv_blocks, p.pipeline_stages) == (PREFILL_ENGINE_DEFAULTS["max_num_seqs"], None, 1)
    assert (p.kv_cache_memory_gib, p.gpu_memory_utilization) == (1.0, 0.9)
    assert (p.dtype, p.enforce_eager, p.reservation_ttl) == ("bfloat16", True, 600.0)
    with pytest.raises(SystemExit):  # the Literal's choices
        prefill_args(["--model", "m", "--kvstore", "k:1", "--dtype", "int8"])


def test_a_switch_that_defaults_to_on_must_be_named_by_hand():
    import argparse

    from mooncake.cliargs import field_arg

    with pytest.raises(ValueError, match="defaults to on"):
        field_arg(argparse.ArgumentParser(), DecodeConfig, "write_behind")


def test_the_engine_flags_become_the_workers_engine_config():
    from decode.server import parse_args as decode_args
    from mooncake.serving.worker_args import engine_fields

    args = decode_args(["--model", "m", "--engine", "vllm", "--threads", "3", "--enforce-eager"])
    config = DecodeConfig(engine="vllm", engine_config=engine_fields(args))
    assert (config.engine_config.model, config.engine_config.block_size) == ("m", 32)  # vLLM's default block size
    assert (config.engine_config.num_threads, config.engine_config.enforce_eager) == (3, True)


def test_to_argv_spells_the_components_own_flags_and_refuses_what_it_would():
    from mooncake.cliargs import to_argv
    from mooncake.serving.worker_args import worker_parser

    p = worker_parser("w", "a worker", "w-0", {"num_kv_blocks": 8, "max_num_seqs": 4})
    argv = to_argv(p, model="m", threads=3, max_model_len=None, enforce_eager=True, vllm_arg=["a=1", "b=2"])
    assert argv == ["--model", "m", "--threads", "3", "--enforce-eager", "--vllm-arg", "a=1", "--vllm-arg", "b=2"]
    args = p.parse_args(argv)
    assert (args.threads, args.max_model_len, args.enforce_eager, args.vllm_arg) == (3, None, True, ["a=1", "b=2"])
    with pytest.raises(ValueError, match="no flag for 'tbt_slo_s'"):  # a dest, not a field, names the flag
        to_argv(p, model="m", tbt_slo_s=0.1)
    with pytest.raises(ValueError, match="refuses --model m --dtype int8"):
        to_argv(p, model="m", dtype="int8")
    with pytest.raises(ValueError, match="refuses --threads 2"):  # --model is required
        to_argv(p, threads=2)


def test_mooncake_up_starts_each_component_with_its_own_flags_and_the_clusters_settings(tiny_dir, tmp_path):
    """`mooncake up`'s argv for every component parses with that component's parser (the launcher renders it from
    the parser), and carries ClusterConfig's settings: its SLO, dtype, block size, engine and limits."""
    from mooncake.cluster.components import COMPONENTS, component_parser
    from mooncake.cluster.launcher import LocalCluster

    config = ClusterConfig(
        model=str(tiny_dir),
        model_name="tiny",
        prefill=2,
        decode=1,
        prefill_groups=1,
        group_size=2,
        tbt_slo_s=0.25,
        max_model_len=256,
        max_num_batched_tokens=64,
        threads=1,
        pool_ssd_mib=4,
        api_key="k",
        workdir=str(tmp_path),
    )
    by_module = {run: name for name, (run, _) in COMPONENTS.items()}  # what `python -m` runs -> the component
    parsed: dict[str, object] = {}
    for wave in LocalCluster(config)._plan():
        for comp in wave:
            module = comp.argv[comp.argv.index("-m") + 1]
            args = comp.argv[comp.argv.index("-m") + 2 :]
            parsed[comp.name] = component_parser(by_module[module]).parse_args(args)
    assert sorted(parsed) == ["conductor", "decode-0", "gateway", "kv0", "kv1", "prefill-0", "prefill-1"]
    assert parsed["conductor"].tbt_slo == parsed["decode-0"].tbt_slo == 0.25
    assert parsed["gateway"].retry_budget_s == parsed["conductor"].ttft_slo == config.ttft_slo_s
    for name in ("prefill-0", "prefill-1", "decode-0", "gateway"):
        args = parsed[name]
        assert (args.model, args.dtype, args.block_size, args.max_model_len) == (str(tiny_dir), "float32", 16, 256)
    assert (parsed["prefill-0"].pipeline_stages, parsed["prefill-1"].pipeline_stages) == (2, 1)
    assert parsed["kv0"].ssd_mib == 4 and parsed["kv0"].block_bytes == config.block_bytes()
    assert parsed["conductor"].block_bytes == config.block_bytes()  # as the chart gives it
    assert parsed["decode-0"].max_num_seqs == config.decode_max_seqs
    # one step budget, one spelling: every engine's --max-num-batched-tokens
    assert {parsed[n].max_num_batched_tokens for n in ("prefill-0", "prefill-1", "decode-0")} == {64}
    assert parsed["gateway"].api_key == "k" and parsed["gateway"].tenants is None


def test_mooncake_up_shares_the_usable_cores_among_the_workers_that_compute(tiny_dir, tmp_path, monkeypatch):
    """No --threads on the CPU: each prefill and decode worker computes with its share of the cores this process may
    use (a pipelined group counts its stages), at least one; torch's default, a thread per core in every worker,
    oversubscribed them. On CUDA, or with --threads, nothing is chosen for the user."""
    from mooncake.cluster import config as cluster_config
    from mooncake.cluster import launcher
    from mooncake.cluster.components import COMPONENTS, component_parser

    monkeypatch.setattr(cluster_config, "usable_cpus", lambda: list(range(16)))
    by_module = {run: name for name, (run, _) in COMPONENTS.items()}

    def threads(**fields) -> dict[str, int | None]:
        config = ClusterConfig(model=str(tiny_dir), model_name="tiny", workdir=str(tmp_path), **fields)
        got = {}
        for wave in launcher.LocalCluster(config)._plan():
            for comp in wave:
                if comp.name.startswith(("prefill", "decode")):
                    module = comp.argv[comp.argv.index("-m") + 1]
                    args = component_parser(by_module[module]).parse_args(comp.argv[comp.argv.index("-m") + 2 :])
                    got[comp.name] = args.threads
        return got

    assert threads(prefill=2, decode=1) == {"prefill-0": 5, "prefill-1": 5, "decode-0": 5}  # 16 cores // 3
    # a group of 3 stages, a plain prefill worker and 2 decode workers: 6 computing processes
    assert set(threads(prefill=2, prefill_groups=1, group_size=3, decode=2).values()) == {2}
    assert set(threads(prefill=8, decode=12).values()) == {1}  # never 0
    assert set(threads(prefill=2, decode=1, threads=7).values()) == {7}
    assert set(threads(prefill=1, decode=1, device="cuda").values()) == {None}  # torch's own


# What a chart must set for itself: where a component listens and whom it dials, its name, sizes from the chart's
# model and its pod's resources. Every other flag the chart passes must carry the component's own default.
CHART_WIRING = {
    "conductor": {"host", "port", "metrics_port", "control_port", "redis_url", "pool_provider"}
    | {"namespace", "prefill_deployment", "decode_deployment"},
    # its block bytes from the workers' model, block size and dtype
    "kvstore": {"node", "host", "port", "control_port", "transfer_port", "model", "block_size", "dtype", "dram_mib"}
    | {"conductor", "metrics_port"},
    "prefill": {"id", "model", "conductor", "host", "port", "metrics_port", "block_size", "threads", "kvstore"},
    "decode": {"id", "model", "conductor", "host", "port", "metrics_port", "block_size", "threads", "tbt_slo"},
    "gateway": {"conductor", "model", "model_name", "host", "block_size"},
}


def test_the_charts_defaults_are_the_components_own():
    """Rendered with its default values, the chart gives each component only its wiring: a setting's default lives
    in the component's config model, and a changed default reaches the chart (or this test says where it differs)."""
    from charts import expanded_args, mooncake_containers, render

    from mooncake.cluster.components import component_parser

    docs = render()
    seen = set()
    for component, c, _ in mooncake_containers(docs):
        p = component_parser(component)
        args = p.parse_args(expanded_args(docs, c))
        differ = {
            a.dest: getattr(args, a.dest)
            for a in p._actions
            if a.option_strings and a.dest != "help" and getattr(args, a.dest) != a.default
        }
        overrides = {dest: value for dest, value in differ.items() if dest not in CHART_WIRING[component]}
        assert not overrides, f"{component}: the chart overrides the component's defaults: {overrides}"
        seen.add(component)
    assert seen == set(CHART_WIRING)


# fields of the same name that mean different things (a sampling seed, a placement policy's random seed)
NOT_ONE_SETTING = {"seed"}


def _written_defaults() -> dict[str, list[tuple[str, object]]]:
    """Each pydantic config field whose default is written as a number or a string where it is declared: field name
    -> [(where, value)], over the product's packages (the OpenAI wire schemas of gateway/protocol.py aside)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    found: dict[str, list[tuple[str, object]]] = {}
    for package in ("mooncake", "conductor", "prefill", "decode", "kvstore", "transfer"):
        for path in (root / package).rglob("*.py"):
            if path.name == "protocol.py":
                continue
            for cls in ast.walk(ast.parse(path.read_text())):
                if not (
                    isinstance(cls, ast.ClassDef) and any(getattr(b, "id", None) == "BaseModel" for b in cls.bases)
                ):
                    continue
                for stmt in cls.body:
                    if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value):
                        continue
                    value = stmt.value
                    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Field":
                        value = value.args[0] if value.args else None
                    try:
                        literal = ast.literal_eval(value) if value is not None else None
                    except ValueError:
                        continue  # a name or an expression: the default is read from where it is kept
                    if isinstance(literal, (int, float, str)) and not isinstance(literal, bool):
                        found.setdefault(stmt.target.id, []).append((f"{path.relative_to(root)}:{cls.name}", literal))
    return found


def test_no_two_configs_write_the_same_default():
    """A setting two configs share (the same field name, the same default) is written once and read by the other
    (``Other.model_fields[name].default``, or a constant both import): one place to change it."""
    written = _written_defaults()
    restated = {
        name: where
        for name, where in written.items()
        if name not in NOT_ONE_SETTING and len(where) > 1 and len({value for _, value in where}) < len(where)
    }
    assert restated == {}
    # the scan sees them: two configs with a drain timeout each, of different values (the shared name is allowed)
    assert sorted(written["drain_timeout_s"]) == [
        ("decode/config.py:DecodeConfig", 60.0),
        ("prefill/config.py:PrefillConfig", 30.0),
    ]
    assert "shm_dir" not in written  # TransferConfig and DecodeConfig read transfer.engine.SHM_DIR


def test_every_cluster_setting_is_a_mooncake_up_option():
    import typer.main

    from mooncake.cli.up_cmd import up

    command = typer.main.get_command_from_info(
        typer.models.CommandInfo(name="up", callback=up), pretty_exceptions_short=True, rich_markup_mode=None
    )
    dests = {p.name for p in command.params}
    assert set(ClusterConfig.model_fields) - dests == {"model_name"}  # from --model (a name, or a directory)
    out = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "400"}).output
    assert "--local-prefill" in out and "--detect-s" in out and "--decode-max-seqs" in out
    switches = {p.name: (p.opts, p.secondary_opts) for p in command.params if p.name in ("gateway", "insecure")}
    assert switches == {"gateway": (["--gateway"], ["--no-gateway"]), "insecure": (["--insecure"], [])}


def test_mooncake_up_takes_the_conductors_policies_by_name_and_refuses_another_in_one_line(tiny_dir, monkeypatch):
    """--policy, --admission and --local-prefill reach ClusterConfig as the Conductor's own enums; a value that is none
    of them stops `mooncake up` with one line naming the flag and every choice, before anything starts."""
    from conductor.admission import AdmissionKind
    from conductor.local import LocalPrefill
    from conductor.policies import PolicyKind
    from mooncake.cli import up_cmd

    seen: list[ClusterConfig] = []

    def cluster(config: ClusterConfig, **_):
        seen.append(config)
        raise RuntimeError("not started")

    monkeypatch.setattr(up_cmd, "LocalCluster", cluster)
    model = ["up", "--model", str(tiny_dir)]
    flags = ["--policy", "round_robin", "--admission", "early", "--local-prefill", "never"]
    CliRunner().invoke(app, [*model, *flags])
    CliRunner().invoke(app, model)
    assert [(c.policy, c.admission, c.local_prefill) for c in seen] == [
        (PolicyKind.ROUND_ROBIN, AdmissionKind.EARLY, LocalPrefill.NEVER),
        (PolicyKind.KVCACHE_CENTRIC, AdmissionKind.EARLY_PREDICTIVE, LocalPrefill.AUTO),  # the Conductor's defaults
    ]
    bad = CliRunner().invoke(app, [*model, "--policy", "fastest"])
    assert bad.exit_code == 2 and len(seen) == 2
    assert bad.output == (
        "error: --policy: Input should be 'random', 'round_robin', 'least_loaded', 'cache_aware_local' or "
        "'kvcache_centric'\n"
    )
