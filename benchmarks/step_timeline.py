"""Where an engine step's wall time goes that the GPU does not cover: a torch.profiler timeline
of steady-state steps, with the engine's phases labelled, reduced to "GPU idle time per phase".

On a GPU an engine step is host work (scheduling, planning, building inputs, committing tokens)
around device work (graph replays). Host work that runs while the device is busy is free;
host work while the device is idle adds to the step. A speculative step at batch 32 on the
H200 took 7.9 ms of wall time for 6.5 ms of graph replays, a plain one 5.7 ms for 4.9 ms, so
speculation paid ~0.6 ms more of uncovered host time per step, ~10 % of a plain step: enough
to decide whether speculation pays at acceptance 0.5. This tool says which phase it is.

Method: the phases are wrapped in ``record_function`` ranges (innermost wins), the profiler's
chrome trace gives the device's kernel/memcpy/memset intervals, and each moment of a step in
which no device activity runs is charged to the innermost phase open on the host then.
(Timestamps of host and device events share the trace's clock; the launch latency of the
first kernel after an idle stretch is charged to the phase that launched it.)
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_LABEL = "step"


@contextmanager
def wrapped(obj, name: str, around):
    """Replace obj.name by around(obj.name) while the context lasts, then put back exactly
    what was there (an instance attribute restored, or removed again)."""
    original = getattr(obj, name)
    had_own = name in vars(obj)
    setattr(obj, name, around(original))
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def labelled(obj, name: str, label: str):
    """Wrap obj.name (a bound method or function attribute) in a record_function range."""
    from torch.profiler import record_function

    def around(original):
        def run(*args, **kwargs):
            with record_function(label):
                return original(*args, **kwargs)
        return run

    return wrapped(obj, name, around)


def engine_phases(engine) -> list[tuple[object, str, str]]:
    """(object, attribute, label) of the phases of LLMEngine.step worth telling apart."""
    phases = [(engine, "step", STEP_LABEL), (engine.scheduler, "schedule", "schedule"),
              (engine, "_build_runs", "build_runs"), (engine, "_commit", "commit"),
              (engine, "_make_output", "make_output"),
              (engine.runner, "execute_argmax_device", "target.forward"),
              (engine.runner, "execute_argmax", "target.forward+read"),
              (engine, "_verify_on_device", "verify"),
              (engine.block_manager, "rollback", "block_manager"),
              (engine.block_manager, "register_computed_blocks", "block_manager")]
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:  # inside the target's forward: its inputs' staging and send
        phases.append((graphs.buffers, "fill", "target.inputs"))
    spec = engine.speculation
    if spec is not None:
        phases += [(spec, "propose", "spec.propose"), (spec, "observe_step", "spec.observe"),
                   (spec, "on_committed", "spec.on_committed"),
                   (spec.proposer, "propose", "draft.propose")]
        if spec.adaptive is not None:
            phases.append((spec.adaptive, "plan", "spec.plan"))
        runner = getattr(spec.proposer, "runner", None)
        if runner is not None:
            phases += [(runner, "execute_argmax_device", "draft.forward"),
                       (runner, "execute_argmax_steps_device", "draft.window")]
    return phases


def profile_steps(engine, steps: int, trace_path: Path) -> list[float]:
    """Run `steps` engine steps under torch.profiler (CPU + CUDA), phases labelled; write the
    chrome trace; return each step's wall seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    walls = []
    with ExitStack() as stack:
        for obj, name, label in engine_phases(engine):
            stack.enter_context(labelled(obj, name, label))
        with profile(activities=acts) as prof:
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    return walls


@contextmanager
def timed_phases(engine, totals: dict[str, float]):
    """While the context lasts, add each engine phase's inclusive wall seconds (perf_counter
    wrappers, no profiler) to totals[label]."""
    def timer(label: str):
        def around(original):
            def run(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0
            return run
        return around

    with ExitStack() as stack:
        for obj, name, label in engine_phases(engine):
            stack.enter_context(wrapped(obj, name, timer(label)))
        yield totals


def phase_seconds(engine, steps: int) -> dict[str, float]:
    """Inclusive wall seconds per phase over `steps` engine steps, measured with perf_counter
    wrappers and no profiler: the profiler's per-op recording inflates host time several
    times over (a batch-32 plain step on the H200 took 9.6 ms under it, 5.7 ms without), so
    the timeline says where the device idles and this says how long each phase really takes.
    Phases that read results back (target.forward+read, verify) include waiting for the GPU."""
    import torch

    totals: dict[str, float] = {}
    with timed_phases(engine, totals):
        for _ in range(steps):
            engine.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    return {label: seconds / steps for label, seconds in totals.items()}


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def idle_by_phase(trace: dict) -> tuple[dict[str, float], dict[str, float], float, float, int]:
    """From a chrome trace: (device-idle microseconds per innermost phase, host microseconds per
    innermost phase, total step microseconds, device-busy microseconds within steps, steps)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
              if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    busy = _merge([(e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES])
    step_ranges = sorted((s, e) for s, e, n in ranges if n == STEP_LABEL)
    idle: dict[str, float] = {}
    host: dict[str, float] = {}
    total = busy_in_steps = 0.0
    for step_start, step_end in step_ranges:
        inside = [r for r in ranges if step_start <= r[0] and r[1] <= step_end]
        kernels = [(max(s, step_start), min(e, step_end)) for s, e in busy
                   if s < step_end and e > step_start]
        # elementary segments between every boundary; each gets its innermost open phase
        points = sorted({p for s, e, _ in inside for p in (s, e)}
                        | {p for s, e in kernels for p in (s, e)})
        ki = 0
        for a, b in zip(points, points[1:], strict=False):
            mid = 0.5 * (a + b)
            label = min((r for r in inside if r[0] <= mid < r[1]),
                        key=lambda r: (r[1] - r[0], r[2] == STEP_LABEL))[2]  # inner wins ties
            while ki < len(kernels) and kernels[ki][1] <= mid:
                ki += 1
            covered = ki < len(kernels) and kernels[ki][0] <= mid
            total += b - a
            host[label] = host.get(label, 0.0) + (b - a)
            if covered:
                busy_in_steps += b - a
            else:
                idle[label] = idle.get(label, 0.0) + (b - a)
    return idle, host, total, busy_in_steps, len(step_ranges)


def summarize(trace_path: Path, title: str, walls: list[float]) -> list[str]:
    """A markdown table: per phase, host time and device-idle time per step."""
    idle, host, total, busy, steps = idle_by_phase(json.loads(trace_path.read_text()))
    steps = max(steps, 1)
    lines = [f"{title}: {steps} steps, wall {1e3 * sum(walls) / len(walls):.2f} ms/step "
             f"(under the profiler), step ranges {total / steps / 1e3:.2f} ms, device busy "
             f"{busy / steps / 1e3:.2f} ms, device idle {(total - busy) / steps / 1e3:.2f} ms",
             "| innermost phase | host ms/step | device idle ms/step |", "|---|---:|---:|"]
    for label in sorted(host, key=lambda k: -idle.get(k, 0.0)):
        lines.append(f"| {label} | {host[label] / steps / 1e3:.3f} | "
                     f"{idle.get(label, 0.0) / steps / 1e3:.3f} |")
    return lines
