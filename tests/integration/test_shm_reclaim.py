"""A sender killed with -9 cannot unlink its shm staging; the next sender on the same address
removes it at startup, and leaves a live process's segments alone."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

from tests.support import TinyNet, digests, sync_in_thread
from tests.support.processes import sender_process
from weightsync.receiver import TorchReceiver
from weightsync.sender import Publisher
from weightsync.transports.shm import owner_key

# Another live process whose segment carries the same key: it must survive the claim.
_LIVE_OWNER = textwrap.dedent(
    """
    import sys, time, torch
    from weightsync.transports import get_transport
    from weightsync.transports.shm import claim_staging
    claim_staging(sys.argv[1])
    staging = get_transport("shm").allocate(4096, torch.device("cpu"))
    print(staging.handle.shm.path, flush=True)
    time.sleep(120)
    """
)


def test_a_restarted_sender_reclaims_a_killed_predecessors_staging(sock_dir):
    address = f"unix:{sock_dir}/s.sock"
    key = owner_key(address)
    daemon = sender_process(address)
    live = subprocess.Popen(
        [sys.executable, "-c", _LIVE_OWNER, address], stdout=subprocess.PIPE, text=True
    )
    try:
        model, trainer = TinyNet(seed=1), TinyNet(seed=2)
        receiver = TorchReceiver(model, address, receiver_id="r")
        t, results = sync_in_thread(receiver)
        Publisher(address).publish(trainer.state_dict(), 1, wait=True, timeout_s=30)
        t.finish(30)
        assert results == [1] and digests(model) == digests(trainer)
        live_segment = live.stdout.readline().strip()
        left = glob.glob(f"/dev/shm/weightsync-{key}-{daemon.pid}-*")
        assert left, "the sender staged nothing under its listen address's key"
        daemon.kill()
        daemon.wait(10)
        assert all(os.path.exists(p) for p in left)  # a killed sender cannot unlink them
        daemon = sender_process(address)
        assert [p for p in left if os.path.exists(p)] == []
        assert os.path.exists(live_segment)
    finally:
        daemon.kill()
        daemon.wait(10)
        live.kill()
        live.wait(10)
        for path in glob.glob(f"/dev/shm/weightsync-{key}-*"):
            os.unlink(path)
