"""benchmarks/step_timeline.py: device-idle time charged to the innermost host phase."""

from __future__ import annotations

import sys

import pytest

from specserve.entrypoints.cli import BENCHMARKS_DIR

sys.path.insert(0, str(BENCHMARKS_DIR))
import step_timeline  # noqa: E402  (a script beside the package, not inside it)


def _range(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _kernel(ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}


def test_idle_time_goes_to_the_innermost_open_phase():
    """One step of 100 us: schedule 0-10, forward 10-60 (its kernel runs 30-80, past the
    forward's return: launched asynchronously), commit 80-100. The device idles 0-30 and
    80-100: 10 us in schedule, 20 in forward (before its kernel starts), 20 in commit; the
    gap 60-80 between the phases is the step's own host time, covered by the kernel."""
    trace = {"traceEvents": [
        _range("step", 0, 100), _range("schedule", 0, 10), _range("forward", 10, 50),
        _range("commit", 80, 20), _kernel(30, 50),
        _kernel(200, 10),  # outside every step: ignored
    ]}
    idle, host, total, busy, steps = step_timeline.idle_by_phase(trace)
    assert steps == 1 and total == pytest.approx(100) and busy == pytest.approx(50)
    assert idle == pytest.approx({"schedule": 10, "forward": 20, "commit": 20})
    assert host == pytest.approx({"schedule": 10, "forward": 50, "step": 20, "commit": 20})


def test_overlapping_kernels_count_once_and_steps_add_up():
    trace = {"traceEvents": [
        _range("step", 0, 50), _range("forward", 0, 50), _kernel(10, 20), _kernel(20, 20),
        _range("step", 100, 50), _range("forward", 100, 50), _kernel(100, 50),
    ]}
    idle, _, total, busy, steps = step_timeline.idle_by_phase(trace)
    assert steps == 2 and total == pytest.approx(100)
    assert busy == pytest.approx(30 + 50)  # 10-40 merged, then the whole second step
    assert idle == pytest.approx({"forward": 20})


def test_wrappers_restore_what_they_wrapped():
    """labelled() and phase_seconds() put methods back as they were (instance attributes
    removed again, or the previous instance attribute restored)."""
    class Thing:
        def work(self) -> int:
            return 7

    thing = Thing()
    with step_timeline.labelled(thing, "work", "w"):
        assert thing.work() == 7 and "work" in vars(thing)
    assert "work" not in vars(thing)
    own = thing.work
    thing.work = own
    with step_timeline.labelled(thing, "work", "w"):
        assert thing.work is not own
    assert thing.work is own
