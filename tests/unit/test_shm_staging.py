"""shm staging: a too-small /dev/shm fails at allocation with an error saying what to change,
not with SIGBUS while packing; a restarted sender's claim removes only dead owners' segments."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import tempfile

import pytest
import torch

from weightsync.errors import TransportError
from weightsync.transports import shm
from weightsync.transports.shm import ShmTransport, claim_staging, owner_key


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm, "_owner_key", shm._ANONYMOUS)
    return tmp_path


def _expected_message(path: str, nbytes: int) -> str:
    st = os.statvfs(os.path.dirname(path))
    return (
        f"shared memory {path}: cannot allocate {nbytes} bytes, {os.path.dirname(path)} has "
        f"{st.f_bavail * st.f_frsize} bytes free; enlarge it (docker run --shm-size=...) or "
        "stage in smaller buckets (--bucket-size-mb)"
    )


def test_no_space_fails_at_allocation_naming_segment_sizes_and_fix(shm_dir, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TransportError) as info:
        ShmTransport().allocate(1 << 20, torch.device("cpu"))
    (path,) = re.findall(r"shared memory (\S+):", str(info.value))
    assert str(info.value) == _expected_message(path, 1 << 20)
    assert os.listdir(shm_dir) == []  # the half-made segment is gone


@pytest.fixture
def tiny_tmpfs(monkeypatch):
    d = tempfile.mkdtemp(prefix="ws-tmpfs-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True
    )
    if mounted.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    monkeypatch.setattr(shm, "SHM_DIR", d)
    yield d
    # Lazy: a mapping a failed test still holds must not make the unmount fail.
    subprocess.run(["umount", "-l", d], check=True)
    os.rmdir(d)


def test_a_real_too_small_tmpfs_fails_at_allocation(tiny_tmpfs):
    transport = ShmTransport()
    with pytest.raises(TransportError, match="--shm-size") as info:
        transport.allocate(4 << 20, torch.device("cpu"))
    (path,) = re.findall(r"shared memory (\S+):", str(info.value))
    assert path.startswith(tiny_tmpfs + "/weightsync-")
    assert str(info.value) == _expected_message(path, 4 << 20)
    assert os.listdir(tiny_tmpfs) == []
    fits = transport.allocate(256 << 10, torch.device("cpu"))  # what fits still works
    fits.tensor.fill_(7)
    transport.release(fits)
    del fits


def test_claim_removes_dead_owners_segments_only(shm_dir):
    key = owner_key("unix:/tmp/x.sock")
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        names = {
            "dead": f"weightsync-{key}-{dead.pid}-0123456789ab",
            "live": f"weightsync-{key}-{live.pid}-0123456789ab",
            "other_key": f"weightsync-{owner_key('unix:/tmp/y.sock')}-{dead.pid}-0123456789ab",
            "anonymous": f"weightsync-anon-{dead.pid}-0123456789ab",
        }
        for name in names.values():
            (shm_dir / name).write_bytes(b"x")
        assert claim_staging("unix:/tmp/x.sock") == [str(shm_dir / names["dead"])]
        assert sorted(os.listdir(shm_dir)) == sorted(v for k, v in names.items() if k != "dead")
        staging = ShmTransport().allocate(64, torch.device("cpu"))
        assert staging.buffer_id.startswith(f"weightsync-{key}-{os.getpid()}-")
        ShmTransport().release(staging)
    finally:
        live.kill()
        live.wait()
