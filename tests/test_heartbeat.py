"""A long call with no loop of its own still says it is alive (qcompiler/pipeline/heartbeat.py):
asserted on the order of the lines, never on wall time."""

import threading

import pytest

from qcompiler.pipeline.heartbeat import heartbeat


def test_a_long_block_is_announced_beats_until_it_ends_and_says_when_done():
    lines, two_beats = [], threading.Event()

    def log(line):
        lines.append(line)
        if sum("still" in x for x in lines) >= 2:
            two_beats.set()

    with heartbeat(log, "capturing", every=0.01):
        assert two_beats.wait(60)  # the block outlives two beats
    assert lines[0] == "capturing" and lines[1].startswith("... still capturing (")
    assert lines[-1].startswith("capturing: done in ")
    count = len(lines)
    threading.Event().wait(0.05)
    assert len(lines) == count  # no beat after the block ended


def test_a_failing_block_stops_beating_and_says_no_done():
    lines = []
    with pytest.raises(ValueError), heartbeat(lines.append, "loading", every=0.01):
        raise ValueError("bad folder")
    assert lines == ["loading"]


def test_progress_goes_through_the_qcompiler_logger(capsys):
    """Progress lines are the standard logger's: on stderr by default, silenced by its level."""
    import logging

    from qcompiler.pipeline.pass_base import progress_line

    progress_line("block 1/2 done")
    assert capsys.readouterr().err == "[qcompiler] block 1/2 done\n"
    logger = logging.getLogger("qcompiler")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        progress_line("block 2/2 done")
    finally:
        logger.setLevel(level)
    assert capsys.readouterr().err == ""
