"""A real victoria-metrics for tests and benchmarks: own port, own data dir.

victoria-metrics accepts influxdb-client's ``/api/v2/write`` (Debian's package; it
ignores org, bucket and token), so it stands in for InfluxDB here. Series come back
named ``<measurement>_<field>`` with the tags as labels and millisecond timestamps.

    vm = VmServer(tmp_dir).start()
    ... write to vm.influx_url ...
    vm.export('greend_gpu_power_w', run="abc")   # -> [(labels, [ts_ms...], [values...])]
    vm.stop(); vm.start()                         # same port, same data: an outage
    vm.close()

Started with ``-search.latencyOffset=0s`` (fresh points are queryable at once)
and, unless ``dedup=False``, ``-dedup.minScrapeInterval=1ms``. Tests that must
*see* duplicates pass ``dedup=False``: with dedup on, a point sent twice would
be folded into one and a duplicate would go unnoticed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

VM_BIN = Path("/usr/bin/victoria-metrics")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def available() -> bool:
    return VM_BIN.exists() and os.access(VM_BIN, os.X_OK)


class VmServer:
    """One victoria-metrics process; restartable on the same port and data dir."""

    def __init__(self, base_dir: Path, *, port: int | None = None, dedup: bool = True, binary: Path = VM_BIN) -> None:
        self.base_dir = Path(base_dir)
        self.data_dir = self.base_dir / "vm-data"
        self.port = port or free_port()
        self.dedup = dedup
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.base_dir / "vm.log"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def influx_url(self) -> str:
        return f"influx://127.0.0.1:{self.port}?org=test&bucket=test"

    def start(self, timeout_s: float = 20.0) -> VmServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(self.binary),
            f"-httpListenAddr=127.0.0.1:{self.port}",
            f"-storageDataPath={self.data_dir}",
            "-retentionPeriod=100y",
            "-search.latencyOffset=0s",
            "-search.disableCache",
            "-loggerLevel=ERROR",
        ]
        if self.dedup:
            args.append("-dedup.minScrapeInterval=1ms")
        deadline = time.monotonic() + timeout_s
        while True:  # the port may linger for a moment after a stop
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            if self._wait_ready(deadline):
                return self
            if self.proc.poll() is None:
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        self.kill()
        raise RuntimeError(f"victoria-metrics did not start on port {self.port}:\n{tail}")

    def _wait_ready(self, deadline: float) -> bool:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.http}/health", timeout=1) as r:
                    if r.status == 200:
                        return True
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        return False

    def stop(self, timeout_s: float = 15.0) -> None:
        """Graceful stop (SIGTERM): victoria-metrics flushes its buffers to disk."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    # Reading back --------------------------------------------------------------------
    def force_flush(self) -> None:
        with urllib.request.urlopen(f"{self.http}/internal/force_flush", timeout=10) as r:
            r.read()

    def export(self, metric: str, **labels: str) -> list[tuple[dict[str, str], list[int], list[float]]]:
        """Raw samples of every series named ``metric`` with these labels (ms timestamps)."""
        sel = ",".join([f'__name__="{metric}"', *(f'{k}="{v}"' for k, v in labels.items())])
        q = urllib.parse.urlencode({"match[]": "{" + sel + "}", "start": "0"})
        out = []
        with urllib.request.urlopen(f"{self.http}/api/v1/export?{q}", timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.strip():
                    d = json.loads(line)
                    out.append((d["metric"], d["timestamps"], d["values"]))
        return out

    def samples(self, metric: str, **labels: str) -> list[tuple[int, float]]:
        """(ts_ms, value) of every matching sample across series, sorted by time."""
        rows = [(t, v) for _m, ts, vs in self.export(metric, **labels) for t, v in zip(ts, vs)]
        return sorted(rows)

    def wait_samples(self, metric: str, n: int, timeout_s: float = 15.0, **labels: str) -> list[tuple[int, float]]:
        """Poll (force_flush + export) until at least ``n`` samples are visible."""
        deadline = time.monotonic() + timeout_s
        rows: list[tuple[int, float]] = []
        while time.monotonic() < deadline:
            self.force_flush()
            rows = self.samples(metric, **labels)
            if len(rows) >= n:
                time.sleep(0.3)  # let stragglers (duplicates) show up too
                self.force_flush()
                return self.samples(metric, **labels)
            time.sleep(0.2)
        return rows

    def query(self, promql: str) -> Any:
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.http}/api/v1/query?{q}", timeout=30) as r:
            return json.loads(r.read())["data"]["result"]
