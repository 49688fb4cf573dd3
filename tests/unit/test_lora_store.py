"""The vLLM LoRA directory is the engine user's alone, at a name no other user can take first,
and nothing there follows a planted link; adapter names that cannot be one file name are refused
at validation, before any write."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("safetensors")

from weightsync.errors import ConfigError, ManifestMismatchError  # noqa: E402
from weightsync.manifest import LoraAdapterSpec  # noqa: E402
from weightsync.receiver.vllm.lora_store import LoraStore, default_lora_dir  # noqa: E402

_TENSOR = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
_CONFIG = json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})


def _adapter(name: str = "policy") -> tuple[LoraAdapterSpec, dict[str, torch.Tensor]]:
    return LoraAdapterSpec(name, _CONFIG, (_TENSOR,)), {_TENSOR: torch.zeros(8, 16)}


@pytest.fixture
def victim(tmp_path):
    """A directory the engine must never delete or write into."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "marker").write_text("keep")
    return d


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """The shared temp dir, with no LoRA directory configured and no XDG runtime dir."""
    monkeypatch.delenv("WEIGHTSYNC_LORA_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def test_the_default_directory_is_made_fresh_private_and_inherited(shared_tmp):
    path = default_lora_dir()
    assert os.path.dirname(path) == str(shared_tmp)
    assert os.path.basename(path).startswith(f"weightsync-lora-{os.getuid()}-")
    st = os.lstat(path)
    assert (stat.S_ISDIR(st.st_mode), st.st_uid, st.st_mode & 0o777) == (True, os.getuid(), 0o700)
    # Exported: this process and those it starts later (vLLM's workers) agree on it.
    assert os.environ["WEIGHTSYNC_LORA_DIR"] == path
    assert default_lora_dir() == path
    code = "from weightsync.receiver.vllm.lora_store import default_lora_dir as d; print(d())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (child.returncode, child.stdout) == (0, path + "\n"), child.stderr
    store = LoraStore(None, None)
    assert store.register(_adapter(), 1) == os.path.join(path, "policy")


@pytest.mark.parametrize("planted", ["others_may_write", "symlink"])
def test_a_directory_planted_at_the_old_fixed_name_blocks_nothing(shared_tmp, victim, planted):
    """``<tmp>/weightsync-lora-<uid>`` was the default: anyone could create it first (as root
    here, it is given to uid 65534, as another user's would be), and every LoRA version was
    then refused. It is no longer used, and left alone."""
    old = shared_tmp / f"weightsync-lora-{os.getuid()}"
    if planted == "symlink":
        os.symlink(victim, old)
    else:
        old.mkdir()
        old.chmod(0o777)
        if os.getuid() == 0:
            os.chown(old, 65534, 65534)
    store = LoraStore(None, None)
    store.validate(_adapter()[0])
    path = store.register(_adapter(), 1)
    assert os.path.dirname(path) != str(old)
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert os.listdir(victim) == ["marker"]
    if planted != "symlink":
        assert os.listdir(old) == []


def test_a_private_xdg_runtime_dir_holds_it_under_a_fixed_name(shared_tmp, tmp_path, monkeypatch):
    runtime = tmp_path / "run-user"
    runtime.mkdir(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_lora_dir() == str(runtime / "weightsync-lora")
    assert "WEIGHTSYNC_LORA_DIR" not in os.environ  # nothing to pass on: every process agrees
    LoraStore(None, None).register(_adapter(), 1)
    assert os.lstat(runtime / "weightsync-lora").st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o750])
def test_an_xdg_runtime_dir_others_may_use_is_passed_over(shared_tmp, tmp_path, monkeypatch, mode):
    runtime = tmp_path / "run-user"
    runtime.mkdir()
    runtime.chmod(mode)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert os.path.dirname(default_lora_dir()) == str(shared_tmp)


def test_a_symlink_planted_at_the_configured_path_is_refused_and_not_followed(
    tmp_path, victim, monkeypatch
):
    monkeypatch.setenv("WEIGHTSYNC_LORA_DIR", str(tmp_path / "lora"))
    os.symlink(victim, default_lora_dir())
    store = LoraStore(None, None)
    with pytest.raises(ManifestMismatchError, match="not a plain directory"):
        store.validate(_adapter()[0])
    with pytest.raises(ConfigError, match="not a plain directory"):
        store.register(_adapter(), 1)
    assert os.listdir(victim) == ["marker"]


def test_a_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_LORA_DIR", str(tmp_path / "lora"))
    os.mkdir(default_lora_dir())
    os.chmod(default_lora_dir(), 0o777)
    with pytest.raises(ManifestMismatchError, match="mode 777: others could swap"):
        LoraStore(None, None).validate(_adapter()[0])


def test_a_planted_adapter_link_is_replaced_and_its_target_left_alone(tmp_path, victim):
    store = LoraStore(str(tmp_path / "adapters"), None)
    store.register(_adapter(), 1)
    stable = tmp_path / "adapters" / "policy"
    os.unlink(stable)
    os.symlink(victim, stable)  # what the engine used to rmtree as "the previous version"
    store.register(_adapter(), 2)
    assert os.listdir(victim) == ["marker"]
    assert os.readlink(stable) == ".policy.v2"
    assert sorted(os.listdir(tmp_path / "adapters")) == [".policy.v1", ".policy.v2", "policy"]
    store.register(_adapter(), 3)  # a version of its own is still replaced and removed
    assert sorted(os.listdir(tmp_path / "adapters")) == [".policy.v1", ".policy.v3", "policy"]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("po\0licy", "contains a NUL or a path separator"),
        ("a/b", "contains a NUL or a path separator"),
        ("a\\b", "contains a NUL or a path separator"),
        ("..", "starts with '.' (., .. and hidden names are not adapter names)"),
        (".", "starts with '.' (., .. and hidden names are not adapter names)"),
        ("x" * 201, "is 201 bytes long, over 200"),
        ("\udc80", "is not valid UTF-8"),
    ],
)
def test_a_name_that_is_not_one_file_name_fails_validation_naming_it(tmp_path, name, problem):
    store = LoraStore(str(tmp_path / "adapters"), None)
    with pytest.raises(ManifestMismatchError) as info:
        store.validate(_adapter(name)[0])
    assert str(info.value) == (
        f"LoRA adapter name {name!r} {problem}; it must be a plain file name"
    )
    assert not (tmp_path / "adapters").exists()  # refused before anything was written


def test_the_longest_name_allowed_commits(tmp_path):
    store = LoraStore(str(tmp_path / "adapters"), None)
    spec, tensors = _adapter("x" * 200)
    store.validate(spec)
    path = store.register((spec, tensors), 2**63 - 1)
    # The stable path names the adapter and holds exactly what was sent.
    from safetensors.torch import load_file

    assert path == os.path.join(store.lora_dir, "x" * 200)
    assert json.loads(open(os.path.join(path, "adapter_config.json")).read()) == json.loads(_CONFIG)
    written = load_file(os.path.join(path, "adapter_model.safetensors"))
    assert written.keys() == tensors.keys() and torch.equal(written[_TENSOR], tensors[_TENSOR])
