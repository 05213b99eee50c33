"""The DaemonSet's image and access model: the Dockerfile builds from this repository
(every file it copies exists, and the build step it runs makes a working wheel from
exactly those files; with a working docker, the image itself is built), and the
manifests give the node to no container by privilege or by uid 0."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from greend.config import load_config
from tests.support import REPO

yaml = pytest.importorskip("yaml")
DOCKERFILE = REPO / "deploy" / "kubernetes" / "Dockerfile"
MANIFEST = REPO / "deploy" / "kubernetes" / "greend.yaml"


def copies() -> list[str]:
    """The build context's paths the Dockerfile copies (COPY without --from)."""
    out: list[str] = []
    for line in DOCKERFILE.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            out += parts[1:-1]
    return out


def groups() -> dict[str, int]:
    return {m[1]: int(m[0]) for m in re.findall(r"groupadd --system --gid (\d+) ([\w-]+)", DOCKERFILE.read_text())}


def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_every_file_the_dockerfile_copies_exists() -> None:
    srcs = copies()
    assert {"pyproject.toml", "greend", "probes", "policies", "systemd"} <= set(srcs), srcs
    missing = [s for s in srcs if not (REPO / s).exists()]
    assert not missing, f"the Dockerfile copies what the repository lacks: {missing}"
    # The docs name the command that builds it, from the repository's root.
    build = "docker build -f deploy/kubernetes/Dockerfile"
    assert build in DOCKERFILE.read_text() and build in MANIFEST.read_text()
    assert build in (REPO / "README.md").read_text()


@pytest.mark.slow
def test_the_dockerfiles_build_step_makes_a_wheel_from_those_files_alone(tmp_path: Path) -> None:
    ctx = tmp_path / "context"
    ctx.mkdir()
    for s in copies():
        src = REPO / s
        if src.is_dir():
            shutil.copytree(src, ctx / s, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, ctx / s)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=ctx,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("greend-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("greend/cli/greend_cmd.py", "greend/probes/nvml.py", "greend/policies/efficient.py"):
        assert needed in names, needed
    assert any(n.endswith("share/greend/systemd/greend.service") for n in names)


def test_the_image_builds_where_docker_works(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker here: the image is not built (the Dockerfile's files and build step are checked)")
    info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        pytest.skip(f"docker cannot reach a daemon here ({info.stderr.strip().splitlines()[-1][:120]})")
    r = subprocess.run(
        [docker, "build", "-q", "-f", str(DOCKERFILE), "-t", "greend-test:ci", str(REPO)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if r.returncode != 0 and re.search(r"(pull|resolve|registry|network|dial tcp|lookup)", r.stderr, re.I):
        pytest.skip(f"docker cannot fetch the base image here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    v = subprocess.run([docker, "run", "--rm", "greend-test:ci", "--version"], capture_output=True, text=True)
    assert v.returncode == 0 and "greend" in v.stdout


def test_the_daemonset_is_not_privileged_and_names_what_it_needs() -> None:
    pod = docs()["DaemonSet"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc.get("privileged") is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert c["image"].startswith("greend:")  # the image the Dockerfile builds


def test_the_shipped_access_model(tmp_path: Path) -> None:
    """uid 0 is no admin; the socket's group and the admin group are the image's gids,
    and the example training pod joins only the socket's group."""
    k = docs()
    toml = tmp_path / "greend.toml"
    toml.write_text(k["ConfigMap"]["data"]["greend.toml"])
    d = load_config(toml).daemon
    assert d.root_is_admin is False and d.socket_mode == "0660"
    gids = groups()
    assert set(gids) == {d.socket_group, d.admin_group}, gids
    job = k["Job"]["spec"]["template"]["spec"]
    assert job["securityContext"]["supplementalGroups"] == [gids[d.socket_group]]
    assert gids[d.admin_group] not in job["securityContext"]["supplementalGroups"]
    assert "runAsGroup" not in job["securityContext"]
