"""A new user's environment: torch does not install numpy, so nothing on our paths may need it.

The full proof is ``.ci/clean-install`` (a venv holding only torch, then ``pip install .``); this
is its quick twin inside the suite: a fresh interpreter where ``import numpy`` fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_ROUND_TRIP = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # import numpy now raises ImportError, as in a torch-only venv
    import torch
    from dcp_fsspec import Checkpointer

    model = torch.nn.Linear(16, 8)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    with Checkpointer(sys.argv[1]) as ckpt:
        ckpt.save(5, model=model, optim=optim)
    fresh = torch.nn.Linear(16, 8)
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    with Checkpointer(sys.argv[1]) as ckpt:
        assert ckpt.load(model=fresh, optim=fresh_optim) == 5
    assert torch.equal(fresh.weight, model.weight)
    assert "numpy" not in sys.modules or sys.modules["numpy"] is None
    print("round trip ok")
    """
)


def test_save_and_load_work_where_numpy_is_not_installed(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIP, str(tmp_path / "ckpt")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "round trip ok" in done.stdout
