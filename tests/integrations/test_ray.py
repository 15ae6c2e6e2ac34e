"""Ray Train through dcp_fsspec: a real local Ray cluster (2 CPUs), a ``TorchTrainer`` with 2
workers (real gloo ranks, DDP on CPU) training a tiny model a few steps, checkpointing to the
run's storage path (moto S3, a local folder) with :class:`RayTrainCheckpointer`, and a second
``fit`` resuming from what Ray reported: weights and optimizer state bit-identical to a run that
was never interrupted.

Each worker is a process Ray starts: the cluster is given this checkout on ``PYTHONPATH``, and
the S3 endpoint and credentials travel as ``storage_options`` (pyarrow's ``S3FileSystem`` for
Ray's own files), not through the environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip("ray.train", "the [ray] extra is not installed: pip install -e '.[test]'")

import pyarrow.fs
import ray
import ray.train
from ray.train.torch import TorchTrainer

from dcp_fsspec.local_s3 import REGION, LocalS3Server
from tests.ckpt_helpers import assert_equal

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
SAVE_EVERY = 3  # the first fit stops after its save at step 3; the second resumes there

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    # The workers import dcp_fsspec and this module from this checkout, not an installed copy.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    try:
        yield
    finally:
        ray.shutdown()


def _train(config: dict[str, Any]) -> None:
    """The worker loop: resume (from ``load_path`` if the run has no checkpoint), train to
    ``config["stop"]``, save every ``SAVE_EVERY`` steps (if ``storage_options`` is given), and
    write rank 0's final state and start step to ``out``. With ``commit_unreported``, then
    commit iteration ``STEPS`` without reporting it, as a worker that died before its report."""
    from ray.train.torch import prepare_model

    from dcp_fsspec.integrations.ray import RayTrainCheckpointer

    torch.manual_seed(0)
    model = prepare_model(
        torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank = ray.train.get_context().get_world_rank()
    checkpoints = None
    start = 0
    if config["storage_options"] is not None:
        checkpoints = RayTrainCheckpointer(config["storage_options"], load_path=config.get("load_path"))
        start = checkpoints.load(model=model, optim=optim)
    for step in range(start, config["stop"]):
        data = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch, every step
        x, y = torch.randn(8, 6, generator=data), torch.randn(8, 3, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if checkpoints is not None and (step + 1) % SAVE_EVERY == 0:
            checkpoints.save_and_report(step + 1, {"loss": loss.item()}, model=model, optim=optim)
    if checkpoints is not None:
        if config.get("commit_unreported"):
            checkpoints.checkpointer.save(STEPS, model=model, optim=optim)
        checkpoints.finalize()
    if rank == 0:
        module = getattr(model, "module", model)  # DDP's wrapper
        torch.save({"start": start, "model": module.state_dict(), "optim": optim.state_dict()}, config["out"])


def _fit(
    out: Path,
    stop: int,
    storage_options: dict[str, Any] | None,
    *,
    loop: dict[str, Any] | None = None,
    **run: Any,
) -> ray.train.Result:
    trainer = TorchTrainer(
        _train,
        train_loop_config={"out": str(out), "stop": stop, "storage_options": storage_options, **(loop or {})},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(**run),
    )
    return trainer.fit()


def _load(out: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(out, weights_only=True)
    return loaded


@pytest.fixture(scope="module")
def straight(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final state of a run of ``STEPS`` steps that was never interrupted (no checkpoints)."""
    folder = tmp_path_factory.mktemp("straight")
    _fit(folder / "straight.pt", STEPS, None, name="straight", storage_path=str(folder))
    return _load(folder / "straight.pt")


def _assert_resumed_exactly(straight: dict[str, Any], resumed: Path, start: int) -> None:
    """``resumed`` (a run's output) started at ``start`` and ended where an uninterrupted run does."""
    after = _load(resumed)
    assert after["start"] == start
    assert_equal(after["model"], straight["model"], "model")
    assert_equal(after["optim"], straight["optim"], "optim")


@pytest.mark.slow  # a Ray cluster, and a worker group per fit: about a minute each on 2 busy cores
@pytest.mark.timeout(900)
def test_a_new_run_resumes_bit_identically_from_a_checkpoint_ray_reported_on_s3(
    straight: dict[str, Any], s3_server: LocalS3Server, tmp_path: Path
) -> None:
    """Saved to S3 by run "first" and reported with NO_UPLOAD; run "second" (a fresh folder)
    starts from the ``result.checkpoint`` Ray returned (``load_path``, Ray Train v2's way)."""
    bucket = f"ray-{os.urandom(6).hex()}"
    s3_server.create_bucket(bucket)
    ray_fs = pyarrow.fs.S3FileSystem(
        access_key=s3_server.storage_options()["key"],
        secret_key=s3_server.storage_options()["secret"],
        endpoint_override=s3_server.endpoint_url.partition("://")[2],
        scheme="http",
        region=REGION,
    )
    options = s3_server.storage_options()
    first = _fit(
        tmp_path / "first.pt",
        SAVE_EVERY,
        options,
        name="first",
        storage_path=bucket,
        storage_filesystem=ray_fs,
    )
    assert first.checkpoint is not None
    assert first.checkpoint.path == f"{bucket}/first/dcp/iter_000000003"  # where we wrote it, not a copy
    second = _fit(
        tmp_path / "second.pt",
        STEPS,
        options,
        name="second",
        storage_path=bucket,
        storage_filesystem=ray_fs,
        loop={"load_path": first.checkpoint},
    )
    assert second.checkpoint is not None and second.checkpoint.path == f"{bucket}/second/dcp/iter_000000006"
    _assert_resumed_exactly(straight, tmp_path / "second.pt", SAVE_EVERY)


@pytest.mark.slow  # a Ray cluster, and a worker group per fit: about a minute each on 2 busy cores
@pytest.mark.timeout(900)
def test_a_restarted_run_resumes_bit_identically_from_what_ray_reported_in_a_local_folder(
    straight: dict[str, Any], tmp_path: Path
) -> None:
    """The same run (name and storage path) fitted again after it reported step 3 and then
    committed a stale step 6 it never reported: the worker resumes from Ray's checkpoint
    (``ray.train.get_checkpoint()``), not the newer commit, and saving step 6 replaces it."""
    storage = str(tmp_path / "runs")
    first = _fit(
        tmp_path / "first.pt",
        SAVE_EVERY,
        {},
        name="run",
        storage_path=storage,
        loop={"commit_unreported": True},
    )
    assert first.checkpoint is not None and first.checkpoint.path == f"{storage}/run/dcp/iter_000000003"
    _fit(tmp_path / "again.pt", STEPS, {}, name="run", storage_path=storage)
    _assert_resumed_exactly(straight, tmp_path / "again.pt", SAVE_EVERY)


def test_a_ray_storage_filesystem_maps_to_the_fsspec_url_of_the_same_place() -> None:
    """What Ray makes of a storage path (a pyarrow filesystem and a path on it) → our URL."""
    import fsspec

    from dcp_fsspec.integrations.ray import _fsspec_url

    assert _fsspec_url(pyarrow.fs.LocalFileSystem(), "/runs/a/dcp") == "/runs/a/dcp"
    assert _fsspec_url(pyarrow.fs.S3FileSystem(anonymous=True), "bucket/runs/a") == "s3://bucket/runs/a"
    wrapped = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fsspec.filesystem("memory")))
    assert _fsspec_url(wrapped, "/runs/a") == "memory:///runs/a"


def test_a_ray_storage_filesystem_without_an_fsspec_counterpart_is_an_error_naming_the_path() -> None:
    from dcp_fsspec.errors import InvalidURLError
    from dcp_fsspec.integrations.ray import _fsspec_url

    subtree = pyarrow.fs.SubTreeFileSystem("/base", pyarrow.fs.LocalFileSystem())
    with pytest.raises(InvalidURLError, match="runs/a.*storage_filesystem="):
        _fsspec_url(subtree, "runs/a")


@pytest.mark.parametrize("decided", ["async_mode", "local_tier", "keep_last_n", "resume", "incremental"])
def test_an_option_ray_decides_is_refused_naming_it(decided: str, tmp_path: Path) -> None:
    """Refused before Ray is asked for its context: no cluster is needed."""
    from dcp_fsspec import CheckpointerOptions, LocalTier, ResumeOptions
    from dcp_fsspec.errors import UsageError
    from dcp_fsspec.integrations.ray import RayTrainCheckpointer

    value = {
        "async_mode": "async_with_pinned_mem",
        "local_tier": LocalTier(str(tmp_path)),
        "keep_last_n": 2,
        "resume": ResumeOptions(load_path=str(tmp_path)),
        "incremental": True,
    }[decided]
    with pytest.raises(
        UsageError, match=rf"RayTrainCheckpointer decides CheckpointerOptions\.{decided} itself"
    ):
        RayTrainCheckpointer(checkpointer_options=CheckpointerOptions(**{decided: value}))


def test_incremental_is_refused_saying_why_and_what_gives_incremental_saves_instead() -> None:
    from dcp_fsspec import CheckpointerOptions
    from dcp_fsspec.errors import UsageError
    from dcp_fsspec.integrations.ray import RayTrainCheckpointer

    with pytest.raises(UsageError) as raised:
        RayTrainCheckpointer(checkpointer_options=CheckpointerOptions(incremental=True))
    message = str(raised.value)
    assert "num_to_keep deletes a checkpoint's folder whole" in message
    assert "Checkpointer(incremental=True, keep_last_n=...)" in message
