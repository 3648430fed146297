"""benchmarks/bench_serve.py end to end on a tiny random model: both server modes start, every
request of every rate completes, tokens per chunk add up to the usage numbers, and the summary's
percentiles are finite. Structure only: timings are never asserted."""

from __future__ import annotations

import math
import sys

import pytest
from server_utils import tiny_server_args

from specserve.entrypoints.cli import BENCHMARKS_DIR
from specserve.entrypoints.cli import main as specserve_main

sys.path.insert(0, str(BENCHMARKS_DIR))
import bench_serve as bench  # noqa: E402  (a script beside the package, not inside it)

pytestmark = pytest.mark.timeout(300)

NUM_REQUESTS = 5  # the workload's first 5: chat, edit and completion requests (< 256 tokens)
MAX_TOKENS = 8


def test_workload_mixes_kinds_and_arrivals_are_poisson_shaped():
    kinds = [r.kind for r in bench.build_workload(NUM_REQUESTS)]
    assert set(kinds) == {"chat", "edit", "completion"}
    times = bench.arrival_times(200, 4.0, seed=0)
    assert times == sorted(times) and times[0] == 0.0
    assert times == bench.arrival_times(200, 4.0, seed=0)  # seeded: same schedule every mode
    assert 0.15 < times[-1] / 199 < 0.4  # mean gap ~ 1 / rate
    assert bench.arrival_times(3, bench.INF, seed=0) == [0.0, 0.0, 0.0]


def test_percentiles_interpolate():
    assert bench.percentiles([]) == {}
    assert bench.percentiles([1.0]) == {50: 1.0, 90: 1.0, 99: 1.0}
    p = bench.percentiles([float(i) for i in range(101)])
    assert p == {50: 50.0, 90: 90.0, 99: 99.0}


def test_benchmark_end_to_end_tiny_model(tiny_llama, capsys):
    config = bench.BenchConfig(
        # Fixed k: on a tiny random model "[ngram]" is rarely accepted, and whether the adaptive
        # policy verifies any proposal within 8 tokens depends on how the steps timed (under a
        # loaded machine it declined them all, and there was no acceptance rate to report).
        modes={"none": (), "ngram": (*bench.NGRAM_FLAGS, "--speculative-adaptive", "false")},
        server_args=tuple(tiny_server_args(tiny_llama)),
        rates=(bench.INF, 50.0), num_requests=NUM_REQUESTS, max_tokens=MAX_TOKENS,
        warmup_requests=1)
    results = bench.benchmark(config, log=lambda s: None)
    assert list(results) == ["none", "ngram"]
    for mode, summaries in results.items():
        assert [s.rate for s in summaries] == [bench.INF, 50.0]
        for s in summaries:
            assert s.errors == [] and s.failed == 0, s.errors
            assert s.completed == s.num_requests == NUM_REQUESTS
            assert 0 < s.completion_tokens <= NUM_REQUESTS * MAX_TOKENS
            assert s.prompt_tokens_mean > 0
            assert s.duration_s > 0 and s.request_throughput > 0 and s.output_throughput > 0
            for pcts in (s.ttft_ms, s.itl_token_ms, s.itl_chunk_ms):
                assert list(pcts) == [50, 90, 99]
                assert all(math.isfinite(v) and v >= 0 for v in pcts.values())
                assert pcts[50] <= pcts[90] <= pcts[99]
            assert math.isfinite(s.tpot_mean_ms) and s.tokens_per_chunk >= 1
            assert 0 <= s.others_cpu_pct <= 100  # /proc read (Linux): the noise gauge works
            if mode == "none":
                assert s.acceptance_rate is None
            else:
                assert 0 <= s.acceptance_rate <= 1
    # greedy and lossless: both modes generate the same number of tokens
    assert ([s.completion_tokens for s in results["none"]]
            == [s.completion_tokens for s in results["ngram"]])
    table = bench.results_table(results)
    ratios = bench.ratio_table(results, "none")
    assert len(table.splitlines()) == 2 + 4 and len(ratios.splitlines()) == 2 + 2
    assert "| ngram | inf |" in ratios


def test_cli_bench_serve_forwards_to_the_script(capsys):
    with pytest.raises(SystemExit) as info:
        specserve_main(["bench", "serve", "--help"])
    assert info.value.code == 0
    assert "--num-requests" in capsys.readouterr().out
