"""CRC-32 (zlib's polynomial) of byte ranges, and the CRC of two ranges joined from theirs.

A save checksums every byte twice over if it is not careful: the CRC-32 each tensor record
stores (torch's zip format) and the checksum S3 checks on every request body. Both are CRC-32,
so one pass can serve both: the CRC of each piece of a tensor that lands in one request body is
computed once and combined, without reading the bytes again, into the record's CRC and into the
body's (:func:`crc32_combine`: the GF(2) polynomial arithmetic of zlib's ``crc32_combine``,
which Python's ``zlib`` does not expose).

The pass itself is :data:`crc32`: ISA-L's (the ``isal`` package, a dependency on the CPUs it
has wheels for, several times faster), else zlib's, the same values.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Union

Buffer = Union[bytes, bytearray, memoryview]

# zlib's CRC-32 polynomial, bit-reversed; polynomials below are bit-reversed too (x^0 is the top bit).
_POLY = 0xEDB88320
_ONE = 1 << 31  # x^0


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial."""
    product = 0
    m = _ONE
    while a:
        if a & m:
            product ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for k = 0…31 (zlib's ``x2n_table``)."""
    table, p = [], _ONE >> 1  # x^1
    for _ in range(32):
        table.append(p)
        p = _multiply(p, p)
    return table


_X_2K = _powers()


def _x_to_8n(n: int) -> int:
    """``x^(8n)`` modulo the polynomial: what shifting a CRC past ``n`` bytes multiplies it by."""
    p, k = _ONE, 3
    while n:
        if n & 1:
            p = _multiply(_X_2K[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` = CRC-32 of ``A``, ``crc2`` of ``B`` and ``len2`` = ``len(B)``.

    It costs as much as a CRC pass over a few kilobytes, whatever the lengths: worth it only for
    larger pieces (:data:`COMBINE_ABOVE`).
    """
    if not crc1:  # the CRC of an empty A, or of any A whose CRC is 0: either way A adds nothing
        return crc2
    return _multiply(_x_to_8n(len2), crc1) ^ crc2


# Pieces shorter than this are cheaper to checksum twice than to combine.
COMBINE_ABOVE = 16 * 1024


def _fastest_crc32() -> Callable[[Buffer, int], int]:
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:  # not installed where isal has no wheel: zlib computes the same CRC, slower
        return zlib.crc32
    return isal_crc32


crc32: Callable[[Buffer, int], int] = _fastest_crc32()
"""``crc32(data, start)``: zlib's CRC-32 of ``data`` continuing from ``start`` (0: from scratch)."""
