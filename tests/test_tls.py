"""Only the cluster's own components get in (issue 21): mutual TLS on every port, and slot capabilities on the pool.

Real processes on loopback: a Conductor, a pool node and a worker started with the test
session's certificates (tests/conftest.py), called by clients that hold no certificate,
or one from another CA; and a component with the certificate reading slots it was not
granted. What a user would notice: calls refused, nothing registered, no byte read or
written.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys

import grpc
import pytest
from kvnodes import REPO, start_conductor, start_node

from kvstore.client import KVStoreClient
from mooncake import tls
from mooncake.runtime.framed import REQUEST as CONTROL_REQUEST
from protos import conductor_pb2 as cpb
from protos import conductor_pb2_grpc as cpb_grpc
from protos import kvstore_pb2 as kpb
from transfer import MemoryRegistry, Segment, Slice, TransferConfig, TransferEngine, TransferError
from transfer.tcp import REQUEST as TRANSFER_REQUEST

BLOCK = 4096
needs_tls = pytest.mark.skipif(not os.environ.get(tls.ENV_DIR), reason="the suite runs with MOONCAKE_TEST_INSECURE=1")
KEYS = [bytes([i]) * 16 for i in range(1, 5)]


@pytest.fixture(scope="module")
def node():
    n = start_node("kv-secure", BLOCK, 32)
    yield n
    n.stop()


@pytest.fixture(scope="module")
def conductor():
    c = start_conductor("--heartbeat-timeout", "60")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stranger_identity(tmp_path_factory):
    """A valid-looking certificate for "mooncake", from a CA that is not the cluster's."""
    return tls.generate(tmp_path_factory.mktemp("other-ca"))


def _control_target(node) -> tuple[str, int]:
    host, _, port = node.info["control"].rpartition(":")
    return host, int(port)


def _tcp_target(node) -> tuple[str, int]:
    host, _, port = node.info["tcp"].rpartition(":")
    return host, int(port)


def _plain_exchange(address: tuple[str, int], payload: bytes) -> bytes:
    """Send ``payload`` on a plain tcp connection and return whatever comes back before the peer hangs up."""
    chunks = []
    with socket.create_connection(address, timeout=5) as s:
        s.settimeout(10)
        try:
            s.sendall(payload)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, BrokenPipeError):
            pass  # refused: the server closed on us
    return b"".join(chunks)


def _tls_exchange(address: tuple[str, int], payload: bytes, ctx: ssl.SSLContext) -> bytes:
    with socket.create_connection(address, timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=tls.SERVER_NAME) as s:
            s.settimeout(10)
            s.sendall(payload)
            return s.recv(65536)


def _no_cert_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _stats_frame() -> bytes:
    body = kpb.StatsRequest().SerializeToString()
    return CONTROL_REQUEST.pack(8, 0, len(body)) + body  # method 8: Stats (kvstore/control.py)


def _read_frame(segment: str, offset: int, length: int) -> bytes:
    name = segment.encode()
    return TRANSFER_REQUEST.pack(1, len(name), 0, 7, offset, length) + name  # op 1: READ


# -- the certificates -------------------------------------------------------------------------


def test_generate_writes_a_ca_and_a_certificate_it_signed_with_private_keys(tmp_path):
    ident = tls.generate(tmp_path / "tls")
    for name in ("ca.key", "tls.key"):
        assert os.stat(tmp_path / "tls" / name).st_mode & 0o777 == 0o600
    from cryptography import x509

    ca = x509.load_pem_x509_certificate(ident.ca)
    cert = x509.load_pem_x509_certificate(ident.cert)
    cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == [tls.SERVER_NAME]
    again = tls.generate(tmp_path / "tls")  # a second start keeps the cluster's CA
    assert again.ca == ident.ca and again.cert == ident.cert


def test_a_directory_without_the_files_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tls.key"):
        tls.Identity.load(tmp_path)


# -- refused at the handshake ------------------------------------------------------------------


@needs_tls
def test_the_conductor_refuses_a_caller_without_the_cluster_certificate(conductor, stranger_identity):
    plain = cpb_grpc.ConductorStub(grpc.insecure_channel(conductor.grpc))
    with pytest.raises(grpc.RpcError) as e:
        plain.ListInstances(cpb.ListInstancesRequest(), timeout=5)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE

    creds = grpc.ssl_channel_credentials(stranger_identity.ca, stranger_identity.key, stranger_identity.cert)
    other_ca = grpc.secure_channel(conductor.grpc, creds, options=[("grpc.ssl_target_name_override", tls.SERVER_NAME)])
    with pytest.raises(grpc.RpcError) as e:
        cpb_grpc.ConductorStub(other_ca).ListInstances(cpb.ListInstancesRequest(), timeout=5)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE

    listing = cpb_grpc.ConductorStub(tls.grpc_channel(conductor.grpc)).ListInstances(
        cpb.ListInstancesRequest(), timeout=5
    )
    assert listing.insecure is False  # `mooncake status` would say INSECURE otherwise


@needs_tls
def test_a_fake_worker_without_the_certificate_cannot_register(conductor):
    """Our own client code, run in a process without MOONCAKE_TLS_DIR, as a stranger on the host would run it."""
    script = (
        "import grpc, sys\n"
        "from mooncake import tls\n"
        "from protos import conductor_pb2 as pb, conductor_pb2_grpc as pbg\n"
        f"stub = pbg.ConductorStub(tls.grpc_channel({conductor.grpc!r}))\n"
        "try:\n"
        "    stub.Register(pb.RegisterRequest(id='evil-decode', role=pb.DECODE, address='127.0.0.1:9', node='x', "
        "capacity=64), timeout=5)\n"
        "except grpc.RpcError as e:\n"
        "    print('refused', e.code().name); sys.exit(0)\n"
        "print('registered')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != tls.ENV_DIR}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "refused UNAVAILABLE", out.stdout + out.stderr
    assert "INSECURE" in out.stderr  # the stranger's own process said how it ran
    listing = cpb_grpc.ConductorStub(tls.grpc_channel(conductor.grpc)).ListInstances(
        cpb.ListInstancesRequest(), timeout=5
    )
    assert "evil-decode" not in {i.id for i in listing.instances}


@needs_tls
def test_a_pool_node_refuses_strangers_on_grpc_control_and_transfer_ports(node, stranger_identity):
    # gRPC
    with pytest.raises(grpc.RpcError) as e:
        grpc.insecure_channel(node.grpc).unary_unary(
            "/mooncake.kvstore.KVStore/Stats",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=kpb.StatsResponse.FromString,
        )(kpb.StatsRequest(), timeout=5)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    # the framed control port: a well-formed Stats call in the clear gets no answer
    assert _plain_exchange(_control_target(node), _stats_frame()) == b""
    # the transfer port: a well-formed read of the whole DRAM segment in the clear gets not one byte
    segment = "kv-secure/dram"
    assert _plain_exchange(_tcp_target(node), _read_frame(segment, 0, 32 * BLOCK)) == b""
    # TLS without a client certificate, and with another CA's certificate: refused in the handshake
    for target in (_control_target(node), _tcp_target(node)):
        with pytest.raises(ssl.SSLError):
            _tls_exchange(target, _stats_frame(), _no_cert_context())
        with pytest.raises(ssl.SSLError):
            _tls_exchange(target, _stats_frame(), stranger_identity.client_context)
    # the cluster's own client still works
    with KVStoreClient(node.grpc) as client:
        assert client.stats().node == "kv-secure"


@needs_tls
def test_a_worker_refuses_a_caller_without_the_certificate(tmp_path, tiny_dir):
    """A prefill worker's gRPC port: Prefill from a stranger never reaches the engine. And a decode worker's
    landing slots take writes only under the grant of a running Prefill call, even from a holder of the
    certificate (this test process)."""
    from clusters import instances, start_cluster

    from protos import worker_pb2 as wpb

    cluster = start_cluster(tiny_dir, tmp_path, gateway=False)
    try:
        worker = instances(cluster)["prefill-0"]
        call = grpc.insecure_channel(worker.address).unary_unary(
            "/mooncake.worker.Prefill/Prefill",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=wpb.PrefillResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            call(wpb.PrefillRequest(request_id="stranger"), timeout=5)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        decode = cluster.components["decode-0"].info
        landing = Segment(
            name=decode["landing"], node="decode-0", size=BLOCK, host="elsewhere", pid=0, tcp_addr=decode["tcp"]
        )
        engine = TransferEngine(TransferConfig(node="writer", backend="tcp", serve=False), MemoryRegistry())
        try:
            engine.add_segment(landing)
            for token in ("", "0" * 32):
                with pytest.raises(TransferError, match="no live landing grant"):
                    engine.write(bytes(BLOCK), [Slice(0, landing.name, 0, BLOCK, token)]).wait(10)
        finally:
            engine.close()
    finally:
        cluster.stop()


# -- a component with the certificate still reads only what it was granted -------------------------


def test_slots_are_read_and_written_only_under_the_lease_or_reservation_that_granted_them(node):
    data = b"".join(bytes([i]) * BLOCK for i in range(1, 5))
    engine = TransferEngine(TransferConfig(node="intruder", backend="tcp", serve=False), MemoryRegistry())
    with KVStoreClient(node.grpc, engine=engine) as client:
        client.put(KEYS, data)
        got = client.get_locations(KEYS[:2])  # a lease on the first two blocks
        seg = client._segment(got.segment)
        slot_of = {bytes(s.key): s.offset for s in got.slots}
        other = client.get_locations(KEYS[2:])
        other_offsets = [s.offset for s in other.slots]
        client.release(other.lease_id)
        out = bytearray(BLOCK)

        def read(offset: int, token: str) -> bytes:
            engine.read(out, [Slice(0, seg.name, offset, BLOCK, token)]).wait(10)
            return bytes(out)

        assert read(slot_of[KEYS[0]], got.lease_id) == bytes([1]) * BLOCK  # granted: the bytes
        with pytest.raises(TransferError, match="refused: no live lease"):
            read(other_offsets[0], "")  # no token at all
        with pytest.raises(TransferError, match="not all held by that lease"):
            read(other_offsets[0], got.lease_id)  # a real lease, on other slots
        with pytest.raises(TransferError, match="refused: no live lease"):
            read(other_offsets[0], other.lease_id)  # a lease already released
        last = max(slot_of.values())  # a read that starts in a leased block and runs on past the lease's slots
        if last + BLOCK not in slot_of.values() and last + 2 * BLOCK <= 32 * BLOCK:
            with pytest.raises(TransferError, match="not all held by that lease"):
                engine.read(bytearray(2 * BLOCK), [Slice(0, seg.name, last, 2 * BLOCK, got.lease_id)]).wait(10)
        # a write needs a reservation of the slot: a lease does not do, and the block keeps its bytes
        with pytest.raises(TransferError, match="refused: no live reservation"):
            engine.write(bytes(BLOCK), [Slice(0, seg.name, slot_of[KEYS[1]], BLOCK, got.lease_id)]).wait(10)
        assert client.get(KEYS[1:2]).data.tobytes() == bytes([2]) * BLOCK
        client.release(got.lease_id)
        with pytest.raises(TransferError, match="refused"):  # released: the lease no longer reads
            read(slot_of[KEYS[0]], got.lease_id)
    engine.close()


def test_an_insecure_conductor_says_so_in_its_log_and_in_mooncake_status(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from mooncake.cli.main import app

    monkeypatch.delenv(
        tls.ENV_DIR, raising=False
    )  # the Conductor, and this process's clients, run without certificates
    monkeypatch.setattr("mooncake.cli.pool_cmd.CURRENT", tmp_path / "none.json")
    node = start_conductor()
    try:
        listing = cpb_grpc.ConductorStub(tls.grpc_channel(node.grpc)).ListInstances(
            cpb.ListInstancesRequest(), timeout=5
        )
        assert listing.insecure is True
        shown = CliRunner().invoke(app, ["status", "--conductor", node.grpc])
        assert shown.exit_code == 0 and "INSECURE: no TLS between the components" in shown.output
    finally:
        node.stop()
    assert "INSECURE" in node.log.read_text()


def test_a_stage_inbox_takes_writes_only_with_its_groups_token():
    """What a pipelined group's stage server checks on every write into its inbox (the tcp path between stage
    hosts; tests/test_cpp_hosts.py runs the group across hosts with it)."""
    from prefill.stage_process import _inbox_guard, inbox_token

    key, other = os.urandom(16), os.urandom(16)
    guard = _inbox_guard(inbox_token(key))
    assert guard(inbox_token(key), True, 0, 4096) is None
    good = inbox_token(key)
    for token in ("", inbox_token(other), good[:-1] + ("1" if good[-1] == "0" else "0")):
        assert guard(token, True, 0, 4096) == "not a stage of this group"


@needs_tls
def test_refused_peers_are_logged_once_a_minute_not_once_a_connection(shm_dir):
    n = start_node("kv-noisy", BLOCK, 4, shm_dir=shm_dir)
    try:
        for _ in range(5):  # a scanner knocking
            _plain_exchange(_control_target(n), _stats_frame())
    finally:
        n.stop()
    log = n.proc.stderr.read()
    assert log.count("refused a connection") == 1, log
