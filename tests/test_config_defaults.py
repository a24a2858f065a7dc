"""One default per setting: the SLO a cluster starts with is conductor.types.DEFAULT_SLO wherever it is started, and
`mooncake up`'s options take their defaults from ClusterConfig, the workers' engines from EngineConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from conductor.__main__ import parse_args as conductor_args
from conductor.core import ConductorConfig
from conductor.types import DEFAULT_SLO
from decode.worker import DecodeConfig
from mooncake.cli.main import app
from mooncake.cluster.launcher import ClusterConfig
from mooncake.engine.config import EngineConfig
from prefill.worker import PrefillConfig

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
    assert (decode.engine_config.max_num_seqs, decode.engine_config.num_kv_blocks) == (4, 2048)


def test_a_workers_flags_are_read_off_its_config():
    from decode.server import parse_args as decode_args
    from decode.worker import DECODE_ENGINE_DEFAULTS
    from prefill.server import parse_args as prefill_args
    from prefill.worker import PREFILL_ENGINE_DEFAULTS

    d = decode_args(["--model", "m"])
    assert (d.detect_s, d.tbt_slo, d.shm_dir) == tuple(
        DecodeConfig.model_fields[f].default for f in ("detect_s", "tbt_slo_s", "shm_dir")
    )
    assert (d.max_num_seqs, d.num_kv_blocks) == (DECODE_ENGINE_DEFAULTS["max_num_seqs"], 2048)
    p = prefill_args(["--model", "m", "--kvstore", "k:1", "--dtype", "bfloat16", "--enforce-eager"])
    assert (p.max_num_seqs, p.num_kv_blocks, p.pipeline_stages) == (PREFILL_ENGINE_DEFAULTS["max_num_seqs"], 1024, 1)
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
    from mooncake.serving.process import engine_fields

    args = decode_args(["--model", "m", "--engine", "vllm", "--threads", "3", "--enforce-eager"])
    config = DecodeConfig(engine="vllm", engine_config=engine_fields(args))
    assert (config.engine_config.model, config.engine_config.block_size) == ("m", 32)  # vLLM's default block size
    assert (config.engine_config.num_threads, config.engine_config.enforce_eager) == (3, True)
