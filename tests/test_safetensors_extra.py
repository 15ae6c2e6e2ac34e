"""What the ``safetensors`` extra is for, as the README's extras table says it.

Folder exports (``to-safetensors`` into a folder, ``SafetensorsExport``) write safetensors with
our own code, and ``SafetensorsStorageReader`` reads them: neither needs the package. One
``.safetensors`` file is written by the package: without it, the error names the file and the
extra, before anything is read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dcp_fsspec import Checkpointer, MissingDriverError, cli
from dcp_fsspec.tools.convert import to_safetensors

REPO = Path(__file__).resolve().parents[1]

_FOLDER_EXPORTS = textwrap.dedent(
    """
    import sys
    sys.modules["safetensors"] = None  # importing it now raises ImportError, as where it is not installed
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_fsspec import Checkpointer, SafetensorsExport, SafetensorsStorageReader
    from dcp_fsspec.tools.safetensors.export import export_safetensors

    run = sys.argv[1]
    model = {"weight": torch.randn(8, 4)}
    export = SafetensorsExport(run + "/hf/step-{iteration}", dtype=torch.bfloat16)
    with Checkpointer(run + "/checkpoints", keep_last_n=2, on_event=export) as ckpt:
        ckpt.save(10, model=model)
    export.close()
    export_safetensors(run + "/checkpoints", run + "/hf/by-hand")
    for folder, dtype in (("step-10", torch.bfloat16), ("by-hand", torch.float32)):
        back = {"weight": torch.zeros(8, 4, dtype=dtype)}
        dcp.load(back, storage_reader=SafetensorsStorageReader(run + "/hf/" + folder), no_dist=True)
        assert torch.equal(back["weight"], model["weight"].to(dtype)), folder
    assert sys.modules.get("safetensors") is None  # nothing got it some other way
    print("folder exports ok")
    """
)


def test_folder_exports_and_their_reader_work_where_safetensors_is_not_installed(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", _FOLDER_EXPORTS, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "folder exports ok" in done.stdout


@pytest.fixture
def without_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import safetensors`` fails from now on, as where it is not installed."""
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)


def _saved(tmp_path: Path) -> str:
    url = str(tmp_path / "run")
    with Checkpointer(url) as ckpt:
        ckpt.save(1, model={"w": torch.ones(4)})
    return url


@pytest.mark.usefixtures("without_safetensors")
def test_one_safetensors_file_without_the_package_raises_missing_driver_naming_the_file_and_extra(
    tmp_path: Path,
) -> None:
    out = str(tmp_path / "model.safetensors")
    with pytest.raises(MissingDriverError) as raised:
        to_safetensors(_saved(tmp_path), out)
    assert isinstance(raised.value, ImportError)
    assert out in str(raised.value) and "pip install 'dcp-fsspec[safetensors]'" in str(raised.value)
    assert not os.path.exists(out)


@pytest.mark.usefixtures("without_safetensors")
def test_to_safetensors_into_one_file_without_the_package_exits_5_naming_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "model.safetensors")
    code = cli.main(["to-safetensors", _saved(tmp_path), out])
    err = capsys.readouterr().err
    assert code == 5, err
    assert len(err.strip().splitlines()) == 1 and out in err and "dcp-fsspec[safetensors]" in err
