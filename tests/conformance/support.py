"""What the conformance tests of the orderly leave, offered wide rows and split versions share
(the older helpers are in ``tests/support/conformance.py``)."""

from __future__ import annotations

from tests.support.conformance import NODE_DIR, PROTO, LineProcess, NodeClients

WIDE_BUCKET_BYTES = 64 * 1024
WIDE_TENSORS = [
    # Two dim-0 rows of 80,000 bytes each, wider than a 64 KiB bucket: split mid-row (§5 rule 3),
    # so the sender cannot pack the offered rows itself and asks the publisher (§3.1).
    {"name": "model.layers.0.mlp.wide.weight", "dtype": "float32", "shape": [2, 20000]},
    {"name": "model.norm.weight", "dtype": "float32", "shape": [4]},
]

SPLIT_SENDERS = ("trainer-a", "trainer-b")
SPLIT_PLAN = [
    # Part 0 (trainer-a): several 4 KiB buckets, one tensor chunked.
    [
        {"name": "model.embed_tokens.weight", "dtype": "bfloat16", "shape": [40, 16]},
        {
            "name": "model.layers.0.self_attn.qkv_proj.weight",
            "dtype": "float32",
            "shape": [100, 24],
        },
    ],
    # Part 1 (trainer-b).
    [
        {"name": "model.layers.0.mlp.router.weight", "dtype": "float32", "shape": [4, 16]},
        {"name": "model.norm.bias", "dtype": "float32", "shape": [7]},
        {"name": "model.step", "dtype": "int64", "shape": []},
        {"name": "lm_head.weight", "dtype": "bfloat16", "shape": [3, 5, 7]},
    ],
]


class NodeReceivers(NodeClients):
    """:class:`NodeClients` whose receivers may register with several senders and leave at
    once after their last version."""

    def start(self, receiver_id: str, *args: str, addresses: tuple[str, ...] = ()) -> LineProcess:
        cmd = ["node", str(self.script), "receive", "--proto", str(PROTO)]
        for address in addresses or (self.address,):
            cmd += ["--address", address]
        cmd += ["--receiver-id", receiver_id, *args]
        p = LineProcess(cmd, self.env, NODE_DIR)
        self._started.append(p)
        return p
