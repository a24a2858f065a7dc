"""Pool providers. The local one is tested for real in test_pool_scaling.py; the kubernetes one as far as this
machine allows: no API server runs here, so its calls go to a recording stand-in of the two API objects it uses
(AppsV1Api, CoreV1Api), and against the real `kubernetes` client only the missing-cluster error is checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conductor.pool import DELETION_COST, KubernetesProvider, LocalProvider, NoProvider, make_provider
from conductor.types import Instance, Role


class FakeApps:
    """read/patch of a Deployment's scale subresource, as AppsV1Api has them."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = replicas
        self.calls: list[tuple] = []

    def read_namespaced_deployment_scale(self, name, namespace):
        self.calls.append(("read_scale", name, namespace))
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas[name]))

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.calls.append(("patch_scale", name, namespace, body))
        self.replicas[name] = body["spec"]["replicas"]


class FakeCore:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def patch_namespaced_pod(self, name, namespace, body):
        self.calls.append(("patch_pod", name, namespace, body))


def provider() -> tuple[KubernetesProvider, FakeApps, FakeCore]:
    apps, core = FakeApps({"mc-prefill": 2, "mc-decode": 3}), FakeCore()
    p = KubernetesProvider("serving", {Role.PREFILL: "mc-prefill", Role.DECODE: "mc-decode"}, api=(apps, core))
    return p, apps, core


def test_kubernetes_add_raises_the_deployments_replicas():
    p, apps, _ = provider()
    assert p.add(Role.DECODE, 2) == ["mc-decode replicas -> 5"]
    assert apps.replicas == {"mc-prefill": 2, "mc-decode": 5}
    assert apps.calls[-1] == ("patch_scale", "mc-decode", "serving", {"spec": {"replicas": 5}})


def test_kubernetes_remove_marks_the_drained_pod_cheapest_then_scales_down_by_one():
    p, apps, core = provider()
    pod = Instance("mc-prefill-7d9c-x2x", Role.PREFILL, "10.1.2.3:7000", node="mc-prefill-7d9c-x2x")
    p.remove(pod)
    assert core.calls == [
        ("patch_pod", "mc-prefill-7d9c-x2x", "serving", {"metadata": {"annotations": {DELETION_COST: "-1000000"}}})
    ]
    assert apps.replicas["mc-prefill"] == 1  # the ReplicaSet removes the cheapest pod: the drained one
    assert [c[0] for c in apps.calls] == ["read_scale", "patch_scale"]


def test_kubernetes_without_a_deployment_for_the_role_is_a_clear_error():
    p = KubernetesProvider("serving", {Role.PREFILL: "mc-prefill"}, api=(FakeApps({"mc-prefill": 1}), FakeCore()))
    with pytest.raises(ValueError, match="no Deployment is configured for the decode pool"):
        p.add(Role.DECODE, 1)


def test_kubernetes_with_no_cluster_reachable_fails_with_the_clients_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))  # the real client: no in-cluster config, no kubeconfig
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    p = make_provider("kubernetes", namespace="serving", deployments={Role.DECODE: "mc-decode"})
    with pytest.raises(RuntimeError, match="no Kubernetes API"):
        p.add(Role.DECODE, 1)


def test_local_provider_reports_a_launcher_that_does_not_answer():
    from mooncake.localproc import free_port

    p = LocalProvider(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    with pytest.raises(RuntimeError, match="does not answer"):
        p.add(Role.DECODE, 1)


def test_provider_choice_and_no_provider():
    assert isinstance(make_provider("none"), NoProvider)
    with pytest.raises(ValueError, match="needs --pool-control"):
        make_provider("local")
    with pytest.raises(ValueError, match="unknown pool provider"):
        make_provider("nomad")
    with pytest.raises(ValueError, match="no pool provider"):
        NoProvider().add(Role.DECODE, 1)
