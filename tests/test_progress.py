"""The count of symbolic runs behind the progress line: announced ahead as a floor, raised by a
run nobody announced, and the time left estimated from a command's own finished runs."""

import pytest

from memsim.tracer import progress


@pytest.fixture
def clock(monkeypatch):
    """A fresh count and a clock the test moves."""
    now = [100.0]
    monkeypatch.setattr(progress, "_traces", 0)
    monkeypatch.setattr(progress, "_expected", 0)
    monkeypatch.setattr(progress, "_began", [])
    monkeypatch.setattr(progress, "_took", [])
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    return now


def test_announced_runs_are_a_floor(clock):
    progress.expect(3)
    assert progress.expected() == 3
    progress.expect(2)            # the same runs announced again lower down: nothing added
    assert progress.expected() == 3
    for _ in range(4):            # a fourth nobody announced raises the count as it starts
        progress.started()
        progress.finished()
    assert (progress.traces(), progress.expected()) == (4, 4)
    progress.expect(2)
    assert progress.expected() == 6


def test_time_left_from_the_commands_own_runs(clock):
    progress.started()            # a run of an earlier command: 50 s
    clock[0] += 50
    progress.finished()
    since = progress.traces()     # a new command: 3 runs
    progress.expect(3)
    progress.started()
    assert progress.estimate(since) is None   # none of its runs has finished
    clock[0] += 10
    progress.finished()
    progress.started()
    clock[0] += 4                 # 4 s into the second: 6 s of it and the third's 10 s left
    assert progress.estimate(since) == pytest.approx(16.0)
    clock[0] += 20                # longer than the mean: only the third is left
    assert progress.estimate(since) == pytest.approx(10.0)
