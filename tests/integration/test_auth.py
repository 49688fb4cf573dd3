"""Who may talk to a sender (docs/security.md): the shared token on every RPC, mutual TLS, TCP
refused without either, the unix socket's mode whatever the umask, and shm paths a client names.

The whole suite runs with a token (tests/conftest.py); here the token is wrong or missing.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import queue
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import TinyNet, digests, socket_dir, step, sync_in_thread
from weightsync.control.auth import MISSING_TOKEN, WRONG_TOKEN
from weightsync.errors import ConfigError, TransportError
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher, Sender
from weightsync.transports import shm
from weightsync.v1 import weightsync_pb2 as pb
from weightsync.v1 import weightsync_pb2_grpc as pb_grpc

TOKEN = os.environ["WEIGHTSYNC_TOKEN"]
BIN = os.path.dirname(sys.executable)


@pytest.fixture
def tcp_sender():
    with Sender("127.0.0.1:0", bucket_size_bytes=4096, ack_timeout_s=20) as s:
        yield s


def _calls(stub: pb_grpc.WeightSyncStub, metadata):
    """One call of every RPC, each run to its first reply (or its error)."""
    hello = pb.PublisherMessage(hello=pb.PublisherHello(publisher_id="intruder", device="cpu"))
    rhello = pb.ReceiverMessage(hello=pb.ReceiverHello(receiver_id="intruder", device="cpu"))
    return {
        "Publish": lambda: next(stub.Publish(iter([hello]), metadata=metadata, timeout=10)),
        "Receive": lambda: next(stub.Receive(iter([rhello]), metadata=metadata, timeout=10)),
        "Status": lambda: stub.Status(pb.StatusRequest(), metadata=metadata, timeout=10),
        "WaitApplied": lambda: stub.WaitApplied(
            pb.WaitAppliedRequest(version=1, timeout_s=1), metadata=metadata, timeout=10
        ),
    }


@pytest.mark.parametrize(
    "metadata, message",
    [
        ((), MISSING_TOKEN),
        ((("authorization", f"Bearer {TOKEN}x"),), WRONG_TOKEN),
        ((("authorization", TOKEN),), WRONG_TOKEN),  # no "Bearer " scheme
    ],
    ids=["missing", "wrong", "no-scheme"],
)
def test_every_rpc_without_the_token_is_unauthenticated(tcp_sender, metadata, message):
    with grpc.insecure_channel(tcp_sender.address) as channel:
        stub = pb_grpc.WeightSyncStub(channel)
        for rpc, call in _calls(stub, metadata).items():
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert (e.value.code(), e.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED,
                message,
            ), rpc
            assert TOKEN not in e.value.details()
        # Health stays open: clients probe it to find a live sender.
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="weightsync.v1.WeightSync"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # Nobody registered or published: the intruders left no trace.
    status = Publisher(tcp_sender.address).status()
    assert not status.receivers and not status.publishers


def test_the_right_token_applies_a_version_bit_exact(tcp_sender):
    model = TinyNet(seed=1)
    receiver = TorchReceiver(model, tcp_sender.address)
    t, applied = sync_in_thread(receiver)
    trainer = TinyNet(seed=2)
    step(trainer, 1)
    with Publisher(tcp_sender.address) as publisher:
        publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
    t.finish(30)
    assert applied == [1]
    assert digests(model) == digests(trainer)
    receiver.close()


def test_clients_with_a_wrong_token_are_told_how_to_fix_it(tcp_sender, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", "not-the-token")
    with Publisher(tcp_sender.address) as publisher:
        with pytest.raises(ConfigError, match="does not match this weightsync sender's"):
            publisher.publish(TinyNet().state_dict(), 1, timeout_s=10)
        with pytest.raises(ConfigError, match="^status of the sender at .*does not match"):
            publisher.status()
    with pytest.raises(TransportError, match="^register with the sender at .*does not match"):
        TorchReceiver(TinyNet(), tcp_sender.address)
    for command in (["status"], ["wait", "1", "--timeout-s", "5"]):
        out = subprocess.run(
            [f"{BIN}/weightsync", *command, "--address", tcp_sender.address],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ},
        )
        assert out.returncode == 2, out
        assert out.stderr.count("\n") == 1 and WRONG_TOKEN in out.stderr, out.stderr
        assert "not-the-token" not in out.stderr


def test_a_token_file_works_and_a_bad_one_is_named(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("file-token-123\n")
    monkeypatch.delenv("WEIGHTSYNC_TOKEN")
    monkeypatch.setenv("WEIGHTSYNC_TOKEN_FILE", str(token_file))
    with Sender("127.0.0.1:0") as s:
        assert s.protection == "token"
        assert Publisher(s.address).status().bucket_size_bytes > 0  # the client read the file
        monkeypatch.delenv("WEIGHTSYNC_TOKEN_FILE")
        with grpc.insecure_channel(s.address) as channel:
            auth = (("authorization", "Bearer file-token-123"),)
            pb_grpc.WeightSyncStub(channel).Status(pb.StatusRequest(), metadata=auth, timeout=10)
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError) as e:
        Sender("127.0.0.1:0", token_file=str(missing))
    assert str(e.value) == (
        f"WEIGHTSYNC_TOKEN_FILE={str(missing)!r} cannot be read (No such file or directory)"
    )
    with pytest.raises(ConfigError, match="both set; set only one"):
        Sender("127.0.0.1:0", token="a", token_file=str(token_file))
    with pytest.raises(ConfigError, match="^WEIGHTSYNC_TOKEN must be printable ASCII"):
        Sender("127.0.0.1:0", token="two words")


# ---- TCP without token or client certificates ---------------------------------------------


def test_tcp_without_token_or_tls_is_refused_unless_insecure(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_TOKEN")
    with pytest.raises(ConfigError) as e:
        Sender("127.0.0.1:0")
    assert str(e.value).startswith(
        "listen='127.0.0.1:0' is TCP with neither a token nor client certificates: anyone who "
        "reaches the port could publish into every engine; set WEIGHTSYNC_TOKEN"
    )
    with Sender("127.0.0.1:0", insecure=True) as s:
        assert s.protection == "INSECURE: no token, no TLS"
        assert Publisher(s.address).status().bucket_size_bytes > 0
    monkeypatch.setenv("WEIGHTSYNC_INSECURE", "1")
    with Sender("127.0.0.1:0") as s:
        assert Publisher(s.address).status().bucket_size_bytes > 0

    # The CLI: the same rule, one line, exit 2.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    out = subprocess.run(
        [f"{BIN}/weightsync-sender", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("weightsync-sender: error: listen='127.0.0.1:0' is TCP with")
    assert out.stderr.count("\n") == 1


# ---- mutual TLS ---------------------------------------------------------------------------


def _certificates(d) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM
    files in ``d``; returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def issue(cn, key, issuer, issuer_key, ca=False, san=None, usage=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(label: str, cert, key) -> None:
        paths[f"{label}_cert"] = str(d / f"{label}.crt")
        paths[f"{label}_key"] = str(d / f"{label}.key")
        (d / f"{label}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{label}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    paths: dict[str, str] = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("weightsync test CA", ca_key, name("weightsync test CA"), ca_key, ca=True)
    write("ca", ca, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = issue("sender", server_key, ca.subject, ca_key, san=san,
                   usage=ExtendedKeyUsageOID.SERVER_AUTH)  # fmt: skip
    write("server", server, server_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = issue("trainer", client_key, ca.subject, ca_key,
                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)  # fmt: skip
    write("client", client, client_key)
    return paths


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    certs = _certificates(tmp_path)
    monkeypatch.delenv("WEIGHTSYNC_TOKEN")  # TLS alone is enough
    with Sender(
        "127.0.0.1:0",
        bucket_size_bytes=4096,
        tls_cert=certs["server_cert"],
        tls_key=certs["server_key"],
        tls_ca=certs["ca_cert"],
    ) as s:
        assert s.protection == "mutual TLS"
        # Plaintext: no TLS handshake, nothing answers.
        with pytest.raises(TransportError) as e:
            Publisher(s.address, connect_timeout_s=2)
        assert str(e.value).startswith(f"no weightsync sender answers at {s.address}")
        assert str(e.value).endswith(
            "(a sender with TLS needs WEIGHTSYNC_TLS_CA here, and for mutual TLS "
            "WEIGHTSYNC_TLS_CERT and WEIGHTSYNC_TLS_KEY)"
        )
        # TLS, but without a client certificate: the handshake fails.
        monkeypatch.setenv("WEIGHTSYNC_TLS_CA", certs["ca_cert"])
        with pytest.raises(TransportError) as e:
            Publisher(s.address, connect_timeout_s=2)
        assert str(e.value).endswith("(or it does not accept this client's TLS certificate)")
        # With one: a version end to end, bit-exact.
        monkeypatch.setenv("WEIGHTSYNC_TLS_CERT", certs["client_cert"])
        monkeypatch.setenv("WEIGHTSYNC_TLS_KEY", certs["client_key"])
        model, trainer = TinyNet(seed=3), TinyNet(seed=4)
        receiver = TorchReceiver(model, s.address)
        t, applied = sync_in_thread(receiver)
        with Publisher(s.address) as publisher:
            publisher.publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        t.finish(30)
        assert applied == [1] and digests(model) == digests(trainer)
        receiver.close()


def test_tls_settings_that_do_not_fit_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_TOKEN")
    with pytest.raises(ConfigError, match="^TLS needs both --tls-cert and --tls-key"):
        Sender("127.0.0.1:0", tls_cert=str(tmp_path / "c.pem"))
    with pytest.raises(ConfigError) as e:
        Sender("127.0.0.1:0", tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem"))
    assert str(e.value).startswith(f"WEIGHTSYNC_TLS_KEY={str(tmp_path / 'k.pem')!r} cannot be")
    pytest.importorskip("cryptography")
    certs = _certificates(tmp_path)
    # TLS without a CA proves the sender to clients, not clients to the sender: not enough.
    with pytest.raises(ConfigError, match="neither a token nor client certificates"):
        Sender("127.0.0.1:0", tls_cert=certs["server_cert"], tls_key=certs["server_key"])


# ---- the unix socket ------------------------------------------------------------------------


def _connect_as_nobody(path: str, gid: int = 65534) -> str:
    """Connect to the unix socket ``path`` from a process running as uid 65534 (and ``gid``);
    returns "ok" or the error's name."""
    code = (
        "import os, socket, sys\n"
        f"os.setgroups([]); os.setgid({gid}); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        f"    s.connect({path!r}); print('ok')\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_unix_socket_is_0600_whatever_the_umask():
    with socket_dir() as d:
        os.chmod(d, 0o755)  # others may reach the directory: the socket's own mode must hold
        old = os.umask(0)
        try:
            sender = Sender(f"unix:{d}/s.sock")
        finally:
            os.umask(old)
        with sender:
            st = os.stat(f"{d}/s.sock")
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
            assert os.listdir(d) == ["s.sock"]  # the private directory it was bound in is gone
            assert sender.protection == "token, socket 0600"
            assert Publisher(sender.address).status().bucket_size_bytes > 0
            if os.geteuid() == 0:  # root may connect anywhere: another user must not
                assert _connect_as_nobody(f"{d}/s.sock") == "PermissionError"
        assert os.listdir(d) == []  # closed: the socket file is removed


def test_a_socket_group_may_connect(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip(
            "changing a socket's group to another and connecting as another user needs root"
        )
    import grp

    group = grp.getgrgid(65534)
    with socket_dir() as d:
        os.chmod(d, 0o755)
        old = os.umask(0)
        try:
            sender = Sender(f"unix:{d}/s.sock", socket_group=group.gr_name)
        finally:
            os.umask(old)
        with sender:
            st = os.stat(f"{d}/s.sock")
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, group.gr_gid)
            assert _connect_as_nobody(f"{d}/s.sock", gid=group.gr_gid) == "ok"
            assert _connect_as_nobody(f"{d}/s.sock", gid=0) == "PermissionError"
    with pytest.raises(ConfigError, match="^socket_group='no-such-group' is invalid"):
        Sender("unix:/tmp/ws-never.sock", socket_group="no-such-group")


# ---- shm paths a client names -----------------------------------------------------------------

ONE = pb.TensorSpec(name="w", dtype="float32", shape=[64])


def _offer(path: str) -> pb.BeginVersion:
    """A version whose only tensor the client offers at ``path``: the sender would pack it
    from there itself if it mapped it."""
    return pb.BeginVersion(
        manifest=pb.Manifest(version=1, tensors=[ONE]),
        sources=[pb.BufferHandle(buffer_id="hostile", nbytes=256, shm=pb.ShmHandle(path=path))],
        pieces=[
            pb.SourcePiece(
                name="w",
                source=0,
                offset=0,
                dtype="float32",
                size=[64],
                stride=[1],
                dst_start=[0],
            )
        ],  # fmt: skip
    )


def _first_request_after(address: str, begin: pb.BeginVersion) -> str:
    """Publish ``begin`` on a raw stream; returns the kind of the sender's first reply after
    its welcome."""
    auth = (("authorization", f"Bearer {TOKEN}"),)
    requests: queue.Queue = queue.Queue()
    requests.put(pb.PublisherMessage(hello=pb.PublisherHello(publisher_id="p", device="cpu")))
    requests.put(pb.PublisherMessage(begin=begin))
    with grpc.insecure_channel(address) as channel:
        replies = pb_grpc.WeightSyncStub(channel).Publish(
            iter(requests.get, None), metadata=auth, timeout=20
        )
        assert next(replies).WhichOneof("kind") == "welcome"
        kind = next(replies).WhichOneof("kind")
        replies.cancel()
    return kind


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


@pytest.mark.parametrize("case", ["symlink", "outside", "foreign", "fifo"])
def test_the_sender_never_maps_a_client_path_it_should_not(tcp_sender, tmp_path, case, caplog):
    victim = tmp_path / "victim"  # a file the client names; the sender must not read it
    victim.write_bytes(b"secret!!" * 32)
    path = {"outside": str(victim)}.get(case, f"{shm.SHM_DIR}/weightsync-test-{os.getpid()}")
    if case == "symlink":
        os.symlink(victim, path)
    elif case == "foreign":
        if os.geteuid() != 0:
            pytest.skip("a file of another user can be made only as root")
        with open(path, "wb") as f:
            f.write(bytes(256))
        os.chown(path, 65534, 65534)
    elif case == "fifo":
        os.mkfifo(path, 0o600)
    why = {
        "symlink": "it is a symbolic link",
        "outside": f"not a segment directly in {shm.SHM_DIR}",
        "foreign": f"owned by uid 65534, not by this process's uid {os.geteuid()}",
        "fifo": "not a regular file",
    }[case]
    try:
        with pytest.raises(TransportError) as e:
            shm.ShmTransport().map(_offer(path).sources[0])
        assert str(e.value).startswith(f"shared memory {path}: refused, {why}")
        # Through the sender: it never opens a path a client names (only descriptors the
        # client passes, tests/faults/test_shm_descriptors.py); it asks for packing.
        with caplog.at_level(logging.WARNING, logger="weightsync.sender"):
            assert _first_request_after(tcp_sender.address, _offer(path)) == "pack"
        assert f"shared memory {path}: not mapped, its open descriptor did not come" in caplog.text
        assert not _mapped(path) and not _mapped(str(victim))
    finally:
        if os.path.lexists(path) and path != str(victim):
            os.unlink(path)


def test_a_segment_the_publisher_made_is_packed_by_it_when_named_by_path_alone(tcp_sender):
    path = f"{shm.SHM_DIR}/weightsync-test-own-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 256)
        os.close(fd)
        assert shm.ShmTransport().map(_offer(path).sources[0]).numel() == 256
        # Over gRPC no descriptor can come with the begin: the publisher packs.
        assert _first_request_after(tcp_sender.address, _offer(path)) == "pack"
    finally:
        os.unlink(path)


def test_the_health_command_checks_a_tls_sender_over_tls(tmp_path):
    """`weightsync health` (the image's HEALTHCHECK) connects as every client does: over TLS
    when WEIGHTSYNC_TLS_CA is set, where a plaintext probe would call a healthy sender dead."""
    pytest.importorskip("cryptography")
    certs = _certificates(tmp_path)
    # The health service is open: the probe carries no token (the sender keeps its own).
    health = [str(Path(sys.executable).parent / "weightsync"), "health", "--timeout-s", "5"]
    with Sender(
        "127.0.0.1:0", bucket_size_bytes=4096, tls_cert=certs["server_cert"],
        tls_key=certs["server_key"],
    ) as s:  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
        env["WEIGHTSYNC_ADDRESS"] = s.address
        plain = subprocess.run(health, env=env, capture_output=True, text=True, timeout=60)
        assert plain.returncode == 1
        assert plain.stderr.strip().endswith("WEIGHTSYNC_TLS_CERT and WEIGHTSYNC_TLS_KEY)")
        env["WEIGHTSYNC_TLS_CA"] = certs["ca_cert"]
        tls = subprocess.run(health, env=env, capture_output=True, text=True, timeout=60)
        assert tls.returncode == 0, tls.stderr
        assert tls.stdout.strip() == f"serving: {s.address}"
