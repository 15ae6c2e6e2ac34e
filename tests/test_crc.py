"""crc32_combine: the CRC-32 of two byte strings joined, from theirs, as zlib computes it whole."""

from __future__ import annotations

import os
import zlib

import pytest

from dcp_fsspec.storage.format.crc import crc32, crc32_combine


@pytest.mark.parametrize(
    ("first", "second"),
    [(0, 1), (1, 0), (0, 0), (3, 7), (1000, 70_000), (5, 16 * 1024 * 1024 + 3), (4096, 1)],
)
def test_the_crc_of_two_joined_strings_is_combined_from_theirs(first: int, second: int) -> None:
    a, b = os.urandom(first), os.urandom(second)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_a_prefix_whose_crc_is_zero_still_counts_as_bytes_before() -> None:
    """A non-empty string can have CRC 0; shifting 0 past any length leaves 0, so the result is
    the second CRC, exactly as zlib computes the joined string's."""
    a = b"\x9d\x0a\xd9\x6d"  # four bytes whose CRC-32 is 0
    assert zlib.crc32(a) == 0
    b = os.urandom(100)
    assert crc32_combine(0, zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("implementation", ["in use", "isal"])
def test_the_crc_pass_in_use_gives_zlibs_values(implementation: str) -> None:
    """ISA-L's CRC-32, where installed, must give zlib's values: it writes the stored CRCs."""
    if implementation == "isal":
        isal_zlib = pytest.importorskip(
            "isal.isal_zlib", reason="isal is not installed (no wheel for this CPU)"
        )
        function = isal_zlib.crc32
    else:
        function = crc32
    data = bytearray(os.urandom(1 << 20))
    view = memoryview(data)[3:]  # a writable view at an odd address, as tensor memory is read
    assert function(view, 0) == zlib.crc32(view)
    assert function(view[1000:], function(view[:1000], 0)) == zlib.crc32(view)  # continued
    assert function(b"", 0) == 0 and function(b"", 12345) == 12345
