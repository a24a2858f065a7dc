"""The helm chart's model: where it comes from (model.source: the image, a PVC, a hostPath, or the Hugging Face hub
through an init container), who mounts it, the block bytes the pool nodes work out from it, and the GPUs and devices
of values-production.yaml (rendering helpers: charts.py; the chart's other behaviour: test_deploy.py).

No cluster, no network: the download container's script runs here against a stand-in ``huggingface_hub``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from charts import (
    CHART,
    NAMESPACE,
    PREFIX,
    PRODUCTION,
    RELEASE,
    VALUE_SETS,
    container,
    expanded_args,
    find,
    flags,
    helm,
    mooncake_containers,
    pod_spec,
    render,
    run,
)

HUB = ["--set", "model.source=hub", "--set", "model.hub.id=HuggingFaceTB/SmolLM2-135M-Instruct"]
SOURCES = {
    "pvc": ["--set", "model.source=pvc", "--set", "model.pvc.claimName=models"],
    "hostPath": ["--set", "model.source=hostPath", "--set", "model.hostPath.path=/srv/models/smollm2"],
    "hub": HUB,
}
# the containers that read the model, by pod: each worker, the prefill pod's pool node, the gateway
READERS = {"prefill": ["kvstore", "prefill"], "decode": ["decode"], "gateway": ["gateway"]}


def model_volume(spec: dict) -> dict | None:
    return {v["name"]: v for v in spec.get("volumes", [])}.get("model")


def model_mount(c: dict) -> dict | None:
    return {m["name"]: m for m in c.get("volumeMounts", [])}.get("model")


def test_a_model_in_the_image_is_its_directory_there_and_no_pod_mounts_one():
    docs = render()
    config = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]
    assert config["MOONCAKE_MODEL_DIR"] == "/models/smollm2-135m"
    for pod, names in READERS.items():
        spec = pod_spec(docs, pod)
        assert model_volume(spec) is None and "model-download" not in [
            c["name"] for c in spec.get("initContainers", [])
        ]
        for name in names:
            assert "--model=$(MOONCAKE_MODEL_DIR)" in container(spec, name)["args"], name


@pytest.mark.parametrize("source", SOURCES)
def test_every_pod_that_reads_the_model_mounts_it_read_only_and_is_told_its_path(source):
    docs = render(*SOURCES[source])
    config = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]
    assert config["MOONCAKE_MODEL_DIR"] == "/model"
    for pod, names in READERS.items():
        spec = pod_spec(docs, pod)
        assert model_volume(spec) is not None, pod
        for name in names:
            c = container(spec, name)
            assert model_mount(c) == {"name": "model", "mountPath": "/model", "readOnly": True}, name
            assert "--model=/model" in expanded_args(docs, c), name
    conductor = pod_spec(docs, "conductor")
    assert model_volume(conductor) is None and model_mount(container(conductor, "conductor")) is None
    assert not any(a.startswith("--model") for a in container(conductor, "conductor")["args"])


def test_a_pvc_is_mounted_read_only_at_its_sub_path():
    docs = render(*SOURCES["pvc"], "--set", "model.pvc.subPath=smollm2-135m")
    for pod, names in READERS.items():
        spec = pod_spec(docs, pod)
        assert model_volume(spec) == {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
        }
        for name in names:
            assert model_mount(container(spec, name))["subPath"] == "smollm2-135m"
    # no sub-path: the volume's root
    assert "subPath" not in model_mount(container(pod_spec(render(*SOURCES["pvc"]), "decode"), "decode"))


def test_a_host_path_must_be_a_directory_on_the_node():
    spec = pod_spec(render(*SOURCES["hostPath"]), "decode")
    assert model_volume(spec) == {"name": "model", "hostPath": {"path": "/srv/models/smollm2", "type": "Directory"}}


def test_a_hub_model_is_downloaded_first_in_every_pod_that_reads_it_with_the_token_from_its_secret():
    docs = render(
        *HUB,
        "--set",
        "model.hub.revision=abc123",
        "--set",
        "model.hub.tokenSecret.name=hf",
        "--set",
        "model.hub.sizeLimit=8Gi",
    )
    for pod in READERS:
        spec = pod_spec(docs, pod)
        init = spec["initContainers"]
        # before the pool node sidecar too: it reads the model's config.json when it starts
        assert init[0]["name"] == "model-download", pod
        download = init[0]
        assert download["image"] == container(spec, pod)["image"]  # the project's own image
        assert download["args"][:3] == ["HuggingFaceTB/SmolLM2-135M-Instruct", "abc123", "/model"]
        assert "*.safetensors" in download["args"][3:] and "config.json" not in download["args"][3:]
        env = {e["name"]: e for e in download["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        # it alone writes the volume, and nothing else: its hub cache has a volume of its own
        assert {"name": "model", "mountPath": "/model"} in download["volumeMounts"]
        assert download["securityContext"]["readOnlyRootFilesystem"] is True
        home = {m["name"]: m["mountPath"] for m in download["volumeMounts"]}["model-download-home"]
        assert env["HF_HOME"]["value"] == env["TMPDIR"]["value"] == home
        assert model_volume(spec) == {"name": "model", "emptyDir": {"sizeLimit": "8Gi"}}
        assert {v["name"] for v in spec["volumes"]} >= {"model", "model-download-home"}
    assert "initContainers" not in pod_spec(docs, "conductor")
    # no token Secret named: an anonymous download
    anonymous = pod_spec(render(*HUB), "decode")["initContainers"][0]
    assert "HF_TOKEN" not in {e["name"] for e in anonymous["env"]}
    assert anonymous["args"][1] == "main"


def _stand_in_hub(tmp_path: Path, source: Path | None) -> Path:
    """A ``huggingface_hub`` whose snapshot_download records its call and copies ``source``'s config.json (none:
    writes nothing) into ``local_dir``."""
    pkg = tmp_path / "site" / "huggingface_hub"
    pkg.mkdir(parents=True)
    pkg.joinpath("__init__.py").write_text(
        "import json, os, shutil\n"
        "def snapshot_download(repo_id, revision=None, local_dir=None, allow_patterns=None):\n"
        "    os.makedirs(local_dir, exist_ok=True)\n"
        f"    source = {str(source) if source else ''!r}\n"
        "    if source:\n"
        "        shutil.copy(os.path.join(source, 'config.json'), local_dir)\n"
        "    with open(os.path.join(local_dir, '..', 'call.json'), 'w') as f:\n"
        "        json.dump([repo_id, revision, local_dir, allow_patterns, os.environ.get('HF_TOKEN')], f)\n"
        "    return local_dir\n"
    )
    return pkg.parent


def _run_download(download: dict, target: Path, site: Path) -> subprocess.CompletedProcess:
    """The rendered download container's command, as the kubelet runs it, with the volume at ``target``."""
    args = [str(target) if a == "/model" else a for a in download["args"]]
    env = {**os.environ, "PYTHONPATH": str(site), "HF_TOKEN": "hf_secret"}
    command = [
        sys.executable if download["command"][0] == "python" else download["command"][0],
        *download["command"][1:],
    ]
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=60)


def test_the_download_containers_script_fetches_the_pinned_revision_and_refuses_a_repository_without_config(
    tiny_dir, tmp_path
):
    import json

    download = pod_spec(render(*HUB, "--set", "model.hub.revision=abc123"), "decode")["initContainers"][0]
    target = tmp_path / "volume" / "model"
    done = _run_download(download, target, _stand_in_hub(tmp_path / "good", tiny_dir))
    assert done.returncode == 0, done.stderr
    repo, revision, local_dir, patterns, token = json.loads((tmp_path / "volume" / "call.json").read_text())
    assert (repo, revision, local_dir, token) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "abc123",
        str(target),
        "hf_secret",
    )
    assert patterns == download["args"][3:]
    assert (target / "config.json").is_file()

    empty = tmp_path / "empty-volume" / "model"
    failed = _run_download(download, empty, _stand_in_hub(tmp_path / "bad", None))
    assert failed.returncode != 0 and "has no config.json" in failed.stderr


@pytest.mark.parametrize("values", ["default", "production"])
def test_the_pool_nodes_blocks_are_the_size_of_the_workers_engine_blocks(values, tiny_dir):
    """The pool node's command line, with the model directory at the tiny model, works its block bytes out to the
    bytes of one block of the native engine the workers run with the same block size and dtype (vLLM's reading of
    the model, under engine.kind=vllm: mooncake.serving.model_support.kv_layout, tested with the launcher)."""
    import kvstore.__main__ as kvstore_main
    from mooncake.engine.config import EngineConfig
    from mooncake.engine.engine import LLMEngine

    docs = render(*VALUE_SETS[values])
    kv = container(pod_spec(docs, "prefill"), "kvstore")
    args = kvstore_main.parse_args(expanded_args(docs, kv, {"MOONCAKE_MODEL_DIR": str(tiny_dir)}))
    config = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_dir),
            dtype=config["MOONCAKE_DTYPE"],
            block_size=int(config["MOONCAKE_BLOCK_SIZE"]),
            use_kernels=False,
            num_kv_blocks=4,
        )
    )
    assert kvstore_main.block_bytes(args) == engine.block_bytes
    assert "--block-bytes" not in flags(container(pod_spec(docs, "conductor"), "conductor"))  # it takes the pool's


@pytest.mark.vllm
def test_under_vllm_the_pool_node_sizes_its_blocks_by_vllms_reading_of_the_model(tiny_dir):
    """engine.kind=vllm on the CPU: the pool node, given the workers' engine and vllmArgs, works out the figure
    ``mooncake up`` sizes its pool nodes by (vLLM's layout of the model, 32-token blocks)."""
    import kvstore.__main__ as kvstore_main
    from mooncake.engine.interface import parse_vllm_args
    from mooncake.serving.model_support import kv_layout

    docs = render(*VALUE_SETS["vllm-cpu"], "--set", "engine.vllmArgs={enforce_eager=true}")
    kv = container(pod_spec(docs, "prefill"), "kvstore")
    args = kvstore_main.parse_args(expanded_args(docs, kv, {"MOONCAKE_MODEL_DIR": str(tiny_dir)}))
    assert (args.engine, args.block_size, args.vllm_arg) == ("vllm", 32, ["enforce_eager=true"])
    expected = kv_layout("vllm", tiny_dir, args.dtype, parse_vllm_args(args.vllm_arg)).block_bytes(32)
    assert kvstore_main.block_bytes(args) == expected


def test_a_pool_node_without_its_model_says_so_and_stops(tmp_path):
    import kvstore.__main__ as kvstore_main

    base = ["--node", "kv", "--dram-mib", "1", "--shm-dir", str(tmp_path)]
    missing = str(tmp_path / "no-model")
    assert kvstore_main.main([*base, "--model", missing, "--block-size", "16", "--dtype", "float32"]) == 2
    assert kvstore_main.main([*base, "--model", missing]) == 2  # no block size or dtype: not guessed
    with pytest.raises(ValueError, match="does not exist"):
        kvstore_main.block_bytes(
            kvstore_main.parse_args([*base, "--model", missing, "--block-size", "16", "--dtype", "bfloat16"])
        )


def test_production_runs_the_workers_on_cuda_in_bfloat16_with_a_gpu_each_and_none_elsewhere():
    from mooncake.cluster.components import component_parser

    docs = render("-f", str(PRODUCTION))
    config = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]
    assert config["MOONCAKE_DTYPE"] == "bfloat16"
    for pool in ("prefill", "decode"):
        worker = container(pod_spec(docs, pool), pool)
        args = component_parser(pool).parse_args(expanded_args(docs, worker))
        assert (args.device, args.dtype) == ("cuda", "bfloat16"), pool
        resources = worker["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1, pool
    for component, c, _ in mooncake_containers(docs):
        if c["name"] not in ("prefill", "decode"):
            assert "nvidia.com/gpu" not in str(c.get("resources")), component  # the Conductor, gateways, pool nodes
    # the defaults stay on the CPU, with no flag to say so (the workers' default)
    for pool in ("prefill", "decode"):
        assert not any(a.startswith("--device") for a in container(pod_spec(render(), pool), pool)["args"])


def test_a_tensor_parallel_pool_asks_a_gpu_a_rank_and_its_workers_get_the_size():
    from mooncake.cluster.components import component_parser

    sizes = ["--set", "prefill.tensorParallelSize=2", "--set", "decode.tensorParallelSize=4"]
    gpus = ["--set", "prefill.gpus=2", "--set", "decode.gpus=4"]
    docs = render("-f", str(PRODUCTION), *sizes, *gpus)
    for pool, n in (("prefill", 2), ("decode", 4)):
        worker = container(pod_spec(docs, pool), pool)
        assert component_parser(pool).parse_args(expanded_args(docs, worker)).tensor_parallel_size == n, pool
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == n, pool
        mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(docs, pool)["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", pool  # the ranks' shared memory
        assert "/dev/shm/mooncake" in mounts, pool
    # at one rank (the default) no flag is given (the workers' default), and /dev/shm is the container's own
    for pool in ("prefill", "decode"):
        worker = container(pod_spec(render(), pool), pool)
        assert not any(a.startswith("--tensor-parallel") for a in worker["args"])
        assert "/dev/shm" not in {m["mountPath"] for m in worker["volumeMounts"]}


def test_vllm_workers_split_over_ranks_get_the_size():
    from mooncake.cluster.components import component_parser

    vllm = ["--set", "engine.kind=vllm", "--set", "image.variant=vllm-cpu", "--set", "model.blockSize=32"]
    docs = render(*vllm, "--set", "prefill.tensorParallelSize=2")
    worker = container(pod_spec(docs, "prefill"), "prefill")
    args = component_parser("prefill").parse_args(expanded_args(docs, worker))
    assert (args.tensor_parallel_size, args.engine) == (2, "vllm")
    assert "/dev/shm" in {m["mountPath"] for m in worker["volumeMounts"]}


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--set", "model.source=s3"], "model.source must be image, pvc, hostPath or hub"),
        (["--set", "model.source=pvc"], "model.source=pvc needs model.pvc.claimName"),
        (["--set", "model.source=hostPath"], "model.source=hostPath needs model.hostPath.path"),
        (["--set", "model.source=hub"], "model.source=hub needs model.hub.id"),
        (["--set", "model.blockBytes=737280"], "model.blockBytes is no longer a value"),
        (["--set", "decode.device=cuda"], "decode.device is cuda but the pool asks for no GPU"),
        (["--set", "prefill.device=gpu", "--set", "prefill.gpus=1"], "prefill.device must be cpu or cuda[:N]"),
        (
            ["--set", "decode.device=cuda", "--set", "decode.gpus=1", "--set", "decode.tensorParallelSize=2"],
            "decode.tensorParallelSize is 2 on cuda: a GPU a rank, so decode.gpus must be 2 at least",
        ),
    ],
)
def test_model_values_no_pod_could_start_with_fail_with_a_message(bad, message):
    out = run(helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *bad)
    assert out.returncode != 0 and message in out.stderr, out.stderr
