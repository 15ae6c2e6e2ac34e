"""Laws, checked on many generated inputs (hypothesis): URL normalisation, iteration names,
retention's plan and the range coalescer. Each is a pure function the commit protocol or the
reader rests on, where one wrong edge case would lose or misread a checkpoint."""

from __future__ import annotations

import os
import posixpath

from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_fsspec.checkpoint.commit import layout, retention
from dcp_fsspec.errors import InvalidURLError
from dcp_fsspec.storage.read.fetch import plan_spans
from dcp_fsspec.storage.transport.urls import normalize_url

segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-.", min_size=1, max_size=8).filter(
    lambda s: s not in (".", "..")
)
paths = st.lists(segment, min_size=1, max_size=5)


@given(paths, st.booleans())
def test_normalising_a_url_is_idempotent_and_keeps_its_segments(parts: list[str], trailing: bool) -> None:
    url = "s3://" + "/".join(parts) + ("/" if trailing else "")
    once = normalize_url(url)
    assert normalize_url(once) == once
    assert once == "s3://" + "/".join(parts)


@given(paths, st.integers(min_value=1, max_value=len(["x"]) + 3))
def test_a_url_with_an_empty_segment_is_refused_with_a_fix_that_normalises(
    parts: list[str], extra: int
) -> None:
    url = "s3://" + parts[0] + "/" * (1 + extra) + "/".join(parts[1:] or ["k"])
    try:
        normalize_url(url)
    except InvalidURLError as e:
        fixed = str(e).rsplit("did you mean ", 1)[1].rstrip("?").strip("'")
        assert "//" not in fixed.split("://", 1)[1] and normalize_url(fixed) == fixed
    else:
        raise AssertionError(f"{url} was accepted")


@given(paths)
def test_a_relative_local_path_becomes_absolute_below_the_working_directory(parts: list[str]) -> None:
    path = normalize_url(os.path.join(*parts))
    assert os.path.isabs(path) and path.startswith(os.getcwd())
    assert posixpath.normpath(path) == path


@given(st.integers(min_value=0, max_value=10**12))
def test_iteration_names_round_trip(iteration: int) -> None:
    name = layout.format_iteration(iteration)
    assert layout.parse_iteration(name) == iteration
    assert layout.parse_iteration("s3://b/run/" + name + "/") == iteration


@given(st.text(max_size=20))
def test_anything_parsed_as_an_iteration_is_named_like_one(text: str) -> None:
    parsed = layout.parse_iteration(text)
    if parsed is not None:
        name = posixpath.basename(text.rstrip("/"))
        assert name.startswith("iter_") and name[5:].isdigit() and int(name[5:]) == parsed


@settings(max_examples=300)
@given(
    st.sets(st.integers(min_value=0, max_value=60), max_size=25),
    st.data(),
    st.integers(min_value=1, max_value=6),
)
def test_retention_keeps_the_newest_n_committed_the_pointer_and_everything_newer(
    iterations: set[int], data: st.DataObject, keep: int
) -> None:
    committed = data.draw(st.sets(st.sampled_from(sorted(iterations)))) if iterations else set()
    latest = data.draw(st.sampled_from(sorted(committed))) if committed else None
    protected = data.draw(st.sets(st.integers(min_value=0, max_value=70), max_size=3))
    plan = set(
        retention.plan_deletions(iterations, committed, keep_last_n=keep, latest=latest, protected=protected)
    )
    assert plan <= iterations
    if latest is None:
        assert not plan  # nothing is deleted before a pointer exists
        return
    assert all(i < latest for i in plan) and not plan & protected  # never the pointer's, newer, or in flight
    older_committed = sorted(i for i in committed if i < latest)
    newest = set((older_committed + [latest])[-keep:])
    assert not plan & newest  # the newest N committed survive
    # Everything else older than the pointer goes: old committed ones and the debris of failed saves.
    assert plan == {i for i in iterations if i < latest} - newest - protected


ranges = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 10_000), st.integers(1, 3_000)).map(
        lambda t: (t[0], t[1], t[1] + t[2])
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300)
@given(ranges, st.integers(0, 500), st.integers(1, 4_000))
def test_coalesced_spans_cover_every_requested_byte_within_the_limits(
    requested: list[tuple[str, int, int]], max_gap: int, max_span: int
) -> None:
    spans = plan_spans(requested, max_gap=max_gap, max_span=max_span)
    assert all(0 < s.size <= max_span for s in spans)
    assert spans == sorted(spans, key=lambda s: (s.path, s.start))
    for path, start, end in requested:
        covered = sorted(
            (s.start, s.end) for s in spans if s.path == path and s.start < end and s.end > start
        )
        position = start
        for lo, hi in covered:
            assert lo <= position
            position = max(position, hi)
        assert position >= end, (path, start, end)
    # Nothing is fetched that no request needs, beyond gaps of at most max_gap (a cut piece
    # could lie inside a gap only if it were shorter than the gap: not with the reader's limits).
    if max_span <= max_gap:
        return
    for span in spans:
        inside = [(s, e) for p, s, e in requested if p == span.path and s < span.end and e > span.start]
        assert inside
