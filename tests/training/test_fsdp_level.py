"""A job sharded by FSDP2 with a bf16 mixed-precision policy is a bf16 job."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO
from tests.vmserver import free_port

pytestmark = pytest.mark.torch

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from greend import GreenCallback
    from greend.testing import FakeDaemon

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")
    from pathlib import Path
    fd = FakeDaemon(Path(sys.argv[1]), rows_every_s=0.2).start()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    computes = []
    model[2].register_forward_hook(lambda m, i, o: computes.append(str(o.dtype)))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cb = GreenCallback(job="fsdp-bf16", model=model, socket=sys.argv[1], gpus=[0], connect_timeout_s=2.0)
    for i in range(10):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        with cb.step(samples=len(x), batch=x) as step:
            with step.autocast():
                loss = nn.functional.cross_entropy(model(x).float(), y)
            step.loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    own, offered = cb._control.own, cb._control.offered()
    cb.close()
    time.sleep(0.3)
    print(json.dumps({"own": own, "offered": offered, "computes": sorted(set(computes)),
                      "rows": sorted({r.get("precision") for r in fd.rows})}))
    fd.stop()
    dist.destroy_process_group()
    """
)


def test_an_fsdp2_bf16_policy_makes_a_bf16_job(tmp_path: Path) -> None:
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16) computes in bf16 with fp32 master
    weights and no autocast: greend took the job for fp32 (its rows said fp32, and a step
    down to bf16 would have changed nothing). Its level is the policy's: bf16, nothing
    above it offered."""
    sock = tmp_path / "g.sock"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(sock), str(free_port())], cwd=REPO, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["computes"] == ["torch.bfloat16"], out
    assert out["own"] == "bf16" and "fp32" not in out["offered"] and "tf32" not in out["offered"], out
    assert out["rows"] == ["bf16"], out
