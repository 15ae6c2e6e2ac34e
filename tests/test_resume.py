"""The resume rules as a pure function: facts about storage and options in, a plan (or error) out.

No storage here: each case writes down what :func:`resume.gather` would have found.
"""

from __future__ import annotations

import logging

import pytest

from dcp_fsspec import CheckpointNotFoundError
from dcp_fsspec.checkpoint.load.resume import (
    CHECKPOINT,
    FOLDER,
    POINTER,
    Found,
    KeyToLoad,
    ResumeFacts,
    ResumeOptions,
    plan_resume,
)

RUN = "s3://bucket/run"
OLD = "s3://bucket/old"
WANTED = ["model", "optim", "scheduler", "trainer"]
ALL_KEYS = ("model", "optim", "scheduler", "trainer")


def _pointer(root: str, iteration: int, keys: tuple[str, ...] = ALL_KEYS) -> Found:
    folder = f"{root}/iter_{iteration:09d}"
    return Found(POINTER, root, folder, iteration, {k: f"{folder}/{k}" for k in keys})


def _folder(url: str, iteration: int | None, keys: tuple[str, ...] = ALL_KEYS) -> Found:
    return Found(FOLDER, url, url, iteration, {k: f"{url}/{k}" for k in keys})


def _checkpoint(url: str, entries: tuple[str, ...]) -> Found:
    return Found(CHECKPOINT, url, url, entries=entries)


def test_nothing_under_save_dirname_and_no_load_path_is_a_fresh_start() -> None:
    assert plan_resume(ResumeFacts(None), WANTED, ResumeOptions()) is None


def test_the_pointer_under_save_dirname_gives_every_wanted_key_and_its_iteration() -> None:
    plan = plan_resume(ResumeFacts(_pointer(RUN, 7)), WANTED, ResumeOptions())
    assert plan is not None and plan.iteration == 7 and not plan.from_load_path
    assert plan.keys == {k: KeyToLoad(f"{RUN}/iter_000000007/{k}") for k in WANTED}
    assert plan.source == f"{RUN}/iter_000000007"


def test_the_pointer_under_save_dirname_wins_over_load_path() -> None:
    facts = ResumeFacts(_pointer(RUN, 7), _folder(f"{OLD}/iter_000000004", 4))
    plan = plan_resume(facts, WANTED, ResumeOptions(load_training_state=True))
    assert plan is not None and plan.iteration == 7 and plan.source == f"{RUN}/iter_000000007"


def test_a_wanted_key_the_pointed_iteration_lacks_is_an_error_naming_it_and_the_folder() -> None:
    facts = ResumeFacts(_pointer(RUN, 7, ("model", "optim")))
    with pytest.raises(CheckpointNotFoundError) as info:
        plan_resume(facts, ["model", "ema"], ResumeOptions())
    assert "'ema'" in str(info.value) and f"{RUN}/iter_000000007" in str(info.value)


def test_without_strict_resume_a_missing_key_is_skipped_with_a_note() -> None:
    plan = plan_resume(
        ResumeFacts(_pointer(RUN, 7, ("model",))), ["model", "ema"], ResumeOptions(strict=False)
    )
    assert plan is not None and list(plan.keys) == ["model"]
    assert [level for level, _ in plan.notes] == [logging.INFO] and "'ema'" in plan.notes[0][1]


def test_load_path_gives_the_model_only_and_iteration_zero() -> None:
    plan = plan_resume(ResumeFacts(None, _folder(f"{OLD}/iter_000000004", 4)), WANTED, ResumeOptions())
    assert plan is not None and plan.iteration == 0 and plan.from_load_path
    assert list(plan.keys) == ["model"]


def test_load_path_with_training_state_gives_every_key_and_the_iteration_in_its_name() -> None:
    options = ResumeOptions(load_training_state=True)
    plan = plan_resume(ResumeFacts(None, _pointer(OLD, 4)), WANTED, options)
    assert plan is not None and plan.iteration == 4 and sorted(plan.keys) == sorted(WANTED)


def test_only_load_scheduler_state_adds_the_scheduler_and_keeps_iteration_zero() -> None:
    options = ResumeOptions(only_load_scheduler_state=True)
    url = f"{OLD}/iter_000000004"
    plan = plan_resume(ResumeFacts(None, _folder(url, 4)), WANTED, options)
    assert plan is not None and plan.iteration == 0
    assert plan.keys == {"model": KeyToLoad(f"{url}/model"), "scheduler": KeyToLoad(f"{url}/scheduler")}


def test_a_folder_not_named_iter_resumes_at_zero_with_a_warning() -> None:
    plan = plan_resume(
        ResumeFacts(None, _folder(f"{OLD}/final", None)), WANTED, ResumeOptions(load_training_state=True)
    )
    assert plan is not None and plan.iteration == 0
    assert [level for level, _ in plan.notes] == [logging.WARNING] and f"{OLD}/final" in plan.notes[0][1]


def test_a_load_path_holding_no_checkpoint_is_an_error_naming_it() -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        plan_resume(ResumeFacts(None, _folder(f"{OLD}/empty", None, ())), WANTED, ResumeOptions())
    assert f"{OLD}/empty" in str(info.value)


@pytest.mark.parametrize(
    ("entries", "nested_under"),
    [
        (("0.weight", "0.bias", "2.weight", "2.bias"), None),  # the model's own state dict
        (("model.0.weight", "model.0.bias", "model.2.weight"), "model"),  # dcp.save({"model": state})
        (("model.0.weight", "head.bias"), None),  # not all under model.: the names are the model's
    ],
)
def test_a_single_checkpoint_is_the_model_nested_or_not_as_its_entry_names_say(
    entries: tuple[str, ...], nested_under: str | None
) -> None:
    plan = plan_resume(ResumeFacts(None, _checkpoint(f"{OLD}/weights", entries)), WANTED, ResumeOptions())
    assert plan is not None and plan.iteration == 0
    assert plan.keys == {"model": KeyToLoad(f"{OLD}/weights", nested_under)}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (ResumeOptions(load_training_state=True), "load_training_state"),
        (ResumeOptions(only_load_scheduler_state=True), "only_load_scheduler_state"),
    ],
)
def test_a_single_checkpoint_asked_for_more_than_the_model_is_an_error_naming_the_option(
    options: ResumeOptions, named: str
) -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        plan_resume(ResumeFacts(None, _checkpoint(f"{OLD}/weights", ("model.w",))), WANTED, options)
    assert (
        f"{OLD}/weights" in str(info.value) and named in str(info.value) and "'scheduler'" in str(info.value)
    )
