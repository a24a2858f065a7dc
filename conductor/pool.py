"""Pool providers: how the Conductor adds and removes prefill and decode instances.

    mooncake pool scale decode 3  ->  Conductor.ScalePool(DECODE, 3)
        more than now: provider.add(role, n)             new workers register when ready
        fewer:         the least busy ones are drained   no new work; when idle (and nothing
                                                         was sent there lately) the provider
                                                         stops them: provider.remove(instance)

    local       the processes of ``mooncake up`` on this machine: the launcher's control
                endpoint (mooncake.cluster.control) starts and stops them
    kubernetes  the pools' Deployments, through the Kubernetes API: ``add`` raises the
                replicas; ``remove`` marks the drained pod cheapest to delete
                (controller.kubernetes.io/pod-deletion-cost) and lowers the replicas by
                one, so the ReplicaSet removes that pod and no other
    none        scaling is refused with a clear error

A stopped worker deregisters itself on SIGTERM (after finishing what it runs); the
Conductor never deregisters it first, or its next heartbeat would register it again.
"""

from __future__ import annotations

import abc
import json
import logging
import urllib.error
import urllib.request

from conductor.types import Instance, Role
from mooncake import tls

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class PoolProvider(abc.ABC):
    kind: str

    @abc.abstractmethod
    def add(self, role: Role, count: int) -> list[str]:
        """Start ``count`` more instances of ``role``; return their names (they register once ready)."""

    @abc.abstractmethod
    def remove(self, inst: Instance) -> None:
        """Stop ``inst`` (drained and idle). Raises RuntimeError if it cannot."""


class NoProvider(PoolProvider):
    kind = "none"

    def add(self, role: Role, count: int) -> list[str]:
        raise ValueError("this Conductor has no pool provider: start it with --pool-provider local or kubernetes")

    def remove(self, inst: Instance) -> None:
        raise ValueError("this Conductor has no pool provider: a drained instance stays until it is stopped by hand")


class LocalProvider(PoolProvider):
    """The launcher of ``mooncake up``, through its control endpoint (an HTTP URL on this machine)."""

    kind = "local"

    def __init__(self, control_url: str, timeout_s: float = 300.0) -> None:
        self.control_url = control_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"{self.control_url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            ident = tls.identity()
            context = ident.https_context if ident is not None and self.control_url.startswith("https:") else None
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=context) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"the launcher refused {path}: {e.read().decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"the launcher at {self.control_url} does not answer: {e}") from None

    def add(self, role: Role, count: int) -> list[str]:
        return self._post("/add", {"role": role.value, "count": count})["started"]

    def remove(self, inst: Instance) -> None:
        self._post("/remove", {"id": inst.id})


class KubernetesProvider(PoolProvider):
    """The pools' Deployments in ``namespace``; instance ids are pod names (the chart passes ``--id $(POD_NAME)``)."""

    kind = "kubernetes"

    def __init__(self, namespace: str, deployments: dict[Role, str], api=None) -> None:
        self.namespace = namespace
        self.deployments = deployments
        self._api = api  # (AppsV1Api, CoreV1Api); built on first use from the in-cluster or local config

    def _clients(self):
        if self._api is None:
            try:
                from kubernetes import client, config
            except ImportError:
                raise RuntimeError(
                    "the kubernetes provider needs the `kubernetes` package (pip install kubernetes)"
                ) from None
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    config.load_kube_config()
                except (config.ConfigException, OSError) as e:
                    raise RuntimeError(
                        f"no Kubernetes API to scale with (neither in-cluster config nor a kubeconfig): {e}"
                    ) from None
            self._api = (client.AppsV1Api(), client.CoreV1Api())
        return self._api

    def _guarded(self, what: str, fn):
        try:
            return fn()
        except (RuntimeError, ValueError):
            raise
        except Exception as e:  # the client's ApiException, connection errors: the provider failed, say why
            raise RuntimeError(f"kubernetes: {what} failed: {e}") from None

    def _deployment(self, role: Role) -> str:
        name = self.deployments.get(role)
        if not name:
            raise ValueError(f"no Deployment is configured for the {role.value} pool")
        return name

    def _scale_by(self, role: Role, delta: int) -> int:
        apps, _ = self._clients()
        name = self._deployment(role)
        scale = apps.read_namespaced_deployment_scale(name, self.namespace)
        replicas = max(0, scale.spec.replicas + delta)
        apps.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": replicas}})
        return replicas

    def add(self, role: Role, count: int) -> list[str]:
        replicas = self._guarded(f"scaling {role.value} up", lambda: self._scale_by(role, count))
        return [f"{self._deployment(role)} replicas -> {replicas}"]

    def remove(self, inst: Instance) -> None:
        def remove() -> None:
            _, core = self._clients()
            core.patch_namespaced_pod(
                inst.id, self.namespace, {"metadata": {"annotations": {DELETION_COST: "-1000000"}}}
            )
            self._scale_by(inst.role, -1)

        self._guarded(f"removing {inst.id}", remove)


def make_provider(
    kind: str, control_url: str | None = None, namespace: str = "default", deployments: dict[Role, str] | None = None
) -> PoolProvider:
    if kind == "none":
        return NoProvider()
    if kind == "local":
        if not control_url:
            raise ValueError("--pool-provider local needs --pool-control (the launcher's control URL)")
        return LocalProvider(control_url)
    if kind == "kubernetes":
        return KubernetesProvider(namespace, deployments or {})
    raise ValueError(f"unknown pool provider {kind!r}; choose from none, local, kubernetes")
