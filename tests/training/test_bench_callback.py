"""bench/bench_callback.py runs end to end and prints every row it promises: each step
configuration with a real daemon answering and without one, the callback connected where
the daemon runs, the table of where greend's time goes for each, and (``--attribute``) each
call alone. Its figures are not asserted: they are measurements, printed for people."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from tests.support import REPO


@pytest.mark.slow
def test_prints_a_row_per_configuration_with_and_without_a_daemon() -> None:
    args = ["--rounds", "6", "--block", "4", "--rounds-10ms", "6", "--block-10ms", "2", "--attribute"]
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_callback.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "never reached the daemon" not in r.stdout, r.stdout
    rows, where = {}, set()
    main, _, rest = r.stdout.partition("where it goes")
    rest, _, whole = rest.partition("the whole process's CPU time")
    process = {}
    for line in whole.splitlines():
        if line.startswith(("greend --sim 1", "none ")):
            m = re.match(r"\s*(-?[\d.]+)\s*\[(-?[\d.]+), (-?[\d.]+)\]", line[28:])  # median [CI]
            assert m, line
            process[(line[:15].strip(), line[15:22].strip(), line[22:28].strip())] = float(m[1])
    for line in rest.splitlines():
        if line.startswith(("greend --sim 1", "none ")):
            where.add((line[:15].strip(), line[15:22].strip(), line[22:28].strip()))
    for line in main.splitlines():
        if line.startswith(("greend --sim 1", "none ")):
            key = (line[:15].strip(), line[15:22].strip(), line[22:28].strip())
            m = re.match(r"\s*([\d.]+)\s+(\d+)\s*(-?[\d.]+)", line[28:])  # ms, rounds, greend's median
            assert m, line
            rows[key] = (float(m[1]), int(m[2]), float(m[3]))
    expected = {(d, step, level) for d in ("greend --sim 1", "none") for step, level in
                (("~1 ms", "fp32"), ("~10 ms", "fp32"), ("~1 ms", "bf16"), ("~10 ms", "bf16"))}  # fmt: skip
    assert set(rows) == expected, r.stdout
    assert where == expected, r.stdout
    assert set(process) == expected and all(math.isfinite(v) for v in process.values()), r.stdout
    assert "step.loss(cpu tensor)" in r.stdout and "left on the model" not in r.stdout, r.stdout
    assert all(ms > 0 and n == 6 and math.isfinite(g) for ms, n, g in rows.values()), r.stdout
