"""Who may change the cluster (conductor.auth): the operator credential and each registration's own token, on a
real Conductor process, and the operator CLI that carries the credential."""

from __future__ import annotations

import grpc
import pytest
from kvnodes import start_conductor
from typer.testing import CliRunner

from conductor.auth import bearer, write_token_file
from mooncake import tls
from mooncake.cli.pool_cmd import app as pool_app
from protos import conductor_pb2 as pb
from protos import conductor_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A Conductor with an operator token: (its stub, the token, the token file, its address)."""
    path = tmp_path_factory.mktemp("auth") / "operator-token"
    token = write_token_file(path)
    node = start_conductor("--operator-token-file", str(path))
    address = node.info["grpc"]
    yield pb_grpc.ConductorStub(tls.grpc_channel(address)), token, path, address
    node.stop()
    assert token not in node.log.read_text()  # never logged


def register(stub, instance_id: str) -> bytes:
    r = stub.Register(
        pb.RegisterRequest(id=instance_id, role=pb.DECODE, address=f"10.0.0.9:{len(instance_id)}", node=instance_id),
        timeout=5,
    )
    assert len(r.instance_token) == 16
    return r.instance_token


def code_of(call) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return None


def test_admin_calls_need_the_operator_credential(guarded):
    stub, token, _, _ = guarded
    listing = stub.ListInstances(pb.ListInstancesRequest(), timeout=5)  # reading is open
    assert listing.admin_open is False
    register(stub, "d-admin")
    calls = {
        "Drain": lambda md: stub.Drain(pb.DrainRequest(id="d-admin"), metadata=md, timeout=5),
        "SetPolicy": lambda md: stub.SetPolicy(pb.SetPolicyRequest(policy="least_loaded"), metadata=md, timeout=5),
        "ScalePool": lambda md: stub.ScalePool(pb.ScalePoolRequest(role=pb.DECODE, replicas=1), metadata=md, timeout=5),
    }
    for name, call in calls.items():
        assert code_of(lambda: call(())) is grpc.StatusCode.UNAUTHENTICATED, name
        assert code_of(lambda: call(bearer("x" * 43))) is grpc.StatusCode.PERMISSION_DENIED, name
        assert code_of(lambda: call((("authorization", f"Basic {token}"),))) is grpc.StatusCode.PERMISSION_DENIED, name
    assert stub.ListInstances(pb.ListInstancesRequest(), timeout=5).policy != "least_loaded"  # nothing changed
    assert (
        stub.SetPolicy(pb.SetPolicyRequest(policy="least_loaded"), metadata=bearer(token), timeout=5).policy
        == "least_loaded"
    )
    assert stub.Drain(pb.DrainRequest(id="d-admin"), metadata=bearer(token), timeout=5).state == pb.DRAINING
    stub.SetPolicy(pb.SetPolicyRequest(policy="kvcache_centric"), metadata=bearer(token), timeout=5)


def test_an_instance_deregisters_itself_with_its_token_and_nobody_else_can(guarded):
    stub, token, _, _ = guarded
    mine, theirs = register(stub, "d-mine"), register(stub, "d-theirs")
    ids = lambda: {i.id for i in stub.ListInstances(pb.ListInstancesRequest(), timeout=5).instances}

    def deregister(iid, t=b"", md=()):
        return stub.Deregister(pb.DeregisterRequest(id=iid, instance_token=t), metadata=md, timeout=5)

    assert code_of(lambda: deregister("d-mine")) is grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: deregister("d-mine", theirs)) is grpc.StatusCode.UNAUTHENTICATED  # another instance's token
    assert {"d-mine", "d-theirs"} <= ids()
    deregister("d-mine", mine)
    assert "d-mine" not in ids()
    again = register(stub, "d-theirs")  # registering again issues a new token: the old one is worth nothing
    assert again != theirs
    assert code_of(lambda: deregister("d-theirs", theirs)) is grpc.StatusCode.UNAUTHENTICATED
    deregister("d-theirs", md=bearer(token))  # the operator may deregister anyone
    assert "d-theirs" not in ids()


def test_the_cli_carries_the_credential_from_its_file(guarded, tmp_path, monkeypatch):
    stub, _, path, address = guarded
    register(stub, "d-cli")
    monkeypatch.setattr("mooncake.cli.pool_cmd.CURRENT", tmp_path / "none.json")  # no `mooncake up` here
    monkeypatch.delenv("MOONCAKE_OPERATOR_TOKEN_FILE", raising=False)
    refused = CliRunner().invoke(pool_app, ["drain", "d-cli", "--conductor", address, "--keep"])
    assert refused.exit_code == 1 and "needs the operator credential" in refused.output
    done = CliRunner().invoke(
        pool_app, ["drain", "d-cli", "--conductor", address, "--keep", "--operator-token-file", str(path)]
    )
    assert done.exit_code == 0 and "d-cli: draining" in done.output
    monkeypatch.setenv("MOONCAKE_OPERATOR_TOKEN_FILE", str(path))  # as kubectl reads KUBECONFIG
    assert CliRunner().invoke(pool_app, ["drain", "d-cli", "--conductor", address, "--keep"]).exit_code == 0


def test_without_a_token_admin_calls_are_open_and_the_conductor_says_so():
    node = start_conductor()
    try:
        stub = pb_grpc.ConductorStub(tls.grpc_channel(node.info["grpc"]))
        assert stub.ListInstances(pb.ListInstancesRequest(), timeout=5).admin_open is True
        register(stub, "d-open")
        assert stub.Drain(pb.DrainRequest(id="d-open"), timeout=5).state == pb.DRAINING
    finally:
        node.stop()
    assert "no operator token" in node.log.read_text()
