"""The README's own commands, as written: every shell command of its quick start ("The
two commands", "Running the daemon") and of "Who may do what" is read from README.md
itself (so the test cannot drift from it) and run; each must succeed.

How a line runs: through bash, in a fresh temp directory, with this venv's ``bin/`` first
on the PATH and no ``$GREEND_SOCKET``. A ``greend run`` line starts a daemon in the
background (as the README's ``&`` does), the test waits until it answers, and it is
stopped with SIGTERM at the end of its block, where it must exit 0. A ``greend run``
without ``--socket`` (the real node's default paths, /run/greend and /var/lib/greend) is
given a private ``--socket`` and ``--state-dir``, so a test never touches the node's own.
The README's fixed paths under /tmp are moved under the test's own temp directory
(``/tmp/g.sock`` becomes ``<temp>/tmp/g.sock`` in every line of the block alike): a daemon
or a state dir that someone trying the README left there (one owned by another user) never
fails or disturbs the test. Commands this test does not run are listed in ``NOT_HERE``
with the reason; any other line runs.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from greend.errors import GreendError
from greend.testing.daemon_proc import wait_until_up
from tests.support import REPO

SECTIONS = ("The two commands", "Running the daemon", "Who may do what")

NOT_HERE = {
    "make demo": "the demo runs end to end in tests/e2e/test_e2e_demo.py (35 s; too long to run twice)",
    "make test": "it is the test suite itself",
}


def readme_blocks(readme: Path = REPO / "README.md") -> dict[str, list[list[str]]]:
    """The ``sh`` blocks of each section in SECTIONS: the command lines, comments gone."""
    sections: dict[str, list[list[str]]] = {}
    current: str | None = None
    block: list[str] | None = None
    for line in readme.read_text().splitlines():
        if block is not None:
            if line.startswith("```"):
                if current in SECTIONS:
                    sections.setdefault(current, []).append(block)
                block = None
                continue
            cmd = re.sub(r"\s{2,}#.*$", "", line).strip()  # a trailing comment (two spaces, then #)
            if cmd and not cmd.startswith("#"):
                block.append(cmd)
            continue
        if line.startswith("## "):
            current = line[3:].strip()
        elif line.startswith("```sh"):
            block = []
    return sections


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    blocks = readme_blocks()
    assert set(blocks) == set(SECTIONS), f"sections with sh blocks: {sorted(blocks)}"
    lines = [c for bs in blocks.values() for b in bs for c in b]
    assert any(c.startswith("greend run") and "/tmp/" in c for c in lines)
    assert any(c.startswith("greenctl") and " cap set " in c for c in lines)


def _live(sock: str) -> bool:
    import socket as s

    c = s.socket(s.AF_UNIX, s.SOCK_STREAM)
    try:
        c.connect(sock)
        return True
    except OSError:
        return False
    finally:
        c.close()


@pytest.mark.parametrize("section", SECTIONS)
def test_every_command_of_the_section_succeeds(section: str, tmp_path: Path) -> None:
    blocks = readme_blocks()[section]
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("GREEND_SOCKET", None)
    if shutil.which("greend", path=env["PATH"]) is None:
        pytest.skip("no greend script beside this Python (install the package: make venv)")
    work = Path(tempfile.mkdtemp(prefix="greend-readme-"))
    (work / "tmp").mkdir()
    made: list[Path] = []  # paths this test created: removed after
    ran: list[str] = []
    try:
        for block in blocks:
            daemons: list[tuple[str, subprocess.Popen[bytes], Path]] = []
            try:
                for readme_cmd in block:
                    if readme_cmd in NOT_HERE:
                        ran.append(f"(not here: {readme_cmd}: {NOT_HERE[readme_cmd]})")
                        continue
                    cmd = readme_cmd.replace("/tmp/", f"{work}/tmp/")  # (the README's /tmp, privately)
                    argv = shlex.split(cmd.rstrip("&").strip())
                    if argv[:2] == ["greend", "run"]:
                        daemons.append(_start(cmd, argv, work, len(daemons), env, made))
                    else:
                        r = subprocess.run(
                            ["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=120
                        )
                        assert r.returncode == 0, (
                            f"README ({section}): {cmd!r} exited {r.returncode}:\n{r.stdout}{r.stderr}"
                        )
                    ran.append(readme_cmd)
            finally:
                for cmd, proc, log in daemons:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                    try:
                        rc = proc.wait(20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        rc = proc.wait(5)
                    assert rc == 0, f"README ({section}): {cmd!r} exited {rc} on SIGTERM:\n{log.read_text()[-3000:]}"
    finally:
        for p in made:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(ran))
    assert any(not r.startswith("(not here") for r in ran) or section == "The two commands"


def _start(
    cmd: str, argv: list[str], work: Path, n: int, env: dict[str, str], made: list[Path]
) -> tuple[str, subprocess.Popen[bytes], Path]:
    if "--socket" not in argv:  # the node's own default paths: never from a test
        argv += ["--socket", str(work / f"d{n}.sock"), "--state-dir", str(work / f"d{n}-state")]
    sock = Path(argv[argv.index("--socket") + 1])
    state = Path(argv[argv.index("--state-dir") + 1])
    if _live(str(sock)):
        pytest.skip(f"a daemon already listens on {sock} (the README's path): not disturbing it")
    for p in (sock, state):
        if not p.exists():
            made.append(p)
    log = work / f"d{n}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["bash", "-c", "exec " + shlex.join(argv)], cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT
        )
    try:
        wait_until_up(proc, sock, log, timeout_s=60)
    except GreendError as e:
        proc.kill()
        proc.wait(5)
        raise AssertionError(f"README: {cmd!r} did not come up: {e}") from None
    return cmd, proc, log
