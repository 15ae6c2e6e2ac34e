"""CheckpointerOptions: the Checkpointer's keyword-only options as one value, for integrations."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from dcp_fsspec import Checkpointer, CheckpointerOptions
from dcp_fsspec.checkpoint.checkpointer import ASYNC_PINNED
from dcp_fsspec.errors import UsageError
from tests.conftest import Backend


def test_checkpointer_options_are_the_checkpointers_keyword_only_parameters_with_their_defaults() -> None:
    parameters = inspect.signature(Checkpointer).parameters.values()
    keyword_only = [(p.name, p.default) for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [(f.name, f.default) for f in dataclasses.fields(CheckpointerOptions)] == keyword_only


def test_checkpointer_options_build_a_checkpointer_as_its_keywords_do(local_backend: Backend) -> None:
    options = CheckpointerOptions(keep_last_n=1)
    with Checkpointer(local_backend.url, **options.as_kwargs()) as ckpt:
        ckpt.save(1, extra={"step": 1})
        ckpt.save(2, extra={"step": 2})
        assert ckpt.committed_iterations() == [2]


def test_an_option_the_integration_decides_is_refused_naming_the_owner_and_what_to_do() -> None:
    owner = "Integration('s3://bucket/run')"
    options = CheckpointerOptions(async_mode=ASYNC_PINNED)
    expected = r"CheckpointerOptions\.async_mode itself: leave it unset and save in order"
    with pytest.raises(UsageError, match=expected) as raised:
        options.require_default(owner, {"keep_last_n": "use the other one", "async_mode": "save in order"})
    assert owner in str(raised.value)


def test_an_option_left_at_its_default_is_not_refused() -> None:
    CheckpointerOptions(verify_before_commit=True).require_default(
        "Integration", {"async_mode": "save in order"}
    )
