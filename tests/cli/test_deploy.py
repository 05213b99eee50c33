"""deploy/: the Kubernetes manifest's greend.toml is one greend loads, and its paths agree
(the config's socket is the one the training pods mount and name); the Slurm epilog is
valid sh. (Their behaviour: tests/e2e/test_e2e_slurm.py and, under a real Slurm,
tests/e2e/test_e2e_slurm_real.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from greend.config import load_config
from tests.support import REPO

yaml = pytest.importorskip("yaml")
DEPLOY = REPO / "deploy"


def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "greend.yaml").read_text())}


def test_the_configmap_is_a_config_greend_loads_and_the_paths_agree(tmp_path: Path) -> None:
    k = docs()
    assert set(k) == {"Namespace", "ConfigMap", "DaemonSet", "Service", "Job"}
    toml = tmp_path / "greend.toml"
    toml.write_text(k["ConfigMap"]["data"]["greend.toml"])
    cfg = load_config(toml)
    sock = Path(cfg.daemon.socket)
    pod = k["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # SO_PEERCRED pids must be the host's, as NVML's are
    (c,) = pod["containers"]
    assert c["command"][-1] == "/etc/greend/greend.toml"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/etc/greend"] == "config" and mounts[str(sock.parent)] == "run"
    assert mounts[str(cfg.daemon.state_dir)] == "state"
    host = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert host["run"] == str(sock.parent) and host["state"] == str(cfg.daemon.state_dir)
    # The training pod mounts the same host dir and names the same socket.
    job = k["Job"]["spec"]["template"]["spec"]
    (t,) = job["containers"]
    env = {e["name"]: e for e in t["env"]}
    assert env["GREEND_SOCKET"]["value"] == str(sock)
    assert "GREEND_JOB" in env
    # Its pods are one job and one run, each its rank of the completions (every pod was a
    # one-rank job of its own, a random run each: the job's story split across them).
    spec = k["Job"]["spec"]
    assert spec["completionMode"] == "Indexed" and int(env["WORLD_SIZE"]["value"]) == spec["completions"]
    assert env["GREEND_RUN"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/controller-uid']")
    assert "job-completion-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert {v["name"]: v["hostPath"]["path"] for v in job["volumes"]}["greend"] == str(sock.parent)


# The ServiceMonitor's fields as the Prometheus Operator's CRD (monitoring.coreos.com/v1)
# defines them, for those this manifest may use: a misspelt one is dropped by the API server.
SERVICEMONITOR_FIELDS = {
    "spec": {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"},
    "endpoint": {
        "port",
        "targetPort",
        "path",
        "scheme",
        "interval",
        "scrapeTimeout",
        "honorLabels",
        "relabelings",
        "metricRelabelings",
        "params",
        "tlsConfig",
    },  # fmt: skip
    "relabeling": {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"},
}


def test_prometheus_scrapes_what_the_daemon_serves(tmp_path: Path) -> None:
    """ConfigMap store URL -> container port -> Service port -> ServiceMonitor endpoint:
    one port, one name, one label set from end to end."""
    k = docs()
    toml = tmp_path / "greend.toml"
    toml.write_text(k["ConfigMap"]["data"]["greend.toml"])
    (url,) = [u for u in load_config(toml).store.urls if u.startswith("prometheus://")]
    port = int(url.rsplit(":", 1)[1])
    (c,) = k["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    (cport,) = [p for p in c["ports"] if p["name"] == "metrics"]
    assert cport["containerPort"] == port
    svc = k["Service"]
    assert svc["spec"]["selector"] == k["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    (sport,) = svc["spec"]["ports"]
    assert sport["targetPort"] == "metrics" and sport["port"] == port
    (sm,) = yaml.safe_load_all((DEPLOY / "kubernetes" / "servicemonitor.yaml").read_text())
    assert (sm["apiVersion"], sm["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert set(sm["spec"]) <= SERVICEMONITOR_FIELDS["spec"]
    assert sm["spec"]["selector"]["matchLabels"] == svc["metadata"]["labels"]
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= SERVICEMONITOR_FIELDS["endpoint"], set(ep) - SERVICEMONITOR_FIELDS["endpoint"]
        assert ep["port"] == sport["name"] and ep["path"] == "/metrics"
        assert ep.get("honorLabels") is True  # greend's job label kept, not renamed exported_job
        for r in ep.get("relabelings", []):
            assert set(r) <= SERVICEMONITOR_FIELDS["relabeling"], r


@pytest.mark.parametrize("script", ["epilog.sh", "task-epilog.sh"])
def test_the_slurm_scripts_are_valid_executable_sh(script: str) -> None:
    path = DEPLOY / "slurm" / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    r = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _check(value: Any, type_name: str, path: str, errors: list[str]) -> None:
    """``value`` against one of the official client's type strings: a model (V1Container),
    ``list[T]``, ``dict(str, T)``, or a primitive."""
    import kubernetes.client.models as models

    # The client writes these "List[T]" and "Dict[str, T]" (older releases "list[T]", "dict(str, T)").
    if m := re.fullmatch(r"(?i)list\[(.+)\]", type_name):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _check(item, m.group(1), f"{path}[{i}]", errors)
        return
    if m := re.fullmatch(r"(?i)dict[\[(]str, (.+)[\])]", type_name):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        for k, v in value.items():
            _check(v, m.group(1), f"{path}.{k}", errors)
        return
    primitive = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "object": (object,),
                 "datetime": (str,), "date": (str,)}  # fmt: skip
    if type_name in primitive:
        ok = isinstance(value, primitive[type_name]) and not (type_name == "int" and isinstance(value, bool))
        if not ok:
            errors.append(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return
    model = getattr(models, type_name, None)
    if model is None:
        errors.append(f"{path}: unknown type {type_name}")
        return
    if not isinstance(value, dict):
        errors.append(f"{path}: expected an object ({type_name}), got {type(value).__name__}")
        return
    by_key = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, v in value.items():
        if key not in by_key:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            _check(v, model.openapi_types[by_key[key]], f"{path}.{key}", errors)


def _deserialize(client: Any, response: Any, type_name: str) -> Any:
    """ApiClient.deserialize: a response object with ``data`` before release 33, the
    text and its content type since."""
    import inspect

    if "content_type" in inspect.signature(client.deserialize).parameters:
        return client.deserialize(response.data, type_name, "application/json")
    return client.deserialize(response, type_name)


def test_the_manifests_match_the_official_kubernetes_schema() -> None:
    """Every object of deploy/kubernetes/greend.yaml against the models of the official
    Kubernetes Python client: no unknown field at any depth (a typo kubectl would reject
    or silently drop), every value of its type, and the required fields there (the
    client's own deserialisation refuses a missing one)."""
    kubernetes = pytest.importorskip("kubernetes")
    client = kubernetes.client.ApiClient()

    class Response:  # what ApiClient.deserialize reads
        def __init__(self, obj: dict[str, Any]) -> None:
            self.data = json.dumps(obj)

    for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / "greend.yaml").read_text()):
        version = doc["apiVersion"].split("/")[-1].capitalize()
        type_name = f"{version}{doc['kind']}"
        errors: list[str] = []
        _check(doc, type_name, doc["kind"], errors)
        assert not errors, "\n".join(errors)
        _deserialize(client, Response(doc), type_name)  # raises on a missing required field


def test_the_schema_check_catches_what_it_should() -> None:
    """The check itself: a misspelt field, a wrong type and a missing container name fail."""
    kubernetes = pytest.importorskip("kubernetes")
    ds = docs()["DaemonSet"]
    bad = json.loads(json.dumps(ds))
    pod = bad["spec"]["template"]["spec"]
    pod["hostPid"] = True  # the field is hostPID
    pod["containers"][0]["securityContext"]["privileged"] = "yes"
    errors: list[str] = []
    _check(bad, "V1DaemonSet", "DaemonSet", errors)
    assert any("hostPid: not a field of V1PodSpec" in e for e in errors), errors
    assert any("privileged: expected bool" in e for e in errors), errors
    unnamed = json.loads(json.dumps(ds))
    del unnamed["spec"]["template"]["spec"]["containers"][0]["name"]

    class Response:
        data = json.dumps(unnamed)

    with pytest.raises(ValueError, match="name"):
        _deserialize(kubernetes.client.ApiClient(), Response(), "V1DaemonSet")
