"""The chart's defences: NetworkPolicies that let in only each component's callers, read-only root filesystems,
the operator credential and the gateway's keys from Secrets (issue 21). Rendered with ``helm template``; no cluster."""

from __future__ import annotations

import base64
import json

import pytest
from charts import (
    CHART,
    PREFIX,
    RELEASE,
    VALUE_SETS,
    container,
    find,
    helm,
    mooncake_containers,
    pod_spec,
    render,
    run,
)

CALLERS = {  # who calls whom inside a release (the chart's NetworkPolicies must allow exactly this)
    "conductor": {"gateway", "prefill", "prefill-group", "decode"},
    "prefill": {"decode", "prefill", "prefill-group", "conductor"},
    "prefill-group": {"decode", "prefill", "prefill-group", "conductor"},
    "decode": {"gateway", "prefill", "prefill-group"},
    "redis": {"conductor"},
}


@pytest.mark.parametrize("values", ["default", "production"])
def test_network_policies_let_in_only_the_callers_and_only_the_gateway_from_outside(values):
    docs = render(*VALUE_SETS[values])
    policies = {
        d["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] == "NetworkPolicy"
    }
    pods = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    assert pods <= set(policies), f"pods without a policy: {pods - set(policies)}"
    for component, policy in policies.items():
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = policy["spec"]["ingress"]
        if component == "gateway":
            assert rules == [{"ports": [{"port": "http"}]}]  # anyone, on the API port only
            continue
        (inside, *metrics) = rules
        (peer,) = inside["from"]
        assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": RELEASE} and "ports" not in inside
        (expression,) = peer["podSelector"]["matchExpressions"]
        assert expression["key"] == "app.kubernetes.io/component" and set(expression["values"]) == CALLERS[component]
        if values == "production" and component != "redis":  # Prometheus, on the metrics ports alone
            (scrape,) = metrics
            assert scrape["from"] == [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ]
            assert {p["port"] for p in scrape["ports"]} <= {"metrics", "kv-metrics"}
        else:
            assert metrics == []


def test_the_gateway_and_the_conductor_run_on_a_read_only_root_filesystem_with_a_tmp_of_their_own():
    docs = render()
    for component in ("gateway", "conductor"):
        spec = pod_spec(docs, component)
        c = container(spec, component)
        assert (
            c["securityContext"]["readOnlyRootFilesystem"] is True
            and c["securityContext"]["allowPrivilegeEscalation"] is False
        )
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        assert {v["name"]: v for v in spec["volumes"]}["tmp"]["emptyDir"]
        assert spec["securityContext"]["runAsNonRoot"] is True
    for component in ("prefill", "decode"):  # the engine may compile its attention kernel into ~/.cache
        assert container(pod_spec(docs, component), component)["securityContext"]["readOnlyRootFilesystem"] is False


def test_the_conductor_has_an_operator_token_from_a_secret_mounted_read_only():
    docs = render()
    spec = pod_spec(docs, "conductor")
    c = container(spec, "conductor")
    assert {e["name"]: e.get("value") for e in c["env"]}[
        "MOONCAKE_OPERATOR_TOKEN_FILE"
    ] == "/etc/mooncake/operator/token"
    assert {"name": "operator", "mountPath": "/etc/mooncake/operator", "readOnly": True} in c["volumeMounts"]
    volume = {v["name"]: v for v in spec["volumes"]}["operator"]["secret"]
    assert volume["secretName"] == f"{PREFIX}-operator" and volume["items"] == [{"key": "token", "path": "token"}]
    assert volume["defaultMode"] == 0o400
    secret = find(docs, "Secret", f"{PREFIX}-operator")
    assert len(base64.b64decode(secret["data"]["token"])) == 48  # made by the chart: random, at least 16 characters
    assert all("operator" not in json.dumps(container(pod_spec(docs, other), other)) for other in ("gateway", "decode"))
    docs = render("--set", "conductor.operatorToken.existingSecret=ops")
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{PREFIX}-operator"]
    assert {v["name"]: v for v in pod_spec(docs, "conductor")["volumes"]}["operator"]["secret"]["secretName"] == "ops"


def test_tenants_come_from_a_secret_mounted_read_only_and_exclude_a_single_key():
    docs = render("--set", "gateway.tenants.existingSecret=mooncake-tenants")
    spec = pod_spec(docs, "gateway")
    gateway = container(spec, "gateway")
    assert "--tenants=/etc/mooncake/tenants/tenants.yaml" in gateway["args"]
    assert not any(a.startswith("--api-key") for a in gateway["args"])
    assert {"name": "tenants", "mountPath": "/etc/mooncake/tenants", "readOnly": True} in gateway["volumeMounts"]
    volume = {v["name"]: v for v in spec["volumes"]}["tenants"]["secret"]
    assert volume == {"secretName": "mooncake-tenants", "items": [{"key": "tenants.yaml", "path": "tenants.yaml"}]}
    out = run(
        helm(),
        "template",
        RELEASE,
        str(CHART),
        "--set",
        "gateway.tenants.existingSecret=t",
        "--set",
        "gateway.apiKey.value=k",
    )
    assert out.returncode != 0 and "exclusive" in out.stderr


def test_api_key_value_is_stored_in_a_secret():
    docs = render("--set", "gateway.apiKey.value=s3cret")
    secret = find(docs, "Secret", f"{PREFIX}-gateway")
    assert secret["stringData"] == {"api-key": "s3cret"}
    gateway = container(pod_spec(docs, "gateway"), "gateway")
    assert "s3cret" not in json.dumps(gateway)  # the pod reads it from the Secret
    assert {e["name"]: e for e in gateway["env"]}["MOONCAKE_API_KEY"]["valueFrom"]["secretKeyRef"][
        "name"
    ] == f"{PREFIX}-gateway"


def test_every_component_speaks_mutual_tls_with_the_certificates_the_chart_makes(tmp_path):
    """Each mooncake container gets MOONCAKE_TLS_DIR and the release's TLS Secret read-only; the CA and certificate
    the chart makes with genCA are ones mooncake.tls accepts: a handshake with them succeeds, one with another
    cluster's certificate does not."""
    import socket
    import ssl
    import threading

    from mooncake import tls
    from transfer.handshake import handshake as transfer_handshake

    docs = render()
    containers = mooncake_containers(docs)
    assert {component for component, _, _ in containers} >= {"conductor", "gateway", "prefill", "kvstore", "decode"}
    for component, c, spec in containers:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env.get("MOONCAKE_TLS_DIR") == "/etc/mooncake/tls", component
        assert {"name": "tls", "mountPath": "/etc/mooncake/tls", "readOnly": True} in c["volumeMounts"], component
        assert {v["name"]: v for v in spec["volumes"]}["tls"]["secret"]["secretName"] == f"{PREFIX}-tls"
    secret = find(docs, "Secret", f"{PREFIX}-tls")["data"]
    ours = tmp_path / "chart"
    ours.mkdir()
    for key in tls.FILES:
        (ours / key).write_bytes(base64.b64decode(secret[key]))

    def handshake(server_dir, client_dir) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        errors: list[BaseException] = []

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                transfer_handshake(conn, tls.Identity.load(server_dir).server_context, True, 5).close()
            except OSError as e:
                errors.append(e)

        t = threading.Thread(target=serve)
        t.start()
        try:
            client = socket.create_connection(listener.getsockname(), timeout=5)
            transfer_handshake(client, tls.Identity.load(client_dir).client_context, False, 5).close()
        finally:
            t.join(10)
            listener.close()
        if errors:
            raise errors[0]

    handshake(ours, ours)
    other = tls.generate(tmp_path / "other").directory
    with pytest.raises(ssl.SSLError):
        handshake(ours, other)

    docs = render("--set", "tls.enabled=false")
    assert not [d for d in docs if d["kind"] in ("Secret", "Certificate") and d["metadata"]["name"] == f"{PREFIX}-tls"]
    assert all("MOONCAKE_TLS_DIR" not in json.dumps(c) for _, c, _ in mooncake_containers(docs))
    docs = render("--set", "tls.existingSecret=mine")
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{PREFIX}-tls"]
    assert {v["name"]: v for v in pod_spec(docs, "conductor")["volumes"]}["tls"]["secret"]["secretName"] == "mine"
    docs = render("--set", "tls.certManager.enabled=true", "--set", "tls.certManager.issuerRef.name=cluster-ca")
    cert = find(docs, "Certificate", f"{PREFIX}-tls")["spec"]
    assert cert["secretName"] == f"{PREFIX}-tls" and cert["dnsNames"] == [tls.SERVER_NAME]
    assert {"server auth", "client auth"} <= set(cert["usages"])
