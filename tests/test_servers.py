"""The test servers themselves: where a program is missing, tests skip saying what to install."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.servers import ServerUnavailable
from tests.servers.azurite import find_or_install_azurite


def test_azurite_without_node_is_unavailable_with_a_reason_naming_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no node, no npm, no azurite-blob
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing installed there either
    with pytest.raises(ServerUnavailable) as raised:
        find_or_install_azurite()
    assert "Node.js" in str(raised.value) and "azurite-blob" in str(raised.value)
