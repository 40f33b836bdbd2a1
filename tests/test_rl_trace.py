"""Preemption traces (ditsp.rl.trace): the format read back, and every bad file refused in one line naming
the file, the line and the problem."""

from __future__ import annotations

import pytest

from ditsp.rl.trace import DEFAULT_GRACE_S, Event, TraceError, load, parse, steady

GOOD = """# a spot fleet of two
0     join  spot0
0     join  spot1
4.5   leave spot0  1.0   # preempted with a second's warning
9     join  spot0
12    leave spot1
"""


def test_a_trace_reads_back_as_its_events():
    tr = parse(GOOD, "fleet.txt")
    assert tr.events == (Event(0.0, "join", "spot0"), Event(0.0, "join", "spot1"), Event(4.5, "leave", "spot0", 1.0),
                         Event(9.0, "join", "spot0"), Event(12.0, "leave", "spot1", DEFAULT_GRACE_S))
    assert tr.workers == ["spot0", "spot1"]
    assert tr.members_at(0) == {"spot0", "spot1"}
    assert tr.members_at(4.5) == {"spot1"}
    assert tr.members_at(10) == {"spot0", "spot1"}
    assert tr.members_at(100) == {"spot0"}
    assert tr.preemptions() == 2


def test_a_trace_is_read_from_its_file(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(GOOD)
    assert load(p).events == parse(GOOD).events
    with pytest.raises(TraceError, match=r"missing\.txt: cannot read the trace"):
        load(tmp_path / "missing.txt")


def test_steady_is_workers_that_never_leave():
    tr = steady(3)
    assert tr.members_at(1e9) == {"spot0", "spot1", "spot2"} and tr.preemptions() == 0
    with pytest.raises(TraceError):
        steady(0)


@pytest.mark.parametrize("text, message", [
    ("", "t.txt: the trace holds no event"),
    ("# only a comment\n", "holds no event"),
    ("0 join\n", "t.txt line 1: expected 'time_s event worker [grace_s]'"),
    ("0 join a 1 2\n", "line 1: expected"),
    ("soon join a\n", "line 1: the time must be a number of seconds, got 'soon'"),
    ("-1 join a\n", "line 1: the time must be a finite number of seconds >= 0, got '-1'"),
    ("nan join a\n", "finite number"),
    ("inf join a\n", "finite number"),
    ("0 arrive a\n", "line 1: the event must be one of join, leave, got 'arrive'"),
    ("0 join a/b\n", "line 1: a worker name is 1-64 letters"),
    ("0 join a\n\n2 leave a\n1 join a\n", "line 4: times must not decrease (1 s after 2 s)"),
    ("0 join a 3\n", "line 1: only a leave takes a grace period"),
    ("0 join a\n1 leave a soon\n", "line 2: the grace period must be a number of seconds, got 'soon'"),
    ("0 join a\n1 leave a -2\n", "line 2: the grace period must be a finite number"),
    ("0 join a\n1 join a\n", "line 2: a joins at 1 s but is already in the run"),
    ("0 leave a\n", "line 1: a leaves at 0 s but is not in the run"),
    ("0 join a\n1 leave a\n2 leave a\n", "line 3: a leaves at 2 s but is not in the run"),
])
def test_a_bad_trace_is_one_line_naming_the_line(text, message):
    with pytest.raises(TraceError) as e:
        parse(text, "t.txt")
    assert message in str(e.value)
    assert "\n" not in str(e.value)
