"""docs/grafana-greend.json: well formed, its queries name only measurements, fields and
template variables that exist, and its per-job row sums one run of one job across hosts."""

from __future__ import annotations

import json
import re

from tests.support import REPO

DASHBOARD = REPO / "docs" / "grafana-greend.json"
GRAFANA_VARS = {"__interval", "__range", "__from", "__to"}


def _queries(d: dict) -> list[tuple[str, str]]:
    out = [(v["name"], v.get("query", "")) for v in d["templating"]["list"] if isinstance(v.get("query"), str)]
    for p in d["panels"]:
        out += [(p["title"], t["query"]) for t in p.get("targets", [])]
    return out


def test_queries_name_only_what_greend_writes() -> None:
    d = json.loads(DASHBOARD.read_text())
    points = (REPO / "greend" / "points.py").read_text()
    measurements = set(re.findall(r'"(greend_[a-z_]+)"', points))
    defined = {v["name"] for v in d["templating"]["list"]} | GRAFANA_VARS
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for where, q in _queries(d):
        for m in re.findall(r'_measurement == "([a-z_]+)"', q):
            assert m in measurements, (where, m)
        for v in re.findall(r"\$\{(\w+)(?::\w+)?\}", q):
            assert v in defined, (where, v)


def test_the_per_job_row_sums_one_run_across_hosts() -> None:
    d = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in d["templating"]["list"]]
    assert names.index("job") < names.index("run")  # the run list follows the job picked
    rows = [p for p in d["panels"] if p["type"] == "row"]
    assert rows and "${job}" in rows[-1]["title"]
    start = d["panels"].index(rows[-1])
    job_panels = d["panels"][start + 1 :]
    assert len(job_panels) >= 3
    for p in job_panels:
        q = p["targets"][0]["query"]
        assert 'r.job == "${job}"' in q and 'r.run == "${run}"' in q, p["title"]
    quotient = job_panels[0]["targets"][0]["query"]
    # Summed FLOPs over summed joules: the sum comes before the division, never a mean of ratios.
    assert quotient.index("sum()") < quotient.index("r.window_flops / r.window_gpu_energy_j")
