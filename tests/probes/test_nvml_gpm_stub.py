"""SM activity (NVML's GPM metrics) through the real ``pynvml`` on the C stand-in of
``libnvidia-ml.so.1`` (tests/nvml_stub), each case in a subprocess of its own: the
stand-in's GPM calls as nvml.h has them, the probe's ``sm_active_pct`` and its faults,
and within-node pacing finding the slack that ``utilization.gpu`` hides."""

from __future__ import annotations

from pathlib import Path

from tests.probes.test_nvml_stub import run_py

# The probe on the stand-in: every tick reads the slow fields (now_s one second apart),
# so every tick takes a GPM sample. EVENTS maps a tick to a file to create or remove
# before it (a fault that starts or ends mid-run).
GPM_SCRIPT = """
import ctypes, json, os, time
from greend.probes.nvml import NvmlProbe
import greend.probes.nvml as m
m.RECOVER_EVERY_S = 0.0
lib = ctypes.CDLL("libnvidia-ml.so.1")  # the library pynvml loaded: one set of globals
lib.nvmlStubGpmLiveSamples.restype = lib.nvmlStubGpmBadFrees.restype = ctypes.c_long
p = NvmlProbe()
p.open()
ticks, errors = [], []
for k in range(TICKS):
    for path, make in EVENTS.get(k, []):
        if make:
            open(path, "w").close()
        else:
            os.remove(path)
    try:
        r = p.sample(float(k))
        sm = {g.index: None if g.sm_active_pct is None else round(g.sm_active_pct, 6) for g in r.gpus}
        ticks.append({str(g.index): [g.util_gpu_pct, sm[g.index]] for g in r.gpus})
    except Exception as e:
        ticks.append({"error": str(e)})
    errors.append({str(i): sorted(e) for i, e in p.device_errors.items()})
    time.sleep(0.05)
live = lib.nvmlStubGpmLiveSamples()
p.close()
closed, bad_frees = lib.nvmlStubGpmLiveSamples(), lib.nvmlStubGpmBadFrees()
print(json.dumps({"ticks": ticks, "errors": errors, "live_open": live, "live_closed": closed, "bad_frees": bad_frees}))
"""


def gpm_run(ticks: int, events: dict[int, list[tuple[str, bool]]] | None = None, **faults: object) -> dict:
    code = GPM_SCRIPT.replace("TICKS", str(ticks)).replace("EVENTS", repr(events or {}))
    return run_py(code, **faults)


def test_the_stand_ins_gpm_calls_keep_nvml_h_s_structs_and_checks() -> None:
    """Real pynvml on the stand-in: support per device, SM_UTIL between two samples with
    the metric's own status and name, NOT_SUPPORTED for an unmodelled metric and for a
    pre-Hopper GPU's samples, INVALID_ARGUMENT for a wrong version, samples of two GPUs,
    samples in the wrong order and a second free."""
    out = run_py(
        """
        import json, time, pynvml as n
        n.nvmlInit()
        h1, h2 = n.nvmlDeviceGetHandleByIndex(1), n.nvmlDeviceGetHandleByIndex(2)
        out = {"support": [n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice for h in (h1, h2)]}
        a, b, c = n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()
        def metrics(s1, s2, version=n.NVML_GPM_METRICS_GET_VERSION):
            q = n.c_nvmlGpmMetricsGet_t()
            q.version, q.numMetrics, q.sample1, q.sample2 = version, 2, s1, s2
            q.metrics[0].metricId = n.NVML_GPM_METRIC_SM_UTIL
            q.metrics[1].metricId = n.NVML_GPM_METRIC_SM_OCCUPANCY
            try:
                n.nvmlGpmMetricsGet(q)
            except n.NVMLError as e:
                return e.value
            m0, m1 = q.metrics[0], q.metrics[1]
            return [round(m0.value, 3), m0.nvmlReturn, m0.metricInfo.shortName.decode(), m1.nvmlReturn]
        n.nvmlGpmSampleGet(h1, a); time.sleep(0.05); n.nvmlGpmSampleGet(h1, b)
        out["sm"] = metrics(a, b)
        out["bad_version"] = metrics(a, b, version=2)
        out["wrong_order"] = metrics(b, a)
        try:
            n.nvmlGpmSampleGet(h2, c)
        except n.NVMLError as e:
            out["pre_hopper_sample"] = e.value
        n.nvmlGpmSampleGet(n.nvmlDeviceGetHandleByIndex(0), c)
        out["two_gpus"] = metrics(b, c)
        for s in (a, b, c):
            n.nvmlGpmSampleFree(s)
        try:
            n.nvmlGpmSampleFree(a)
        except n.NVMLError as e:
            out["double_free"] = e.value
        print(json.dumps(out))
        """,
        sm_active="1:40",
        pre_hopper="2",
    )
    assert out["support"] == [1, 0]
    assert out["sm"] == [40.0, 0, "sm_util", 3]  # SM_OCCUPANCY: NOT_SUPPORTED in its own status
    assert out["bad_version"] == 2 and out["wrong_order"] == 2 and out["two_gpus"] == 2  # INVALID_ARGUMENT
    assert out["pre_hopper_sample"] == 3  # NOT_SUPPORTED
    assert out["double_free"] == 2


def test_sm_activity_is_read_where_the_gpu_has_gpm_and_the_samples_are_freed() -> None:
    """GPU 1 waits (40 % of its SMs busy) while utilization.gpu reads 97 on every GPU;
    GPU 2 is an A100 (no GPM) and GPU 3 is in MIG mode: None, with no error. The first
    tick has one sample only; the four buffers are freed at close."""
    out = gpm_run(3, gpus=4, sm_active="1:40", pre_hopper="2", mig="3")
    first, last = out["ticks"][0], out["ticks"][-1]
    assert all(v[1] is None for v in first.values())  # one sample: no interval yet
    assert last["0"] == [97.0, 97.0] and last["1"] == [97.0, 40.0]
    assert last["2"] == [97.0, None] and last["3"][1] is None
    assert out["errors"][-1] == {}  # unsupported is not an error
    assert out["live_open"] == 4 and out["live_closed"] == 0


def test_a_gpm_error_mid_run_costs_the_figure_only_and_it_comes_back(tmp_path: Path) -> None:
    """nvmlGpmSampleGet fails on GPU 1 (an error NVML has no name for) from tick 3 to
    tick 5: its SM activity reads None and the error is kept, the GPU's other fields and
    the other GPUs read on; once the error stops, a new pair of samples gives a figure
    and the error is cleared."""
    flag = str(tmp_path / "gpm-error")
    out = gpm_run(
        9, {3: [(flag, True)], 6: [(flag, False)]}, gpus=2, sm_active="1:40", gpm_error="999:1", gpm_error_when=flag
    )
    ticks = out["ticks"]
    assert ticks[2]["1"] == [97.0, 40.0]
    for k in (3, 4, 5):
        assert ticks[k]["1"] == [97.0, None] and ticks[k]["0"][1] == 97.0, ticks[k]
    assert "nvmlGpmSampleGet" in out["errors"][4]["1"]
    assert ticks[6]["1"][1] is None  # the first sample of a new pair
    assert ticks[7]["1"] == [97.0, 40.0] and out["errors"][-1] == {}


def test_not_supported_mid_run_reads_none_quietly() -> None:
    out = gpm_run(3, gpus=2, sm_active="1:40", gpm_error="3:1")
    assert out["ticks"][-1]["1"] == [97.0, None] and out["ticks"][-1]["0"][1] == 97.0
    assert out["errors"][-1] == {}


def test_a_gpu_lost_and_back_reads_sm_activity_again_from_a_new_pair(tmp_path: Path) -> None:
    """GPU 1 resets mid-run: it is lost (GPU_IS_LOST on its handles, its GPM counters
    restart), comes back with a fresh handle and reads SM activity again from two new
    samples (never one taken before the reset); its buffers are still freed at close."""
    activity = tmp_path / "sm_active"
    activity.write_text("1 40\n")
    out = gpm_run(30, gpus=2, sm_active=str(activity), reset="1:60:2")
    ticks = out["ticks"]
    gone = [k for k, t in enumerate(ticks) if "1" not in t]
    assert gone, ticks  # lost for a while
    back = [t["1"][1] for t in ticks[gone[-1] + 1 :]]
    assert back[0] is None and back[-1] == 40.0, back
    assert out["live_open"] == 4 and out["live_closed"] == 0


def test_nvml_shut_down_under_greend_gives_every_gpu_new_buffers() -> None:
    """NVML's init count drops to 0 mid-run (someone's unbalanced nvmlShutdown); the
    stand-in ends the session's GPM samples with it (nvml.h does not say they outlive
    it). The probe initialises NVML again and allocates new buffers: SM activity reads
    again from a new pair, and no buffer of the old session is used or freed."""
    out = gpm_run(10, gpus=2, sm_active="1:40", uninit_after=150)
    ticks = out["ticks"]
    hit = [k for k, t in enumerate(ticks) if "error" in t or len(t) < 2]
    assert hit and hit[-1] < len(ticks) - 3, ticks  # NVML shut down mid-run, and time after it
    assert ticks[hit[0] + 1] == {"0": [97.0, None], "1": [97.0, None]}  # the first sample of a new pair
    assert ticks[-1] == {"0": [97.0, 97.0], "1": [97.0, 40.0]}
    assert not any(
        k.startswith("nvmlGpm") or k == "gpm" for e in out["errors"][hit[0] + 1 :] for v in e.values() for k in v
    )
    assert out["live_open"] == 4 and out["live_closed"] == 0 and out["bad_frees"] == 0


PACING_SCRIPT = """
import json, time
from greend.probes.nvml import NvmlProbe
from greend.policies._evidence import Evidence
from greend.policies._pacing import Pacer, PaceState
from greend.policies.base import UNCAPPED, GpuView, Setting
p = NvmlProbe()
p.open()
for k in range(3):
    r = p.sample(float(k))
    time.sleep(0.05)
p.close()
def views(gpm):
    return [
        GpuView(g.index, g.source, g.power_w, g.sm_clock_mhz, None, g.power_limit_w, g.supported_sm_clocks_mhz,
                g.power_limit_min_w, g.power_limit_max_w, g.power_limit_default_w, util_pct=g.util_gpu_pct,
                sm_active_pct=g.sm_active_pct if gpm else None)
        for g in r.gpus
    ]
clocks = sorted(set(r.gpus[0].supported_sm_clocks_mhz))
grid = tuple(Setting(clock_cap_mhz=f) for f in clocks[:-1]) + (UNCAPPED,)
levels = tuple(float(f) for f in clocks)
live = Evidence(16, 16e12, 16.0, 8000.0, None, None)
out = {}
for name, gpm in (("util", False), ("gpm", True)):
    moves = Pacer(8, 1.64, 0.02).step(PaceState(), 10.0, grid, levels, len(grid) - 1, views(gpm), live)
    out[name] = {str(i): s.clock_cap_mhz for i, s in moves.items()}
print(json.dumps(out))
"""


def test_a_waiting_gpu_is_paced_by_its_sm_activity_where_utilisation_sees_no_slack() -> None:
    """Four GPUs on the stand-in, GPU 1 waiting (40 % of its SMs busy) while
    utilization.gpu reads 97 everywhere: on utilisation alone the pacer moves nothing;
    on SM activity it gives GPU 1 (and only it) a lower clock cap."""
    out = run_py(PACING_SCRIPT, gpus=4, sm_active="1:40")
    assert out["util"] == {}
    assert list(out["gpm"]) == ["1"] and out["gpm"]["1"] < 1980, out
