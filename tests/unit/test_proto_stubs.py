"""The committed stubs are exactly what scripts/gen_proto.sh makes from proto/."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto(tmp_path):
    subprocess.run(
        ["bash", str(REPO / "scripts/gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*"))
    assert generated, "the generator produced nothing"
    for rel in generated:
        committed = REPO / rel
        assert committed.exists(), f"{rel} is generated but not committed; run scripts/gen_proto.sh"
        assert committed.read_text() == (tmp_path / rel).read_text(), (
            f"{rel} drifted from proto/; run scripts/gen_proto.sh and commit"
        )
