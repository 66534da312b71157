"""A streamed job redelivered after a crash: the caller sees every character exactly once."""

from __future__ import annotations

import pytest

from gateway.streams import StreamDiverged, _Dedup


def test_a_new_attempt_resends_nothing_already_sent() -> None:
    dedup = _Dedup()
    assert dedup.fresh("1", "The qu") == "The qu"
    assert dedup.fresh("1", "ick") == "ick"
    # The worker died; attempt 2 streams from the first token again.
    assert dedup.fresh("2", "The") == ""
    assert dedup.fresh("2", " quick br") == " br"
    assert dedup.fresh("2", "own fox") == "own fox"
    assert dedup.sent == "The quick brown fox"


def test_a_new_attempt_that_says_something_else_ends_the_stream() -> None:
    dedup = _Dedup()
    dedup.fresh("1", "The quick")
    with pytest.raises(StreamDiverged):
        dedup.fresh("2", "A slow")
