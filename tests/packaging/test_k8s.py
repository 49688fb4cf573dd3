"""The Kubernetes manifests in deploy/k8s/ against the Kubernetes API schemas (strict: an
unknown or misspelt field is an error), with kubernetes-validate from PyPI."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

kv = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (requirements/ci.txt)"
)
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.32.0"  # native sidecars (init containers with restartPolicy: Always) need >= 1.29


def documents() -> list[tuple[str, dict]]:
    return [
        (f"{path.name}:{doc['kind']}", doc)
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def test_every_manifest_is_valid_kubernetes():
    docs = documents()
    assert {name for name, _ in docs} >= {
        "trainer.yaml:StatefulSet", "trainer.yaml:Service", "engine.yaml:Deployment",
        "secret.yaml:Secret",
    }  # fmt: skip
    for name, doc in docs:
        try:
            kv.validate(doc, VERSION, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"deploy/k8s/{name}: {e}")


def test_the_sender_is_a_sidecar_the_trainer_reaches_on_localhost_sharing_shm():
    pod = dict(documents())["trainer.yaml:StatefulSet"]["spec"]["template"]["spec"]
    (sender,) = pod["initContainers"]
    assert sender["restartPolicy"] == "Always"
    trainer = pod["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in sender["volumeMounts"]}
    assert mounts == {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    assert mounts == {"shm": "/dev/shm"}
    env = {e["name"]: e for e in trainer["env"]}
    assert env["WEIGHTSYNC_ADDRESS"]["value"] == f"127.0.0.1:{sender['args'][-1].split(':')[-1]}"
    assert env["WEIGHTSYNC_TOKEN"] == next(
        e for e in sender["env"] if e["name"] == "WEIGHTSYNC_TOKEN"
    )


def test_the_validator_catches_a_misspelt_field():
    doc = copy.deepcopy(dict(documents())["trainer.yaml:StatefulSet"])
    doc["spec"]["template"]["spec"]["initContainers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, VERSION, strict=True)
