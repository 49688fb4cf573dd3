"""What the conformance tests share: the tensors they publish, the clients' processes
(each reading JSON lines from a client), the sender's process, waiting."""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROTO = REPO / "proto" / "weightsync" / "v1" / "weightsync.proto"
CLIENT = REPO / "tests" / "conformance" / "client.py"
NODE_DIR = REPO / "tests" / "conformance" / "node"
BUCKET_SIZE_BYTES = 4096
"""Small, so a few tensors make several buckets and one tensor is chunked."""

TENSORS = [
    {"name": "model.embed_tokens.weight", "dtype": "bfloat16", "shape": [40, 16]},
    {"name": "model.layers.0.mlp.router.weight", "dtype": "float32", "shape": [4, 16]},
    # 9600 bytes > the 4096-byte cap: three chunks of whole rows (42 + 42 + 16 rows).
    {"name": "model.layers.0.self_attn.qkv_proj.weight", "dtype": "float32", "shape": [100, 24]},
    {"name": "model.norm.bias", "dtype": "float32", "shape": [7]},
    {"name": "model.layers.0.mlp.experts.counts", "dtype": "int64", "shape": [5]},
    {"name": "model.step", "dtype": "int64", "shape": []},
    {"name": "lm_head.weight", "dtype": "bfloat16", "shape": [3, 5, 7]},
]


def clean_env() -> dict[str, str]:
    """The environment without Python paths or WEIGHTSYNC_* settings of the caller."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WEIGHTSYNC_", "PYTHON")) and k != "NODE_PATH"
    }


def token_env() -> dict[str, str]:
    """The session's sender token (tests/conftest.py), which every client must send."""
    return {"WEIGHTSYNC_TOKEN": os.environ["WEIGHTSYNC_TOKEN"]}


# ---- processes --------------------------------------------------------------------------------


class LineProcess:
    """A client process whose stdout is JSON lines, read on a thread."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)[-4000:]

    def next_event(self, event: str, timeout_s: float = 30.0) -> dict:
        """The next JSON line; it must be ``event``."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"{self.cmd[1:3]}: no {event!r} within {timeout_s} s; stderr:\n{self.stderr}"
            ) from None
        if line is None:
            self.proc.wait(5)
            raise AssertionError(
                f"{self.cmd[1:3]} exited ({self.proc.returncode}) before {event!r}; "
                f"stderr:\n{self.stderr}"
            )
        msg = json.loads(line)
        assert msg["event"] == event, f"expected {event!r}, got {msg}; stderr:\n{self.stderr}"
        return msg

    def close(self, timeout_s: float = 15.0) -> None:
        """Close stdin (the receivers then leave) and wait for the exit."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.cmd[1:3]} did not exit; stderr:\n{self.stderr}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Clients:
    """Runs ``client.py`` with a path of nothing but the generated stubs."""

    def __init__(self, stubs: Path, address: str) -> None:
        self.stubs, self.address = stubs, address
        self.env = (
            clean_env()
            | token_env()
            | {
                "PYTHONPATH": str(stubs),
                "PYTHONNOUSERSITE": "1",
                "PYTHONSAFEPATH": "1",  # the script's folder is not on the path either
            }
        )
        self._started: list[LineProcess] = []
        self._status_channel = None

    def _cmd(self, command: str, args: tuple[str, ...]) -> list[str]:
        if command == "checksum":
            return [sys.executable, str(CLIENT), command, *args]
        return [sys.executable, str(CLIENT), command, "--address", self.address, *args]

    def run(self, command: str, *args: str, stdin: str | None = None, timeout_s: float = 60):
        """Run a command to its end; its JSON lines."""
        done = subprocess.run(
            self._cmd(command, args),
            env=self.env,
            cwd=self.stubs,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, f"client {command} failed:\n{done.stderr[-4000:]}"
        return [json.loads(line) for line in done.stdout.splitlines()]

    def start(self, command: str, *args: str) -> LineProcess:
        p = LineProcess(self._cmd(command, args), self.env, self.stubs)
        self._started.append(p)
        return p

    def status(self) -> dict:
        """``Status`` as JSON-mapped (``MessageToDict``), asked from this process: polling
        through a client process would cost a Python start per poll."""
        import grpc
        from google.protobuf import json_format

        from weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc

        if self._status_channel is None:
            self._status_channel = grpc.insecure_channel(self.address)
        stub = weightsync_pb2_grpc.WeightSyncStub(self._status_channel)
        auth = [("authorization", f"Bearer {token_env()['WEIGHTSYNC_TOKEN']}")]
        reply = stub.Status(weightsync_pb2.StatusRequest(), timeout=10, metadata=auth)
        return json_format.MessageToDict(reply, preserving_proto_field_name=True)

    def kill_all(self) -> None:
        for p in self._started:
            p.kill()
        if self._status_channel is not None:
            self._status_channel.close()


class SenderProcess:
    def __init__(self, address: str, proc: subprocess.Popen, log: Path) -> None:
        self.address, self.proc, self.log = address, proc, log
        self._versions = itertools.count(1)

    def next_version(self) -> int:
        """Versions increase over the whole session: tests share the sender."""
        return next(self._versions)


def connected_receivers(clients: Clients) -> set[str]:
    return {r["receiver_id"] for r in clients.status().get("receivers", []) if r.get("connected")}


class NodeClients:
    def __init__(self, node_modules: Path, address: str) -> None:
        self.address = address
        self.env = clean_env() | token_env() | {"NODE_PATH": str(node_modules)}
        self.script = NODE_DIR / "client.js"
        self._started: list[LineProcess] = []

    def checksum(self, data: bytes) -> str:
        done = subprocess.run(
            ["node", str(self.script), "checksum"],
            input=data.hex(),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout)["value"]

    def start_receiver(self, receiver_id: str) -> LineProcess:
        cmd = ["node", str(self.script), "receive", "--proto", str(PROTO)]
        cmd += ["--address", self.address, "--receiver-id", receiver_id]
        p = LineProcess(cmd, self.env, NODE_DIR)
        self._started.append(p)
        return p

    def kill_all(self) -> None:
        for p in self._started:
            p.kill()


# The worked examples of docs/protocol.md ("Checksum"): its values must be what the
# implementation and both clients compute.
CHECKSUM_EXAMPLES = {
    "two 256-byte rows": bytes(range(256)) + bytes(range(255, -1, -1)),
    "a 64 KiB row and a 256-byte tail": bytes(i % 251 for i in range(65536 + 256)),
    "256 zero bytes": bytes(256),
    "empty": b"",
}


def implementation_checksum(data: bytes) -> str:
    import torch

    from weightsync.checksum import finish, row_sums

    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
    return f"{finish(row_sums(buffer.view(torch.uint8), len(data)), len(data)):#018x}"


# ---- the implementation's side of the tests (the test process may import weightsync) -------


def torch_tensors(seed: int) -> dict:
    """Tensors shaped as :data:`TENSORS`, with values from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in TENSORS:
        dtype = getattr(torch, spec["dtype"])
        shape = tuple(spec["shape"])
        if dtype.is_floating_point:
            out[spec["name"]] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[spec["name"]] = torch.randint(-(2**62), 2**62, shape, generator=g, dtype=dtype)
    return out


def raw_bytes(tensor) -> bytes:
    """The tensor's bytes in memory order (little-endian, row-major)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def num(message: dict, field: str) -> int:
    """An integer field of a JSON-mapped message (64-bit ones are strings; zeros are left out)."""
    return int(message.get(field, 0))


def receiver_status(status: dict, receiver_id: str) -> dict:
    return next(r for r in status.get("receivers", []) if r["receiver_id"] == receiver_id)


def version_status(status: dict, version: int) -> dict:
    return next(v for v in status.get("versions", []) if num(v, "version") == version)


def applied_alone(status: dict, rid: str, version: int) -> dict:
    """Asserts ``version`` is complete with ``rid`` its only receiver, applied; returns
    ``rid``'s receiver status."""
    me = receiver_status(status, rid)
    assert num(me, "applied_version") == version
    v = version_status(status, version)
    assert v["state"] == "complete"
    assert [(o["receiver_id"], o["state"]) for o in v["receivers"]] == [(rid, "applied")]
    return me


def assert_same_tensors(got: dict, want_hex: dict) -> None:
    """``got`` (a client's ``applied`` tensors) holds exactly ``want_hex``'s bytes."""
    assert set(got) == set(want_hex)
    for name, want in want_hex.items():
        assert got[name]["dtype"] == want["dtype"], name
        assert [int(d) for d in got[name]["shape"]] == list(want["shape"]), name
        assert got[name]["hex"] == want["hex"], f"{name}: bytes differ"


def expected_hex(tensors: dict) -> dict:
    return {
        name: {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "hex": raw_bytes(t).hex(),
        }
        for name, t in tensors.items()
    }
