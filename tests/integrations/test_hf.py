"""The Hugging Face Trainer through dcp_fsspec: a tiny GPT-2 built from a config (no download),
trained a few steps on CPU in one process, checkpointed by ``FsspecTrainer`` to moto S3 and to
a local folder, stopped, resumed by a fresh Trainer with ``resume_from_checkpoint``, and its
weights, optimizer and scheduler state bit-identical to a run that was never interrupted.

Single process: the Trainer's multi-process runs go through ``accelerate launch``, which the
test suite does not start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import import_or_skip

import_or_skip("transformers", "the [hf] extra is not installed: pip install -e '.[test]'")

from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from dcp_fsspec import CheckpointerOptions
from dcp_fsspec.errors import CheckpointNotFoundError, InvalidURLError, UsageError
from dcp_fsspec.integrations.hf import FsspecTrainer
from tests.ckpt_helpers import assert_equal
from tests.conftest import Backend

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# Two steps an epoch; the interrupted run stops after step 4, an epoch's end, where the Trainer
# restores the RNG state (mid-epoch it does not).
STEPS, STOP = 8, 4


class _Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _StopAt(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == STOP:
            control.should_training_stop = True
        return control


def _trainer(out: Path, backend: Backend | None, *callbacks: Any, **options: Any) -> FsspecTrainer:
    torch.manual_seed(0)
    # Dropout draws from torch's RNG, so a resume that did not restore it would differ.
    config = GPT2Config(
        vocab_size=32,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    url = backend.url if backend else str(out / "unused")
    storage_options = backend.storage_options if backend else None
    return FsspecTrainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=_Data(),
        callbacks=list(callbacks),
        checkpoint_url=url,
        storage_options=storage_options,
        **options,
    )


def _state(trainer: FsspecTrainer) -> dict[str, Any]:
    return {
        "model": trainer.model.state_dict(),
        "optim": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "step": trainer.state.global_step,
    }


@pytest.fixture(params=["s3", "local"])
def hf_backend(request: pytest.FixtureRequest) -> Backend:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    return backend


# The background saver is tested with S3 by the Checkpointer's own suite: async on local disk only here.
@pytest.mark.parametrize(
    ("hf_backend", "async_mode"),
    [("s3", "disabled"), ("local", "disabled"), ("local", "async_with_pinned_mem")],
    indirect=["hf_backend"],
)
def test_trainer_resumes_from_the_url_bit_identical_and_keeps_save_total_limit(
    hf_backend: Backend, async_mode: str, tmp_path: Path
) -> None:
    plain = _trainer(tmp_path / "plain", None)
    plain.save_strategy = plain.args.save_strategy = "no"
    plain.train()
    expected = _state(plain)

    options = CheckpointerOptions(async_mode=async_mode)
    first = _trainer(tmp_path / "first", hf_backend, _StopAt(), checkpointer_options=options)
    first.train()
    assert first.state.global_step == STOP
    assert first.checkpointer.committed_iterations() == [2, 4]

    resumed = _trainer(tmp_path / "resumed", hf_backend, checkpointer_options=options)
    resumed.train(resume_from_checkpoint=f"{hf_backend.url}/iter_{STOP:09d}")
    assert_equal(expected, _state(resumed))
    assert resumed.checkpointer.committed_iterations() == [STEPS - 2, STEPS]
    assert not list((tmp_path / "resumed").glob("checkpoint-*")), (
        "the Trainer wrote its own checkpoint folders"
    )
    resumed.checkpointer.finalize()
    first.checkpointer.finalize()


def test_resume_true_takes_the_newest_and_errors_name_the_url(local_backend: Backend, tmp_path: Path) -> None:
    empty = _trainer(tmp_path / "empty", local_backend)
    with pytest.raises(CheckpointNotFoundError, match="no committed iteration") as raised:
        empty.train(resume_from_checkpoint=True)
    # As HF's own Trainer raises for output_dir; the message says what a first start passes.
    assert local_backend.url in str(raised.value) and "latest_checkpoint()" in str(raised.value)
    with pytest.raises(InvalidURLError, match="not an iteration of"):
        empty.train(resume_from_checkpoint=local_backend.sub("elsewhere"))
    _trainer(tmp_path / "first", local_backend, _StopAt()).train()
    # The same iteration's folder under another URL is not ours to load (it would have loaded
    # ours, silently).
    with pytest.raises(InvalidURLError, match="not an iteration of"):
        empty.train(resume_from_checkpoint=str(tmp_path / "other" / f"iter_{STOP:09d}"))
    resumed = _trainer(tmp_path / "resumed", local_backend)
    resumed.train(resume_from_checkpoint=resumed.checkpointer.latest_checkpoint())  # what the README shows
    assert resumed.state.global_step == STEPS
    empty.checkpointer.finalize()
    resumed.checkpointer.finalize()


def test_the_trainer_refuses_a_keep_last_n_naming_save_total_limit_and_the_url(
    local_backend: Backend, tmp_path: Path
) -> None:
    options = CheckpointerOptions(keep_last_n=3)
    with pytest.raises(UsageError, match=r"CheckpointerOptions\.keep_last_n.*save_total_limit") as raised:
        _trainer(tmp_path / "out", local_backend, checkpointer_options=options)
    assert local_backend.url in str(raised.value)
