"""The broadcast path, both ends: receivers on other hosts (or every receiver, with
``--transport nccl``) get each bucket by a broadcast from the sender's staging buffer.

- :mod:`.group`: one private NCCL/gloo group on its own TCPStore (rank 0 the sender), what both
  ends hold: ``BroadcastGroup.host`` (sender), the ``pb.GroupJoin`` that tells a receiver to join,
  ``BroadcastGroup.broadcast`` (both).
- :mod:`.sending`: the sender's end: a group per set of members (the staged buckets' receivers,
  and each slice group's: ``sender/slices.py``), kept while they can carry the next version;
  each bucket queued on its slot and finished before the slot is packed again.
- :mod:`.receiving`: the receiver's end: joins when told and lands buckets in two alternating
  buffers (or in the bytes it keeps, with deltas on).
- :mod:`.bases`: the bytes each end holds as the base of the next delta, so a bucket may
  cross as an exact delta (protocol §5.1).
"""

from weightsync.transports.broadcast.bases import AppliedBases, DeltaBases, Encoded
from weightsync.transports.broadcast.group import (
    BroadcastGroup,
    GroupSpec,
    PendingBroadcast,
    host_id,
)
from weightsync.transports.broadcast.receiving import BroadcastReceiver
from weightsync.transports.broadcast.sending import (
    Members,
    QueuedBroadcast,
    SenderBroadcast,
    WireCount,
    group_name,
    in_step,
)

__all__ = [
    "AppliedBases",
    "BroadcastGroup",
    "BroadcastReceiver",
    "DeltaBases",
    "Encoded",
    "GroupSpec",
    "Members",
    "PendingBroadcast",
    "QueuedBroadcast",
    "SenderBroadcast",
    "WireCount",
    "group_name",
    "host_id",
    "in_step",
]
