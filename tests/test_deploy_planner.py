"""The helm chart's capacity planner values (``conductor.planner``, ``conductor.plannerIntervalSeconds``,
``conductor.plannerMin/Max{Prefill,Decode}``) and what the planner's ``act`` mode needs from the chart.

With ``planner=act`` the Conductor scales the prefill and decode pools itself through its kubernetes pool provider
(conductor/pool.py ``KubernetesProvider``). These tests render the chart under a release name and namespace of their
own, build that provider from the rendered Conductor's arguments against recording stand-ins for the two kubernetes
client objects, and check that its requests land on the Deployments the chart rendered, with bodies ``kubectl scale``
would send, and that the rendered Role allows each of them. They also check the values that must not render (an
unknown mode, ``act`` without a pool provider or beside a pool's HPA) and that the rendered command line parses with
the Conductor's own argument parser. helm is needed (tests/charts.py finds it); no cluster is.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import yaml
from charts import CHART, container, find, flags, helm, run

from conductor.pool import DELETION_COST, KubernetesProvider
from conductor.types import Instance, Role

# a release of its own, so nothing here leans on the names tests/charts.py renders with
RELEASE, NAMESPACE = "shop", "llm-serving"
PREFIX = f"{RELEASE}-mooncake"
ACT = ["--set", "conductor.planner=act", "--set", "conductor.poolProvider=kubernetes"]
# replicas the pools start from, unlike each other and unlike the chart's defaults, so a patch computed from the
# wrong Deployment's count shows
SIZED = ["--set", "prefill.replicas=3", "--set", "decode.replicas=2"]
# what the kubelet would put in for the environment variables that come from the downward API or a Secret
POD_VALUES = {
    "POD_NAME": f"{PREFIX}-conductor-7d9c5b-x2x8q",
    "POD_IP": "10.1.2.3",
    "MOONCAKE_REDIS_URL": f"redis://{PREFIX}-redis:6379/0",
}


def helm_template(*extra: str):
    return run(helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra)


def render(*extra: str) -> list[dict]:
    """The documents ``helm template`` renders for this file's release (empty ones dropped)."""
    out = helm_template(*extra)
    assert out.returncode == 0, f"helm template {' '.join(extra)} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def conductor_pod(docs: list[dict]) -> dict:
    return find(docs, "Deployment", f"{PREFIX}-conductor")["spec"]["template"]["spec"]


def conductor_container(docs: list[dict]) -> dict:
    return container(conductor_pod(docs), "conductor")


def expanded_args(docs: list[dict], c: dict) -> list[str]:
    """The container's arguments after its component name, with each $(VAR) replaced as the kubelet replaces it:
    from the container's env (a literal value, or a plausible one for the downward API and Secrets) and from the
    ConfigMaps its envFrom names. A variable none of them defines fails the test (the kubelet would pass the
    ``$(VAR)`` text on unchanged)."""
    values: dict[str, str] = {}
    for source in c.get("envFrom", []):
        values.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in c.get("env", []):
        values[var["name"]] = var["value"] if "value" in var else POD_VALUES[var["name"]]

    def value(m: re.Match) -> str:
        assert m.group(1) in values, f"$({m.group(1)}) is defined nowhere in the conductor container"
        return values[m.group(1)]

    return [re.sub(r"\$\(([A-Z_0-9]+)\)", value, a) for a in c["args"][1:]]


class FakeApps:
    """AppsV1Api's read and patch of a Deployment's scale subresource, over a table of replica counts."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)
        self.calls: list[tuple] = []

    def read_namespaced_deployment_scale(self, name, namespace):
        self.calls.append(("read_namespaced_deployment_scale", name, namespace))
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas[name]))

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.calls.append(("patch_namespaced_deployment_scale", name, namespace, body))
        self.replicas[name] = body["spec"]["replicas"]


class FakeCore:
    """CoreV1Api's pod patch."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def patch_namespaced_pod(self, name, namespace, body):
        self.calls.append(("patch_namespaced_pod", name, namespace, body))


# each client call as the request the API server authorizes: (API group, resource, verb)
REQUESTS = {
    "read_namespaced_deployment_scale": ("apps", "deployments/scale", "get"),
    "patch_namespaced_deployment_scale": ("apps", "deployments/scale", "patch"),
    "patch_namespaced_pod": ("", "pods", "patch"),
}


def provider_from_chart(docs: list[dict]) -> tuple[KubernetesProvider, FakeApps, FakeCore, dict[Role, dict]]:
    """The Conductor's kubernetes provider as the rendered args configure it, on fakes that start from the rendered
    Deployments' replicas; also the rendered pool Deployments by role."""
    args = flags(conductor_container(docs))
    namespace = args["--namespace"]
    assert namespace == NAMESPACE, "the Conductor must scale the pools of its own release's namespace"
    rendered = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    pools = {}
    for role, flag in ((Role.PREFILL, "--prefill-deployment"), (Role.DECODE, "--decode-deployment")):
        name = args[flag]
        assert name in rendered, f"{flag}={name} names no Deployment the chart rendered ({sorted(rendered)})"
        # helm installs an object without a namespace of its own into the release's namespace
        assert rendered[name]["metadata"].get("namespace", NAMESPACE) == namespace
        pools[role] = rendered[name]
    apps = FakeApps({d["metadata"]["name"]: d["spec"]["replicas"] for d in pools.values()})
    core = FakeCore()
    deployments = {role: d["metadata"]["name"] for role, d in pools.items()}
    return KubernetesProvider(namespace, deployments, api=(apps, core)), apps, core, pools


def test_the_kubernetes_providers_patch_is_what_kubectl_scale_would_send_against_the_charts_rendered_objects():
    """``kubectl scale deployment NAME --replicas=N`` sends PATCH .../namespaces/NS/deployments/NAME/scale with the
    merge patch ``{"spec": {"replicas": N}}``; the client's ``patch_namespaced_deployment_scale(NAME, NS, body)``
    is that request. So adding two prefill instances must patch the rendered prefill Deployment's scale to its
    rendered replicas + 2, in the release's namespace, and nothing else; and removing a drained pod must first mark
    it the cheapest to delete (its pod-deletion-cost annotation), then scale its Deployment down by one."""
    docs = render(*ACT, *SIZED)
    provider, apps, core, pools = provider_from_chart(docs)
    prefill, decode = pools[Role.PREFILL]["metadata"]["name"], pools[Role.DECODE]["metadata"]["name"]
    assert (prefill, decode) == (f"{PREFIX}-prefill", f"{PREFIX}-decode")
    assert (pools[Role.PREFILL]["spec"]["replicas"], pools[Role.DECODE]["spec"]["replicas"]) == (3, 2)

    assert provider.add(Role.PREFILL, 2) == [f"{prefill} replicas -> 5"]
    patches = [c for c in apps.calls if c[0] == "patch_namespaced_deployment_scale"]
    assert patches == [("patch_namespaced_deployment_scale", prefill, NAMESPACE, {"spec": {"replicas": 5}})]
    assert apps.replicas == {prefill: 5, decode: 2}
    assert core.calls == []

    apps.calls.clear()
    pod = f"{decode}-6f7b8c-q2w3e"
    provider.remove(Instance(pod, Role.DECODE, "10.1.2.4:7300", node=pod))
    assert core.calls == [
        ("patch_namespaced_pod", pod, NAMESPACE, {"metadata": {"annotations": {DELETION_COST: "-1000000"}}})
    ]
    assert apps.calls[-1] == ("patch_namespaced_deployment_scale", decode, NAMESPACE, {"spec": {"replicas": 1}})
    assert apps.replicas == {prefill: 5, decode: 1}


def test_the_rendered_role_bound_to_the_conductors_service_account_allows_every_call_the_provider_makes():
    """The planner's scaling (add, then a drained pod's removal) makes get and patch on deployments/scale of both
    rendered pool Deployments and a patch on a pod; the Role grants each, by name where names are known, and its
    RoleBinding hands it to the ServiceAccount the Conductor's pod runs as."""
    docs = render(*ACT, *SIZED)
    provider, apps, core, pools = provider_from_chart(docs)
    names = {d["metadata"]["name"] for d in pools.values()}
    provider.add(Role.PREFILL, 2)
    provider.add(Role.DECODE, 1)
    pod = f"{PREFIX}-prefill-5d8f9c-abcde"
    provider.remove(Instance(pod, Role.PREFILL, "10.1.2.3:7200", node=pod))

    made = {(*REQUESTS[call[0]], call[1], call[2]) for call in apps.calls + core.calls}
    assert {(g, r, v) for g, r, v, _, _ in made} == {
        ("apps", "deployments/scale", "get"),
        ("apps", "deployments/scale", "patch"),
        ("", "pods", "patch"),
    }
    assert {name for _, r, _, name, _ in made if r == "deployments/scale"} == names

    role = find(docs, "Role", f"{PREFIX}-conductor")
    for group, resource, verb, name, namespace in sorted(made):
        assert namespace == NAMESPACE  # a Role: it grants nothing outside the release's namespace
        allowed = [
            r
            for r in role["rules"]
            if group in r["apiGroups"]
            and resource in r["resources"]
            and verb in r["verbs"]
            and ("resourceNames" not in r or name in r["resourceNames"])
        ]
        assert allowed, f"the Role does not allow {verb} on {resource} {name}"
    scale_rules = [r for r in role["rules"] if "deployments/scale" in r["resources"]]
    assert scale_rules and all(set(r["resourceNames"]) == names for r in scale_rules)

    binding = find(docs, "RoleBinding", f"{PREFIX}-conductor")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": f"{PREFIX}-conductor",
    }
    account = conductor_pod(docs)["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    find(docs, "ServiceAccount", account)


def test_planner_act_renders_the_mode_its_interval_and_its_bounds():
    args = flags(
        conductor_container(
            render(*ACT, "--set", "conductor.plannerIntervalSeconds=45", "--set", "conductor.plannerMaxDecode=24")
        )
    )
    assert args["--planner"] == "act"
    assert args["--planner-interval"] == "45"
    assert (args["--planner-min-prefill"], args["--planner-max-prefill"]) == ("1", "16")
    assert (args["--planner-min-decode"], args["--planner-max-decode"]) == ("1", "24")


def test_planner_off_by_default_renders_no_planner_flags():
    args = flags(conductor_container(render()))
    assert not [name for name in args if name.startswith("--planner")]


def test_a_bare_off_in_a_values_file_reads_as_false_and_still_means_off(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("conductor:\n  planner: off\n")  # YAML 1.1: a boolean
    args = flags(conductor_container(render("-f", str(values))))
    assert not [name for name in args if name.startswith("--planner")]


def test_planner_advise_renders_beside_the_pools_hpas():
    docs = render(
        "--set",
        "conductor.planner=advise",
        "--set",
        "prefill.autoscaling.enabled=true",
        "--set",
        "decode.autoscaling.enabled=true",
    )
    assert flags(conductor_container(docs))["--planner"] == "advise"
    find(docs, "HorizontalPodAutoscaler", f"{PREFIX}-prefill")
    find(docs, "HorizontalPodAutoscaler", f"{PREFIX}-decode")


def test_planner_act_without_a_pool_provider_fails_with_a_message():
    out = helm_template("--set", "conductor.planner=act", "--set", "conductor.poolProvider=none")
    assert out.returncode != 0
    assert "conductor.planner=act scales the pools through the pool provider" in out.stderr
    assert "conductor.poolProvider=kubernetes" in out.stderr


def test_planner_act_beside_a_pools_hpa_fails_and_points_to_advise():
    for pool in ("prefill", "decode"):
        out = helm_template(*ACT, "--set", f"{pool}.autoscaling.enabled=true")
        assert out.returncode != 0, pool
        assert f"{pool}.autoscaling.enabled makes an HPA that would undo them" in out.stderr, pool
        assert "conductor.planner=advise" in out.stderr and "mooncake_planner_desired_instances" in out.stderr


def test_an_unknown_planner_mode_fails_with_a_message():
    out = helm_template("--set", "conductor.planner=bogus")
    assert out.returncode != 0
    assert 'conductor.planner must be off, act or advise, not "bogus"' in out.stderr


def test_planner_bounds_the_conductor_would_refuse_fail_the_render():
    out = helm_template(*ACT, "--set", "conductor.plannerMinDecode=5", "--set", "conductor.plannerMaxDecode=2")
    assert out.returncode != 0
    assert "conductor.plannerMinDecode (5) and conductor.plannerMaxDecode (2) must satisfy 1 <= min <= max" in (
        out.stderr
    )
    out = helm_template("--set", "conductor.planner=advise", "--set", "conductor.plannerIntervalSeconds=0")
    assert out.returncode != 0
    assert "conductor.plannerIntervalSeconds must be above 0" in out.stderr


def test_the_rendered_planner_args_parse_with_the_conductors_own_parser():
    from conductor.__main__ import parse_args, planner_config

    docs = render(*ACT, "--set", "conductor.plannerIntervalSeconds=12.5", "--set", "conductor.plannerMinPrefill=2")
    c = conductor_container(docs)
    assert c["args"][0] == "conductor"
    args = parse_args(expanded_args(docs, c))
    assert args.planner == "act"
    assert args.planner_interval == 12.5
    assert (args.planner_min_prefill, args.planner_max_prefill) == (2, 16)
    assert (args.planner_min_decode, args.planner_max_decode) == (1, 16)
    assert (args.pool_provider, args.namespace) == ("kubernetes", NAMESPACE)
    config = planner_config(args)  # what the Conductor builds from them at start, and refuses when inconsistent
    assert (config.interval_s, config.min_prefill, config.max_decode) == (12.5, 2, 16)
