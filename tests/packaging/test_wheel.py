"""The package as a user gets it: ``python -m build`` makes an sdist and, from that sdist, a
wheel; the wheel installs into a clean venv, and its console script runs the demo bit-exact
with nothing but the core dependencies (the README's "Install as a package").

The clean venv, and what is cached:
- a base venv with the wheel's core dependencies only (``dependencies`` in pyproject.toml, torch
  pinned to requirements/ci.txt's version, which pip takes from this machine's disk), built once
  by ``scripts/venv_lib.sh``'s ``cached_venv`` under ``~/.cache/weightsync/wheel-base-<hash of
  that list>``: no weightsync, no transformers, no extra;
- for every run a new, empty throwaway venv on top of it (one ``.pth`` line adds the base's
  site-packages after its own) into which the freshly built wheel is installed ``--no-deps``;
  ``pip check`` then proves the wheel's declared dependencies are what the base holds. The cached
  base is never written to, so concurrent runs from several clones cannot disturb each other.
On 2 cores: warm about 25 s (build 3 s, install 3 s, the demo 13 s); cold about 100 s, the
base venv taking 70 s of it (torch from disk, the rest from pip's cache the CI venv filled).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = [
    "weightsync",
    "weightsync.app",
    "weightsync.app.bench",
    "weightsync.control",
    "weightsync.drivers",
    "weightsync.integrations",
    "weightsync.receiver",
    "weightsync.receiver.sglang",
    "weightsync.receiver.vllm",
    "weightsync.sender",
    "weightsync.sender.megatron",
    "weightsync.transports",
    "weightsync.transports.broadcast",
    "weightsync.v1",
]
CORE_MODULES = [
    # what the core install promises to run without any extra
    "weightsync.app.cli",
    "weightsync.app.demo",
    "weightsync.control",
    "weightsync.drivers.sglang",
    "weightsync.receiver",
    "weightsync.sender",
    "weightsync.transports",
    "weightsync.v1.weightsync_pb2_grpc",
]
DEMO_LAST_LINE = "demo: 3 versions to 2 receivers, bit-exact: yes"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _source_version() -> str:
    tree = ast.parse((REPO / "weightsync" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]:
            return node.value.value
    raise AssertionError("weightsync/__init__.py sets no __version__")


def _run(cmd: list, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )
    assert out.returncode == 0, f"{cmd} exited {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def _clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "WEIGHTSYNC_"))}
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist + wheel built by ``python -m build`` from a snapshot of this checkout's files
    (tracked, and untracked that git does not ignore), so no build output lands in the tree."""
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    files = _run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO
    ).stdout.split("\0")
    for rel in filter(None, files):
        f = REPO / rel
        if f.is_file():  # a tracked file deleted in the work tree is listed too
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(f.read_bytes())
    # --no-isolation: the build backend (setuptools>=77) comes from the CI venv, no download.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "out", src])
    return tmp / "out"


@pytest.fixture(scope="module")
def wheel(dist) -> Path:
    (whl,) = dist.glob("weightsync-*.whl")
    return whl


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    """The cached venv of the wheel's core dependencies (see the module docstring)."""
    torch_pin = next(
        line.strip()
        for line in (REPO / "requirements" / "ci.txt").read_text().splitlines()
        if line.startswith("torch==")
    )
    deps = [d for d in _pyproject()["project"]["dependencies"] if not d.startswith("torch")]
    req = tmp_path_factory.mktemp("base") / "wheel-base.txt"
    req.write_text(
        "# the core dependencies of pyproject.toml (tests/packaging/test_wheel.py)\n"
        + "\n".join([torch_pin, *deps])
        + "\n"
    )
    out = _run(
        [
            "bash",
            "-c",
            'source scripts/venv_lib.sh && cached_venv "$1" wheel-base && echo "$CACHED_VENV"',
            "-",
            req,
        ],
        timeout=900,
        cwd=REPO,
    )
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed(base_venv, wheel, tmp_path_factory) -> Path:
    """A new venv, empty but for the base's packages and the freshly built wheel."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    base_py = base_venv / "bin" / "python"
    real_py = _run([base_py, "-c", "import sys; print(sys._base_executable)"]).stdout.strip()
    _run([real_py, "-m", "venv", "--without-pip", venv])
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([venv / "bin" / "python", "-c", purelib]).stdout.strip())
    base_site = _run([base_py, "-c", purelib]).stdout.strip()
    (site / "_weightsync_wheel_base.pth").write_text(
        f"import site; site.addsitedir({base_site!r})\n"
    )
    pip = [base_py, "-m", "pip", "--python", venv / "bin" / "python"]
    _run([*pip, "install", "-q", "--no-deps", wheel])
    _run([*pip, "check"])  # the wheel's Requires-Dist are all satisfied by the base
    return venv


@pytest.mark.packaging
def test_wheel_holds_every_package_py_typed_and_license(wheel):
    version = _source_version()
    assert wheel.name == f"weightsync-{version}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [p for p in PACKAGES if f"{p.replace('.', '/')}/__init__.py" not in names]
    assert not missing, f"packages missing from the wheel: {missing}"
    for f in ["weightsync/py.typed", "weightsync/v1/weightsync_pb2.pyi"]:
        assert f in names
    info = f"weightsync-{version}.dist-info"
    assert f"{info}/licenses/LICENSE" in names
    # nothing outside the weightsync package (sender/ and receiver/ map into it)
    assert {n.split("/")[0] for n in names} == {"weightsync", info}


@pytest.mark.packaging
def test_wheel_metadata_version_license_extras(wheel):
    meta = (
        zipfile.ZipFile(wheel).read(f"weightsync-{_source_version()}.dist-info/METADATA").decode()
    )
    assert re.search(r"^License-Expression: Apache-2.0$", meta, re.M)
    extras = set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M))
    assert extras == {"vllm", "sglang", "megatron", "drivers", "ray", "bench", "dev"}
    requires = re.findall(r"^Requires-Dist: (.*)$", meta, re.M)
    assert not [r for r in requires if "cupy" in r], "nothing imports cupy"
    assert any(r.startswith("megatron-core") and "megatron" in r for r in requires)
    assert any(r.startswith("transformers") and 'extra == "megatron"' in r for r in requires)
    entry = (
        zipfile.ZipFile(wheel)
        .read(f"weightsync-{_source_version()}.dist-info/entry_points.txt")
        .decode()
    )
    assert "weightsync = weightsync.app.cli:main" in entry
    assert "weightsync-sender = weightsync.app.cli:sender_main" in entry
    assert "[vllm.general_plugins]\nweightsync = weightsync.receiver.vllm_plugin:register" in entry
    assert "[sglang.srt.plugins]\nweightsync = weightsync.receiver.sglang_plugin:register" in entry


@pytest.mark.packaging
def test_sdist_holds_license_changelog_and_proto(dist):
    (sdist,) = dist.glob("weightsync-*.tar.gz")
    root = f"weightsync-{_source_version()}"
    names = set(tarfile.open(sdist).getnames())
    for f in [
        "LICENSE",
        "CHANGELOG.md",
        "README.md",
        "pyproject.toml",
        "proto/weightsync/v1/weightsync.proto",
        "weightsync/py.typed",
    ]:
        assert f"{root}/{f}" in names, f


@pytest.mark.packaging
def test_installed_wheel_runs_the_demo_with_core_dependencies_only(installed, tmp_path):
    """From a directory outside the checkout, the venv's own console script: the demo ends
    bit-exact, weightsync is the installed copy, and no extra (transformers) was needed."""
    env = _clean_env(installed)
    probe = _run(
        [
            installed / "bin" / "python",
            "-c",
            "import importlib, importlib.metadata as md, importlib.util as u, weightsync\n"
            f"for m in {CORE_MODULES!r}: importlib.import_module(m)\n"
            "print(weightsync.__file__)\n"
            "print(weightsync.__version__, md.version('weightsync'))\n"
            "print(u.find_spec('transformers') is None)",
        ],
        cwd=tmp_path,
        env=env,
    ).stdout.splitlines()
    assert Path(probe[0]).resolve().is_relative_to(installed.resolve()), probe[0]
    assert probe[1] == f"{_source_version()} {_source_version()}"
    assert probe[2] == "True", "the clean venv must not hold transformers"
    for script in ["weightsync", "weightsync-sender"]:
        _run([installed / "bin" / script, "--help"], cwd=tmp_path, env=env, timeout=60)
    out = _run([installed / "bin" / "weightsync", "demo"], cwd=tmp_path, env=env, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == DEMO_LAST_LINE, out.stdout + out.stderr


def test_core_demo_model_matches_transformers_qwen2():
    """Without transformers the demo builds the same tensor names, shapes and dtypes."""
    pytest.importorskip("transformers")
    from weightsync.app.demo import TINY_QWEN2, _tiny_qwen2, _torch_qwen2

    hf = _tiny_qwen2(seed=0, device="cpu").state_dict()
    plain = _torch_qwen2(TINY_QWEN2).state_dict()
    assert list(plain) == list(hf)
    assert {k: (t.shape, t.dtype) for k, t in plain.items()} == {
        k: (t.shape, t.dtype) for k, t in hf.items()
    }


def test_every_source_package_is_listed_in_pyproject():
    """pyproject.toml lists packages by hand (sender/ and receiver/ map into weightsync): a new
    package folder must be listed there and in PACKAGES, or the wheel silently lacks it."""
    roots = {
        "weightsync": "weightsync",
        "sender": "weightsync.sender",
        "receiver": "weightsync.receiver",
    }
    found = set()
    for root, package in roots.items():
        for init in (REPO / root).rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(REPO / root).parts]))
    assert found == set(_pyproject()["tool"]["setuptools"]["packages"]) == set(PACKAGES)


def test_ci_requirements_cover_the_core_and_dev_dependencies():
    """requirements/ci.txt (the CI venv) holds every core dependency and dev tool of
    pyproject.toml, so CI tests what the package declares."""

    def name(req: str) -> str:
        return re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")

    ci = {
        name(line)
        for line in (REPO / "requirements" / "ci.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    project = _pyproject()["project"]
    declared = {name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    assert not declared - ci, f"in pyproject.toml but not requirements/ci.txt: {declared - ci}"
