"""A callback made just before ``torch.compile``: the script goes on (it once died there)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.support import REPO

pytestmark = [pytest.mark.torch, pytest.mark.slow]  # (three interpreters with torch: about 11 s)

SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn
    from greend import GreenCallback

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    import sys
    levels = sys.argv[1].split(",") if sys.argv[1] else None
    cb = GreenCallback(job="compile-race", model=model, socket="/nonexistent/greend.sock", gpus=[0],
                       initial_precision="bf16", connect_timeout_s=0.1, precisions=levels, fp8_min_features=16)
    cmodel = torch.compile(model, backend="eager")  # the user's next line
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(3):
        with cb.step(samples=len(x), batch=x) as step:
            with step.autocast():
                loss = nn.functional.cross_entropy(cmodel(x), y)
            step.loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    cb.close()
    print("ok", step.precision)
    """
)


@pytest.mark.parametrize("levels", ["", "bf16,fp8-emulated"])
def test_torch_compile_right_after_the_callback_runs(levels: str) -> None:
    """The constructor imported torch._dynamo (and, where fp8 runs, torchao.float8, which
    imports torch._inductor) on a thread of its own while the user's next line,
    torch.compile, imported the same modules: a half-initialised torch._inductor or a
    _DeadlockError ended the script (4 of 4 runs). It imports them on the caller's thread
    now; three runs, each must train its steps."""
    if levels and importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed (pip install '.[fp8]')")
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", SCRIPT, levels], cwd=REPO, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip().endswith("ok bf16"), r.stderr[-3000:]
