"""The Kubernetes deployment in deploy/: the helm chart and its values files (the dashboard: test_dashboard.py; the
chart's defences: test_deploy_security.py; rendering helpers: charts.py).

The chart must lint (``helm lint --strict``), render (``helm template``) and validate
against the Kubernetes schemas (``kubernetes-validate --strict``) with the default values,
deploy/helm/values-production.yaml, deploy/helm/values-vllm-gpu.yaml and stock vLLM on the
production sizes and on the CPU; what it renders must be what a user relies on (the prefill
pod's pool node sidecar on a shared tmpfs, probes on the real /health endpoints, GPUs only
when asked for, the Conductor allowed to scale the pools, one engine for the whole cluster),
and the command line of every container must parse with the component's own argument
parser. No test here starts vLLM.

helm comes from deploy/tools/install-helm.sh and kubernetes-validate from pip; when
either is missing these tests fail (they never skip) with the command that installs it.
No cluster and no Docker engine are needed.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from charts import (
    CHART,
    NAMESPACE,
    PREFIX,
    RELEASE,
    VALUE_SETS,
    VLLM_GPU,
    container,
    expanded_args,
    find,
    flags,
    helm,
    kinds,
    kubernetes_validate,
    merged_values,
    mooncake_containers,
    pod_spec,
    port_number,
    render,
    render_text,
    run,
)

from mooncake.runtime.process import parse_ready

# -- lint, render, validate ------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS)
def test_chart_lints_strict(values):
    out = run(helm(), "lint", "--strict", str(CHART), *VALUE_SETS[values])
    assert out.returncode == 0, f"helm lint --strict ({values}) failed:\n{out.stdout}\n{out.stderr}"
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", VALUE_SETS)
def test_rendered_manifests_validate_against_kubernetes_schemas(values, tmp_path):
    """Every document passes ``kubernetes-validate --strict`` (unknown fields are errors) at the
    validator's default Kubernetes version. The validator has no schemas for CRDs: it warns and
    passes a ServiceMonitor, so that warning is the only one allowed, and only for that kind."""
    docs = render(*VALUE_SETS[values])
    manifest = tmp_path / f"{values}.yaml"
    manifest.write_text(render_text(*VALUE_SETS[values]))
    out = run(kubernetes_validate(), "--strict", str(manifest))
    report = out.stdout + out.stderr
    assert out.returncode == 0, f"kubernetes-validate --strict ({values}) failed:\n{report}"
    passed = re.findall(r"^INFO .* passed for resource (\S+) against version", report, re.M)
    warnings = [line for line in report.splitlines() if line.startswith("WARN")]
    crds = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(passed) == len(docs) - len(crds), report
    assert len(warnings) == len(crds), report
    assert all("kind ServiceMonitor with api version monitoring.coreos.com/v1" in w for w in warnings), report


def test_every_resource_is_labelled_for_the_release():
    for d in (d for values in VALUE_SETS.values() for d in render(*values)):
        labels = d["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == RELEASE, d["metadata"]["name"]
        assert labels.get("app.kubernetes.io/part-of") == "mooncake", d["metadata"]["name"]


# -- what the pods run ----------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS)
def test_prefill_pod_pairs_its_pool_node_as_a_sidecar_on_a_shared_tmpfs(values):
    docs = render(*VALUE_SETS[values])
    spec = pod_spec(docs, "prefill")
    kv, worker = container(spec, "kvstore"), container(spec, "prefill")
    # the model's download, from the hub, comes first: the pool node reads the model's config.json
    assert [c["name"] for c in spec["initContainers"] if c["name"] != "model-download"] == ["kvstore"]
    assert kv["restartPolicy"] == "Always"  # a native sidecar: up (startup probe passed) before the worker starts
    assert kv["startupProbe"]["httpGet"]["path"] == "/health"
    shm = {v["name"]: v for v in spec["volumes"]}["shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    kv_mount = {m["name"]: m["mountPath"] for m in kv["volumeMounts"]}["shm"]
    worker_mount = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}["shm"]
    kv_flags, worker_flags = flags(kv), flags(worker)
    assert kv_mount == worker_mount == kv_flags["--shm-dir"] == "/dev/shm/mooncake"
    assert spec["shareProcessNamespace"] is True  # the segment owner's pid is checked by whoever maps it
    # the worker dials its own node; both bind and register the pod IP (peers and the Conductor dial it)
    assert worker_flags["--kvstore"] == f"$(POD_IP):{kv_flags['--port']}"
    assert kv_flags["--host"] == worker_flags["--host"] == "$(POD_IP)"
    # one registry, two instances: the node's name must differ from the worker's id
    assert kv_flags["--node"] != worker_flags["--id"]
    assert int(kv_flags["--dram-mib"]) * 2**20 < _quantity(shm["emptyDir"]["sizeLimit"])
    for c in (kv, worker):  # tmpfs pages count against the container that writes them first: either
        assert _quantity(c["resources"]["limits"]["memory"]) > int(kv_flags["--dram-mib"]) * 2**20, c["name"]


def test_prefill_groups_are_a_deployment_of_pipelined_workers_beside_the_single_ones():
    docs = render(*VALUE_SETS["groups"])
    single = find(docs, "Deployment", f"{PREFIX}-prefill")
    group = find(docs, "Deployment", f"{PREFIX}-prefill-group")
    assert group["spec"]["replicas"] == 2 and single["spec"]["replicas"] == 1
    worker = next(c for c in group["spec"]["template"]["spec"]["containers"] if c["name"] == "prefill")
    assert "--pipeline-stages=3" in worker["args"] and not any(a.startswith("--threads") for a in worker["args"])
    assert [c["name"] for c in group["spec"]["template"]["spec"]["initContainers"]] == ["kvstore"]  # its own pool node
    assert group["spec"]["selector"]["matchLabels"] != single["spec"]["selector"]["matchLabels"]
    assert not any(d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-prefill-group") for d in render())


def test_decode_pod_has_its_landing_segment_in_memory():
    spec = pod_spec(render(), "decode")
    shm = {v["name"]: v for v in spec["volumes"]}["shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m["mountPath"] for m in container(spec, "decode")["volumeMounts"]}
    assert mounts["shm"] == "/dev/shm/mooncake"  # the decode worker's default --shm-dir


def test_workers_advertise_their_pod_ip_from_the_downward_api():
    for component, c, _ in mooncake_containers(render()):
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        if component in ("prefill", "decode", "kvstore"):
            assert flags(c)["--host"] == "$(POD_IP)", component


@pytest.mark.parametrize("values", VALUE_SETS)
def test_probes_ask_health_on_the_metrics_ports(values):
    docs = render(*VALUE_SETS[values])
    seen = set()
    for component, c, _ in mooncake_containers(docs):
        f = flags(c)
        if component == "conductor":  # no HTTP health: a tcp probe on the gRPC port (ready: the leader's probe)
            assert port_number(c, c["livenessProbe"]["tcpSocket"]["port"]) == int(f["--port"])
            ready = c["readinessProbe"]
            if "exec" in ready:  # standbys (conductor.replicas auto with Redis): ready while it leads
                assert f"--address=127.0.0.1:{f['--port']}" in ready["exec"]["command"]
            else:
                assert port_number(c, ready["tcpSocket"]["port"]) == int(f["--port"])
        else:
            port = int(f["--port"] if component == "gateway" else f["--metrics-port"])
            ready = c["readinessProbe"]["httpGet"]
            assert (ready["path"], port_number(c, ready["port"])) == ("/health", port), component
            live = c["livenessProbe"]["httpGet"]
            assert live["path"] in ("/health", "/metrics") and port_number(c, live["port"]) == port, component
            start = c["startupProbe"]["httpGet"]
            assert port_number(c, start["port"]) == port, component
        seen.add(component)
    assert seen == {"conductor", "gateway", "kvstore", "prefill", "decode"}


def test_gpus_are_requested_only_when_set():
    def gpus(docs):
        """{container: (requested, limit)} of every container that mentions nvidia.com/gpu."""
        out = {}
        for _, c, _ in mooncake_containers(docs):
            res = c["resources"]
            if "nvidia.com/gpu" in json.dumps(res):
                out[c["name"]] = (
                    res.get("requests", {}).get("nvidia.com/gpu"),
                    res.get("limits", {}).get("nvidia.com/gpu"),
                )
        return out

    assert gpus(render()) == {}
    assert gpus(render("--set", "prefill.gpus=2")) == {"prefill": (2, 2)}
    assert gpus(render("--set", "decode.gpus=1")) == {"decode": (1, 1)}
    for values in ("production", "vllm-gpu"):
        asked = merged_values(values)
        assert asked["prefill"]["gpus"] >= 1 and asked["decode"]["gpus"] >= 1, values
        expected = {"prefill": (asked["prefill"]["gpus"],) * 2, "decode": (asked["decode"]["gpus"],) * 2}
        assert gpus(render(*VALUE_SETS[values])) == expected, values  # never on the kvstore sidecar
    assert gpus(render(*VALUE_SETS["vllm-cpu"])) == {}


def test_conductor_may_get_patch_and_scale_the_pool_deployments():
    docs = render()
    role = find(docs, "Role", f"{PREFIX}-conductor")
    pools = {f"{PREFIX}-prefill", f"{PREFIX}-decode"}
    assert pools <= {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    by_resource = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                by_resource[f"{group}/{resource}"] = (set(rule["verbs"]), set(rule.get("resourceNames", [])))
    assert {"get", "patch"} <= by_resource["apps/deployments/scale"][0]
    assert {"get", "patch"} <= by_resource["apps/deployments"][0]
    assert by_resource["apps/deployments/scale"][1] == by_resource["apps/deployments"][1] == pools
    assert by_resource["/pods"][0] == {"get", "patch"}  # the pod-deletion-cost annotation; nothing more on pods
    assert set(by_resource) == {"apps/deployments", "apps/deployments/scale", "/pods"}
    binding = find(docs, "RoleBinding", f"{PREFIX}-conductor")
    account = pod_spec(docs, "conductor")["serviceAccountName"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    find(docs, "ServiceAccount", account)
    for component in ("gateway", "prefill", "decode"):  # only the Conductor holds the token
        assert pod_spec(docs, component)["automountServiceAccountToken"] is False


class RecordingApi:
    """A stand-in for the two kubernetes client objects the Conductor's pool provider uses; it records each
    call as the RBAC request it would be: (api group, resource, verb, name, namespace)."""

    def __init__(self, replicas: int) -> None:
        self.replicas, self.requests = replicas, []

    def read_namespaced_deployment_scale(self, name, namespace):
        self.requests.append(("apps", "deployments/scale", "get", name, namespace))
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas))

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.requests.append(("apps", "deployments/scale", "patch", name, namespace))
        self.replicas = body["spec"]["replicas"]

    def patch_namespaced_pod(self, name, namespace, body):
        self.requests.append(("", "pods", "patch", name, namespace))


def test_conductor_pool_provider_calls_are_all_allowed_by_its_role():
    """`mooncake pool scale` through the Conductor's kubernetes provider, built from the rendered args as the
    Conductor builds it: every API request it makes (scale up; drain one pod and scale down) is one the
    rendered Role grants, on this release's Deployments in the release's namespace."""
    from conductor.__main__ import parse_args
    from conductor.pool import make_provider
    from conductor.types import Instance, Role

    docs = render()
    args = parse_args(expanded_args(docs, container(pod_spec(docs, "conductor"), "conductor")))
    assert (args.pool_provider, args.namespace) == ("kubernetes", NAMESPACE)
    deployments = {Role.PREFILL: args.prefill_deployment, Role.DECODE: args.decode_deployment}
    provider = make_provider(args.pool_provider, namespace=args.namespace, deployments=deployments)
    api = RecordingApi(replicas=2)
    provider._api = (api, api)
    provider.add(Role.DECODE, 1)
    provider.remove(
        Instance(f"{PREFIX}-prefill-5d8f-abcde", Role.PREFILL, "10.1.2.3:7200", node=f"{PREFIX}-prefill-5d8f-abcde")
    )
    assert {r[3] for r in api.requests if r[1] == "deployments/scale"} == {f"{PREFIX}-decode", f"{PREFIX}-prefill"}
    rules = find(docs, "Role", f"{PREFIX}-conductor")["rules"]
    for group, resource, verb, name, namespace in api.requests:
        assert namespace == NAMESPACE
        allowed = any(
            group in r["apiGroups"]
            and resource in r["resources"]
            and verb in r["verbs"]
            and ("resourceNames" not in r or name in r["resourceNames"])
            for r in rules
        )
        assert allowed, f"the Role does not allow {verb} {resource} {name}"


def test_pool_provider_none_renders_no_kubernetes_flags():
    conductor = flags(container(pod_spec(render("--set", "conductor.poolProvider=none"), "conductor"), "conductor"))
    assert conductor["--pool-provider"] == "none" and "--prefill-deployment" not in conductor


def test_the_prediction_log_is_off_by_default_and_on_its_own_volume_when_asked():
    from conductor.__main__ import parse_args
    from conductor.audit import MAX_BYTES

    assert "--prediction-log" not in flags(container(pod_spec(render(), "conductor"), "conductor"))
    docs = render("--set", "conductor.predictionLog=true")
    spec = pod_spec(docs, "conductor")
    c = container(spec, "conductor")
    path = parse_args(expanded_args(docs, c)).prediction_log
    assert path == "/var/log/mooncake/conductor-predictions.jsonl"
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
    assert volume["emptyDir"]["sizeLimit"] == "160Mi" and 2 * MAX_BYTES < 160 << 20  # the log and its rolled-over file


@pytest.mark.parametrize("service_port", [None, 80])
def test_gateway_service_reaches_the_gateway_port(service_port):
    docs = render(*(["--set", f"gateway.service.port={service_port}"] if service_port else []))
    service = find(docs, "Service", f"{PREFIX}-gateway")
    gateway = container(pod_spec(docs, "gateway"), "gateway")
    (port,) = service["spec"]["ports"]
    assert port["port"] == (service_port or 8000)
    assert port_number(gateway, port["targetPort"]) == int(flags(gateway)["--port"]) == 8000
    assert (
        service["spec"]["selector"] == find(docs, "Deployment", f"{PREFIX}-gateway")["spec"]["selector"]["matchLabels"]
    )
    assert flags(gateway)["--conductor"] == "$(MOONCAKE_CONDUCTOR)"
    config = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]
    conductor = find(docs, "Service", f"{PREFIX}-conductor")
    grpc_port = {p["name"]: p["port"] for p in conductor["spec"]["ports"]}["grpc"]
    assert config["MOONCAKE_CONDUCTOR"] == f"{PREFIX}-conductor:{grpc_port}"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_variable_in_a_command_line_is_defined(values):
    """Kubernetes expands $(VAR) in args only when VAR is in the container's environment;
    an undefined one would reach the process as the literal text."""
    docs = render(*VALUE_SETS[values])
    config = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]
    for _, c, _ in mooncake_containers(docs):
        defined = {e["name"] for e in c.get("env", [])}
        for source in c.get("envFrom", []):
            assert source["configMapRef"]["name"] == f"{PREFIX}-config"
            defined |= set(config)
        used = set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", " ".join(c["args"])))
        assert used <= defined, f"{c['name']}: undefined {sorted(used - defined)}"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_command_lines_parse_with_the_components_own_parsers(values):
    """Each container's args, with the variables expanded as Kubernetes would, are accepted by
    ``mooncake serve <component>``'s argument parser, and the shared settings agree."""
    from mooncake.cluster.components import COMPONENTS

    docs = render(*VALUE_SETS[values])
    config = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]
    parsed = {}
    for component, c, _ in mooncake_containers(docs):
        args = expanded_args(docs, c)
        module = importlib.import_module(COMPONENTS[component][1])
        try:
            parsed[component] = module.parse_args(args)
        except SystemExit:
            pytest.fail(f"`mooncake serve {component}` rejects the chart's args: {args}")
    asked = merged_values(values)
    # the pool node sizes its blocks from the workers' model, block size and dtype; the Conductor takes its figure
    assert parsed["kvstore"].block_bytes is None and parsed["kvstore"].model == config["MOONCAKE_MODEL_DIR"]
    kvstore, prefill = parsed["kvstore"], parsed["prefill"]
    assert (kvstore.block_size, kvstore.dtype, kvstore.engine, kvstore.vllm_arg) == (
        prefill.block_size,
        prefill.dtype,
        prefill.engine,
        prefill.vllm_arg,
    )
    assert parsed["kvstore"].hand_off_s == asked["prefill"]["kvstore"]["handOffSeconds"] > 0  # it hands off as it goes
    block_size = asked["model"]["blockSize"]
    assert parsed["prefill"].block_size == parsed["decode"].block_size == parsed["gateway"].block_size == block_size
    # one engine for the cluster: it is part of the block keys the gateway computes and the workers store
    assert parsed["prefill"].engine == parsed["decode"].engine == parsed["gateway"].engine == asked["engine"]["kind"]
    vllm_args = asked["engine"]["vllmArgs"] if asked["engine"]["kind"] == "vllm" else []
    assert parsed["prefill"].vllm_arg == parsed["decode"].vllm_arg == vllm_args
    assert parsed["prefill"].dtype == parsed["decode"].dtype == parsed["gateway"].dtype
    assert parsed["prefill"].model == parsed["decode"].model == parsed["gateway"].model == config["MOONCAKE_MODEL_DIR"]
    assert parsed["prefill"].kvstore == f"10.1.2.3:{parsed['kvstore'].port}"
    assert parsed["decode"].tbt_slo == parsed["conductor"].tbt_slo
    assert parsed["conductor"].redis_url == "redis://r:6379/0"


@pytest.mark.parametrize("values", ["vllm-gpu", "production-vllm"])
def test_vllm_on_gpus_asks_for_the_vllm_cuda_image_and_a_gpu_per_worker(values):
    docs = render(*VALUE_SETS[values])
    config = find(docs, "ConfigMap", f"{PREFIX}-config")["data"]
    assert config["MOONCAKE_ENGINE"] == "vllm"
    assert int(config["MOONCAKE_BLOCK_SIZE"]) % 16 == 0  # vLLM's attention on CUDA
    images = {c["image"] for _, c, _ in mooncake_containers(docs)}
    assert len(images) == 1 and images.pop().endswith(":0.1.0-vllm-cuda")
    for component in ("prefill", "decode"):
        spec = pod_spec(docs, component)
        worker = container(spec, component)
        assert worker["resources"]["limits"]["nvidia.com/gpu"] >= 1, component
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], component
        assert "--vllm-arg=enforce_eager=true" in worker["args"], component


def test_vllm_args_reach_both_worker_kinds_as_engine_keywords_only_under_the_vllm_engine():
    """Each of engine.vllmArgs is one --vllm-arg of every prefill and decode worker (and of the pool nodes, whose
    blocks follow vLLM's reading of the model under them), and they turn them into vLLM EngineArgs keywords (JSON
    values parsed); the gateway and the native engine get none."""
    from mooncake.engine.interface import parse_vllm_args

    wanted = ["enforce_eager=true", "gpu_memory_utilization=0.85", 'compilation_config={"level": 0}']
    sets = ["--set-json", f"engine.vllmArgs={json.dumps(wanted)}"]
    docs = render(*VALUE_SETS["vllm-gpu"], *sets)
    workers = set()
    for component, c, _ in mooncake_containers(docs):
        if component in ("prefill", "decode", "kvstore"):
            module = "kvstore.__main__" if component == "kvstore" else f"{component}.server"
            args = importlib.import_module(module).parse_args(expanded_args(docs, c))
            workers.add(component)
            assert args.engine == "vllm"
            assert parse_vllm_args(args.vllm_arg) == {
                "enforce_eager": True,
                "gpu_memory_utilization": 0.85,
                "compilation_config": {"level": 0},
            }
        else:
            assert not any(a.startswith("--vllm-arg") for a in c["args"]), component
    assert workers == {"prefill", "decode", "kvstore"}
    native = render("--set-json", f"engine.vllmArgs={json.dumps(wanted)}")
    for _, c, _ in mooncake_containers(native):
        assert not any(a.startswith("--vllm-arg") for a in c["args"]), c["name"]


# -- values sets ------------------------------------------------------------------------


def test_defaults_run_redis_in_the_release_and_leave_the_extras_off():
    docs = render()
    assert {"Ingress", "HorizontalPodAutoscaler", "ServiceMonitor"}.isdisjoint(kinds(docs))
    secrets = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Secret")
    assert secrets == [f"{PREFIX}-operator", f"{PREFIX}-tls"]  # the only ones: the operator token, the components' TLS
    redis = find(docs, "StatefulSet", f"{PREFIX}-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    conductor = container(pod_spec(docs, "conductor"), "conductor")
    url = {e["name"]: e for e in conductor["env"]}["MOONCAKE_REDIS_URL"]["value"]
    assert url == f"redis://{PREFIX}-redis:6379/0"
    assert find(docs, "Service", f"{PREFIX}-redis")["spec"]["ports"][0]["port"] == 6379
    conductors = find(docs, "Deployment", f"{PREFIX}-conductor")["spec"]
    assert conductors["replicas"] == 2 and conductors["strategy"] == {"type": "RollingUpdate"}  # a standby, on Redis
    for component in ("prefill", "decode"):
        assert find(docs, "Deployment", f"{PREFIX}-{component}")["spec"]["replicas"] == 1
        pdb = find(docs, "PodDisruptionBudget", f"{PREFIX}-{component}")
        deployment = find(docs, "Deployment", f"{PREFIX}-{component}")
        assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_without_redis_the_conductor_keeps_its_state_in_memory():
    docs = render("--set", "redis.enabled=false")
    assert "StatefulSet" not in kinds(docs)
    conductor = container(pod_spec(docs, "conductor"), "conductor")
    assert "--redis-url" not in flags(conductor)
    assert "MOONCAKE_REDIS_URL" not in {e["name"] for e in conductor["env"]}


def test_production_values_scale_out_behind_tls_with_external_redis():
    docs = render(*VALUE_SETS["production"])
    assert "StatefulSet" not in kinds(docs)
    conductor = container(pod_spec(docs, "conductor"), "conductor")
    url = {e["name"]: e for e in conductor["env"]}["MOONCAKE_REDIS_URL"]
    assert url["valueFrom"]["secretKeyRef"] == {"name": "mooncake-redis", "key": "redis-url"}
    ingress = find(docs, "Ingress", f"{PREFIX}-gateway")
    assert ingress["spec"]["tls"] == [{"secretName": "mooncake-gateway-tls", "hosts": ["llm.example.com"]}]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{PREFIX}-gateway", "port": {"name": "http"}}
    for component in ("prefill", "decode"):
        hpa = find(docs, "HorizontalPodAutoscaler", f"{PREFIX}-{component}")
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": f"{PREFIX}-{component}",
        }
        assert "replicas" not in find(docs, "Deployment", f"{PREFIX}-{component}")["spec"]  # the HPA owns it
    gateway = container(pod_spec(docs, "gateway"), "gateway")
    assert "--api-key=$(MOONCAKE_API_KEY)" in gateway["args"]
    key = {e["name"]: e for e in gateway["env"]}["MOONCAKE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "mooncake-api-key", "key": "api-key"}
    kv = flags(container(pod_spec(docs, "prefill"), "kvstore"))
    assert kv["--ssd-dir"] == "/var/lib/mooncake/ssd" and int(kv["--ssd-mib"]) > 0
    ssd = {v["name"]: v for v in pod_spec(docs, "prefill")["volumes"]}["ssd"]
    assert ssd["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == "local-nvme"


def test_service_monitor_scrapes_every_components_metrics_port():
    docs = render(*VALUE_SETS["production"])
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    components = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
    scraped = set()
    for d in docs:
        if d["kind"] == "Service" and d["metadata"]["labels"]["app.kubernetes.io/component"] in components:
            names = {p["name"] for p in d["spec"]["ports"]}
            scraped |= {(d["metadata"]["name"], p) for p in names & endpoint_ports}
    assert scraped == {
        (f"{PREFIX}-gateway", "http"),
        (f"{PREFIX}-conductor", "metrics"),
        (f"{PREFIX}-prefill", "metrics"),
        (f"{PREFIX}-prefill", "kv-metrics"),
        (f"{PREFIX}-decode", "metrics"),
    }


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--set", "decode.terminationGracePeriodSeconds=30"], "decode.terminationGracePeriodSeconds (30) must exceed"),
        (
            ["--set", "prefill.kvstore.handOffSeconds=20"],
            "prefill.terminationGracePeriodSeconds (45) must exceed prefill.drainTimeoutSeconds + "
            "prefill.kvstore.handOffSeconds (30 + 20)",
        ),
        (
            [
                "--set",
                "prefill.autoscaling.enabled=true",
                "--set",
                "prefill.autoscaling.targetCPUUtilizationPercentage=null",
            ],
            "prefill.autoscaling needs targetCPUUtilizationPercentage or metrics",
        ),
        (["--set", "conductor.poolProvider=local"], "conductor.poolProvider must be none or kubernetes"),
        (["--set", "engine.kind=sglang"], 'engine.kind must be native or vllm, not "sglang"'),
        (
            ["-f", str(VLLM_GPU), "--set", "model.blockSize=24"],
            "model.blockSize (24) must be a multiple of 16 with engine.kind=vllm",
        ),
        (
            ["-f", str(VLLM_GPU), "--set", "decode.gpus=0"],
            "model.blockSize (16) must be a multiple of 32 with engine.kind=vllm on the CPU (decode.gpus is 0)",
        ),
        (
            ["--set", "engine.kind=vllm", "--set", "image.variant=vllm-cpu"],
            "model.blockSize (16) must be a multiple of 32 with engine.kind=vllm on the CPU "
            "(image.variant is vllm-cpu)",
        ),
        (["-f", str(VLLM_GPU), "--set", "image.variant=cuda"], "engine.kind=vllm needs an image with vLLM"),
        (["-f", str(VLLM_GPU), "--set", "engine.vllmArgs={enforce_eager}"], "engine.vllmArgs wants KEY=VALUE strings"),
        (["--set", "redis.enabled=false", "--set", "conductor.replicas=2"], "conductor.replicas=2 needs Redis"),
        (
            ["--set", "prefill.groups.replicas=1", "--set", "prefill.groups.stages=1"],
            "prefill.groups.stages must be at least 2",
        ),
        (["-f", str(VLLM_GPU), "--set", "prefill.groups.replicas=1"], "prefill.groups run the native engine only"),
    ],
)
def test_inconsistent_values_fail_with_a_message(bad, message):
    out = run(helm(), "template", RELEASE, str(CHART), *bad)
    assert out.returncode != 0
    assert message in out.stderr


# -- the rendered pods, run as processes -------------------------------------------------


class PodProcesses:
    """The rendered containers as local processes, as a pod would run them: the image's entrypoint
    (`mooncake serve`) with the container's args, $(VAR) expanded from its environment, the pod IP
    being 127.0.0.1. Pool-node sidecars start before their worker, as native sidecars do."""

    def __init__(self, docs: list[dict], env: dict[str, str], logs: Path, shm_dir: str) -> None:
        self.docs, self.env, self.logs, self.shm_dir = docs, env, logs, shm_dir
        self.running: list[tuple[str, subprocess.Popen, int]] = []  # (container, process, pod's grace seconds)
        self.envs: dict[str, dict[str, str]] = {}  # container -> its environment (exec probes run in it)

    def start(self, component: str, timeout_s: float = 300) -> None:
        spec = pod_spec(self.docs, component)
        for c in spec.get("initContainers", []) + spec["containers"]:
            mounts = self._secret_mounts(spec, c)
            env = {"POD_NAME": f"{PREFIX}-{component}-0", "POD_IP": "127.0.0.1"}
            env |= {e["name"]: e["value"] for e in c.get("env", []) if "value" in e and e["name"] != "HOME"}
            env = {k: _moved(v, mounts) for k, v in env.items()}
            env |= self.env  # what the cluster's DNS names resolve to here
            self.envs[c["name"]] = env
            args = [
                _moved(a.replace("/dev/shm/mooncake", self.shm_dir), mounts) for a in expanded_args(self.docs, c, env)
            ]
            if c["name"] == "decode":  # its landing segment: the mount's path is the default; here a private one
                args.append(f"--shm-dir={self.shm_dir}")
            log = open(self.logs / f"{c['name']}.log", "w")
            proc = subprocess.Popen(
                [sys.executable, "-m", "mooncake.cli.main", "serve", c["args"][0], *args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, **env},
            )
            self.running.append((c["name"], proc, spec.get("terminationGracePeriodSeconds", 30)))
            deadline = time.monotonic() + timeout_s
            while parse_ready(line := proc.stdout.readline()) is None:
                if (not line and proc.poll() is not None) or time.monotonic() > deadline:
                    pytest.fail(f"{c['name']} did not start: {(self.logs / (c['name'] + '.log')).read_text()[-3000:]}")

    def exec_probe(self, c: dict, command: list[str]) -> int:
        """An exec probe's exit status, run as the container would run it (the image's python is this one)."""
        argv = [sys.executable if a == "python" else a for a in command]
        return subprocess.run(argv, env={**os.environ, **self.envs[c["name"]]}, timeout=30).returncode

    def _secret_mounts(self, spec: dict, c: dict) -> dict[str, str]:
        """The container's mounts of the chart's Secrets, written out here: {mount path: local directory}."""
        import base64

        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        out = {}
        for m in c.get("volumeMounts", []):
            source = volumes[m["name"]].get("secret")
            if source is None:
                continue
            data = find(self.docs, "Secret", source["secretName"])["data"]
            local = self.logs / "secrets" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            for item in source["items"]:
                (local / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
            out[m["mountPath"]] = str(local)
        return out

    def stop(self) -> dict[str, tuple[int | None, float]]:
        """SIGTERM the workers first and the sidecars and the Conductor last; {container: (exit code, seconds)}."""
        out = {}
        for name, proc, grace in reversed(self.running):
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                out[name] = (proc.wait(timeout=grace), time.monotonic() - start)
            except subprocess.TimeoutExpired:
                proc.kill()
                out[name] = (None, time.monotonic() - start)
        return out

    def kill(self) -> None:
        for _, proc, _ in self.running:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _moved(value: str, mounts: dict[str, str]) -> str:
    for path, local in mounts.items():
        value = value.replace(path, local)
    return value


def http_status(url: str, body: dict | None = None) -> tuple[int, dict | None]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if r.headers.get_content_type() == "application/json" else None
    except urllib.error.HTTPError as e:
        return e.code, None


@pytest.mark.slow
def test_rendered_pods_run_answer_their_probes_serve_and_stop_within_their_grace(smollm2_dir, tmp_path):
    """The default chart's containers, run with exactly their rendered command lines (ports moved to free
    ones, the model directory to the local SmolLM2), find each other by the addresses they register, answer
    every probe the chart declares, serve chat completions with the second one's prefix from the pool, and
    stop on SIGTERM within their pod's grace period."""
    from mooncake.localproc import RedisServer, free_port

    ports = [
        "conductor.port",
        "conductor.metricsPort",
        "conductor.controlPort",
        "gateway.port",
        "prefill.port",
        "prefill.metricsPort",
        "prefill.kvstore.port",
        "prefill.kvstore.controlPort",
        "prefill.kvstore.transferPort",
        "prefill.kvstore.metricsPort",
        "decode.port",
        "decode.metricsPort",
    ]
    sets = {key: free_port() for key in ports} | {
        "model.dir": smollm2_dir,
        "prefill.threads": 1,
        "decode.threads": 1,
        "prefill.numKvBlocks": 256,
        "decode.numKvBlocks": 512,
        "prefill.kvstore.dramMib": 256,
    }
    docs = render(*(arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")))
    redis = RedisServer(tmp_path)
    shm_dir = f"/dev/shm/mc-deploy-test-{os.getpid()}"
    # what the Services' DNS names resolve to here
    env = {"MOONCAKE_CONDUCTOR": f"127.0.0.1:{sets['conductor.port']}", "MOONCAKE_REDIS_URL": redis.url}
    pods = PodProcesses(docs, env, tmp_path, shm_dir)
    try:
        for component in ("conductor", "prefill", "decode", "gateway"):
            pods.start(component)
        gateway = f"http://127.0.0.1:{sets['gateway.port']}"
        deadline = time.monotonic() + 30
        while (health := http_status(f"{gateway}/health"))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.5)  # ready once the workers' registrations are in
        assert health[0] == 200 and health[1]["alive"] == {"prefill": 1, "decode": 1, "kvstore": 1}

        for component in ("conductor", "prefill", "decode", "gateway"):
            spec = pod_spec(docs, component)
            for c in spec.get("initContainers", []) + spec["containers"]:
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    probe = c.get(kind)
                    if probe is None:
                        continue
                    if "exec" in probe:  # a Conductor with standbys: ready while it leads (this one, alone)
                        assert pods.exec_probe(c, probe["exec"]["command"]) == 0, f"{c['name']} {kind}"
                    elif "tcpSocket" in probe:
                        socket.create_connection(
                            ("127.0.0.1", port_number(c, probe["tcpSocket"]["port"])), timeout=2
                        ).close()
                    else:
                        port = port_number(c, probe["httpGet"]["port"])
                        status, _ = http_status(f"http://127.0.0.1:{port}{probe['httpGet']['path']}")
                        assert status == 200, f"{c['name']} {kind} on :{port}{probe['httpGet']['path']}: {status}"

        system = "You answer questions about European capitals briefly and precisely. " * 10
        usage = []
        for question in ("What is the capital of France?", "What is the capital of France? One word."):
            status, answer = http_status(
                f"{gateway}/v1/chat/completions",
                {
                    "model": "smollm2-135m",
                    "max_tokens": 12,
                    "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                },
            )
            assert status == 200
            assert "Paris" in answer["choices"][0]["message"]["content"]
            usage.append(answer["usage"])
        assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert usage[1]["prompt_tokens_details"]["cached_tokens"] >= 16 * (usage[0]["prompt_tokens"] // 16 - 2)

        stopped = pods.stop()
        for name, (code, _) in stopped.items():
            # uvicorn (the gateway) re-raises the SIGTERM it shut down on
            assert code in (0, -signal.SIGTERM), f"{name} did not stop within its grace period: {stopped}"
    finally:
        pods.kill()
        redis.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)


def _quantity(text: str) -> int:
    """A Kubernetes memory quantity (Mi, Gi, or bytes) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if str(text).endswith(suffix):
            return int(float(str(text)[: -len(suffix)]) * factor)
    return int(text)
