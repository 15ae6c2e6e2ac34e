"""The suite's own rules: under CI a backend whose server is missing fails instead of skipping."""

from __future__ import annotations

import pytest

from tests.conftest import _start_or_skip
from tests.servers import ServerUnavailable


class _Missing:
    def start(self) -> None:
        raise ServerUnavailable("az:// tests need Azurite: install Node.js and npm")


def test_a_missing_server_skips_its_tests_on_a_developer_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="install Node.js"):
        _start_or_skip(_Missing())


def test_a_missing_server_fails_its_tests_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true: every backend must run"):
        _start_or_skip(_Missing())
