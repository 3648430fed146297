"""Tune the multi-row GEMV configs (layers/gemv.py ROWS_CONFIGS) inside the batch-1 verification
graph of a Llama-3-8B-shaped model (a GPU script: pytest does not collect it).

Why in the graph: tests/gpu/sweep_gemv.py times each shape alone (graphs of one shape back to
back), and there the multi-row kernels cost 3-6 % more than the one-row kernel per call. In a
verification graph the gap is larger (session 12: q = 2 cost +0.35-0.45 ms over q = 1 where the
isolated sums predict +0.21 ms): with programmatic dependent launch a kernel's first weights
stream while the kernel before it drains, and how well that works depends on the neighbours (an
RMSNorm, the attention kernels) and on how many programs of the next kernel fit beside the last
ones of the previous (a deep-pipeline "dot" program holds up to ~200 KB of shared memory). So
the configs are chosen here by what the whole graph takes.

  PYTHONPATH=$PWD python3 tests/gpu/tune_rows_in_graph.py [--out DIR] [--budget S]

1. baseline: GPU time of the verify graphs (no lm_head, context 512) at q = 1..9 over q = 1
   (the one-row decode kernels), PDL on and off.
2. a) the attention kernel's knobs at verification lengths (tune_attention).
   b) coordinate descent per row bucket (8, 16, 4, 2: the buckets of k = 4..7, 8, 2..3, 1), per
   8B projection (qkv, o, gate_up + silu, down): each candidate config recaptures the graph of
   the bucket's representative q and is timed against the current best graph in interleaved
   rounds (median ratio); it replaces the best when >= 0.3 % faster. Buckets after the first try
   the first bucket's best few per shape, the current config, and for 2 and 4 rows "fma".
3. the winners: the ROWS_CONFIGS and attention TILE_CONFIG lines to paste; 9-token
   verification logits of session 18's configs (PREVIOUS_*) and the tuned ones against a float32
   copy of the model (relative error, argmax agreement); graph and execute() wall times at
   q = 1..9 over q = 1 (execute() is what bench_gpu_spec's section 3 times) at the start and
   tuned; graph times at batch 8 and 32, previous against tuned (the tiles serve every batch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
sys.path.append(str(REPO / "benchmarks"))
sys.path.append(str(REPO / "tests" / "gpu"))

from bench_gpu_spec import cuda_time, synthetic_runs, wall_time  # noqa: E402
from check_fused_decode import LLAMA3_8B, ROPE, build  # noqa: E402

from specserve.model.layers import gemv, pdl  # noqa: E402
from specserve.model.layers.gemv import RowsConfig  # noqa: E402
from specserve.worker.model_runner import ModelRunner  # noqa: E402

DEV = torch.device("cuda")
BLOCK = 16
CTX = 512
MAX_QUERY = 9
MAX_MODEL_LEN = 1024
MAX_BATCH = 32
# Before this script's first run (session 18's code): the configs it changed, for section 3.
PREVIOUS_ROWS = {
    (6144, 4096, 8): RowsConfig("dot", 64, 128, 4, 7),
    (6144, 4096, 16): RowsConfig("dot", 64, 128, 4, 7),
    (4096, 4096, 8): RowsConfig("dot", 64, 128, 4, 7),
    (4096, 4096, 16): RowsConfig("dot", 64, 128, 4, 7),
    (28672, 4096, 2): RowsConfig("dot", 64, 128, 4, 5),
    (28672, 4096, 4): RowsConfig("dot", 64, 128, 4, 5),
}
PREVIOUS_TILES = {32: (128, 4, 3), 64: (64, 4, 3)}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BUCKET_ORDER = [(8, 5), (16, 9), (4, 3), (2, 2)]  # (row bucket, q timed for it)
DOT_CANDIDATES = [RowsConfig("dot", *c) for c in (
    (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4), (32, 256, 4, 6),
    (64, 128, 4, 3), (64, 128, 4, 5), (64, 128, 4, 7), (64, 256, 4, 3), (128, 128, 4, 4),
    (128, 128, 8, 4), (128, 64, 4, 6))]
ATTN_TILES_32 = [(64, 4, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3), (128, 4, 2), (128, 8, 3),
                 (64, 8, 2)]  # (keys per iteration, warps, stages)
ATTN_TILES_64 = [(64, 4, 2), (32, 4, 2), (32, 4, 3), (128, 4, 3), (64, 8, 3), (32, 8, 2)]
FMA_CANDIDATES = [RowsConfig("fma", 2, 1024, 4, 3), RowsConfig("fma", 4, 512, 4, 3)]
# --spread: "dot" tiles whose programs cover fewer weight rows than the tile
# (RowsConfig.rows_per_program), so a shape runs on about every SM of an H200 (132): qkv's 6144
# rows as 128 programs of 48 (64-row tiles give 96), gate_up's 14336 activations as 132 programs
# of 109 (218 rows in 256-row tiles), 261 of 55 (110 in 128-row tiles: two even waves instead of
# 224 programs' 1.7) or 512 of 28 (56 in 64-row tiles, four programs per SM).
SPREAD_CANDIDATES = {
    "qkv": [RowsConfig("dot", *c, 48) for c in (
        (64, 128, 4, 5), (64, 128, 4, 7), (64, 256, 4, 3), (64, 256, 4, 4), (64, 128, 4, 4))],
    "gate_up": [RowsConfig("dot", *c) for c in (
        (128, 128, 4, 4, 110), (128, 128, 4, 3, 110), (128, 64, 4, 6, 110), (256, 128, 8, 3, 218),
        (256, 64, 8, 4, 218), (256, 64, 8, 3, 218), (64, 128, 4, 3, 56), (64, 128, 4, 5, 56))],
    "o": [], "down": []}
KEEP_FROM_FIRST = 4  # later buckets try this many of the first bucket's best per shape
MIN_GAIN = 0.003
LINES: list[str] = []
# Every graph captured stays alive: graphs share the runner's memory pool, and capturing into
# a pool whose graphs have all been freed trips an allocator assertion (torch 2.11).
CAPTURED: list[torch.cuda.CUDAGraph] = []
CAPTURED_METAS: list = []


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


def graph_for(runner: ModelRunner, q: int, batch: int = 1) -> torch.cuda.CUDAGraph:
    """A fresh capture of the graph runner.execute replays for `batch` sequences verifying q
    tokens at context CTX (taken out of the runner, so the next call captures again)."""
    runs = synthetic_runs(runner, batch, q, CTX, first_block=1)
    key = runner.graphs.key_for(runs)
    runner.graphs.graphs.pop(key, None)
    # the attention plan too (its tile and split choice); kept alive, as its scratch buffers
    # are baked into the graphs already captured
    CAPTURED_METAS.append(runner.graphs.metas.pop(key, None))
    runner.execute(runs)  # captures
    CAPTURED.append(runner.graphs.graphs.pop(key))
    return CAPTURED[-1]


def paired_ratio(base: torch.cuda.CUDAGraph, cand: torch.cuda.CUDAGraph, rounds: int = 3,
                 reps: int = 20) -> tuple[float, float]:
    """(median of cand/base over interleaved rounds, cand's median seconds)."""
    ratios, cand_times = [], []
    for _ in range(rounds):
        b = cuda_time(base.replay, reps)
        c = cuda_time(cand.replay, reps)
        ratios.append(c / b)
        cand_times.append(c)
    return statistics.median(ratios), statistics.median(cand_times)


def graph_times(runner: ModelRunner, qs, rounds: int = 2, batch: int = 1) -> dict[int, float]:
    graphs = {q: graph_for(runner, q, batch) for q in qs}
    times: dict[int, list[float]] = {q: [] for q in qs}
    for _ in range(rounds):
        for q in qs:
            times[q].append(cuda_time(graphs[q].replay, 50))
    return {q: statistics.mean(t) for q, t in times.items()}


def wall_times(runner: ModelRunner, qs, rounds: int = 3) -> dict[int, float]:
    runner.enable_cuda_graphs(MAX_BATCH, MAX_QUERY, MAX_MODEL_LEN)  # recapture, current configs
    runs = {q: synthetic_runs(runner, 1, q, CTX, first_block=1) for q in qs}
    for q in qs:
        runner.execute(runs[q])
    times: dict[int, list[float]] = {q: [] for q in qs}
    for _ in range(rounds):
        for q in qs:
            times[q].append(wall_time(lambda q=q: runner.execute(runs[q]), 20))
    return {q: statistics.median(t) for q, t in times.items()}


def ratio_row(label: str, times: dict[int, float]) -> str:
    base = times[1]
    return f"| {label} | {base * 1e3:.3f} | " + " | ".join(
        f"{times[q] * 1e3:.3f} ({times[q] / base:.3f})" for q in sorted(times) if q > 1) + " |"


def verify_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    table = list(range(1, 1 + (len(prompt) + MAX_QUERY + BLOCK) // BLOCK + 1))
    from specserve.worker.model_runner import SequenceRun
    runner.execute([SequenceRun(prompt, 0, table, [len(prompt) - 1])])
    if runner.graphs is not None:  # capture afresh: the configs may have changed
        runs = synthetic_runs(runner, 1, MAX_QUERY, CTX, first_block=1)
        key = runner.graphs.key_for(runs)
        CAPTURED.append(runner.graphs.graphs.pop(key, None))
        CAPTURED_METAS.append(runner.graphs.metas.pop(key, None))
    return runner.execute([SequenceRun(prompt[:MAX_QUERY], len(prompt), table,
                                       list(range(MAX_QUERY)))]).float()


def descend(runner: ModelRunner, q: int, configs: dict, key, candidates, label: str,
            deadline: float | None = None) -> list[tuple[float, object]]:
    """One coordinate of the descent: for each candidate value of configs[key] (a
    gemv.ROWS_CONFIGS entry or an attention tile config), recapture the graph of q and time it
    against the best graph so far (paired_ratio); keep the value when it is >= MIN_GAIN
    faster, else put the previous one back. Returns (ratio, candidate) for each one timed."""
    best_graph = graph_for(runner, q)
    tried: list[tuple[float, object]] = []
    for cand in candidates:
        if cand == configs[key] or (deadline is not None and time.perf_counter() > deadline):
            continue
        keep = configs[key]
        configs[key] = cand
        try:
            graph = graph_for(runner, q)
        except Exception as exc:  # noqa: BLE001  (out of shared memory, etc.: skip it)
            say(f"  {label} {tuple(cand)}: {type(exc).__name__}")
            configs[key] = keep
            continue
        ratio, secs = paired_ratio(best_graph, graph)
        tried.append((ratio, cand))
        better = ratio < 1 - MIN_GAIN
        if better:
            best_graph = graph
        else:
            configs[key] = keep
        say(f"  {label} {tuple(cand)}: {ratio:.4f} ({secs * 1e3:.3f} ms)"
            + (" -> best" if better else ""))
    return tried


def tune_bucket(runner: ModelRunner, bucket: int, q: int, candidates: dict[str, list[RowsConfig]],
                deadline: float) -> dict[str, list[tuple[float, RowsConfig]]]:
    """Coordinate descent over the shapes at this bucket; returns per shape the candidates'
    ratios against the config current when each was timed (best first)."""
    results: dict[str, list[tuple[float, RowsConfig]]] = {}
    for name, shape in SHAPES.items():
        key = (*shape, bucket)
        start = gemv.ROWS_CONFIGS[key]
        tried = descend(runner, q, gemv.ROWS_CONFIGS, key, candidates[name], name, deadline)
        say(f"bucket {bucket} {name}: {tuple(start)} -> {tuple(gemv.ROWS_CONFIGS[key])}")
        results[name] = sorted(tried, key=lambda t: t[0])
    return results


def tune_attention(runner: ModelRunner) -> None:
    """The attention kernel's knobs at verification lengths, in the graph: the tile config of
    32 rows (q = 5..8 with GQA group 4) and 64 rows (q = 9), applied when >= 0.3 % faster; then,
    reported only, the keys per context split (also q = 1) and a 16-row tile cap (q = 5..9 as
    2-3 tiles of 4 tokens, each reading the context again)."""
    backend = runner.backend
    for rows, q, cands in ((32, 5, ATTN_TILES_32), (64, 9, ATTN_TILES_64)):
        start = backend.tile_config[rows]
        descend(runner, q, backend.tile_config, rows, cands, f"tile {rows} rows")
        say(f"attention tile {rows} rows: {start} -> {backend.tile_config[rows]}")
    for q in (1, 5, 9):
        base = graph_for(runner, q)
        start = backend.min_keys_per_split
        for keys in (64, 256, 512):
            backend.min_keys_per_split = keys
            ratio, secs = paired_ratio(base, graph_for(runner, q))
            say(f"  q={q} keys per split {keys} (vs {start}): {ratio:.4f} ({secs * 1e3:.3f} ms)")
        backend.min_keys_per_split = start
    from specserve.model.layers.attention import triton_backend
    start_cap = triton_backend.MAX_TILE_ROWS
    for q in (5, 9):
        base = graph_for(runner, q)
        triton_backend.MAX_TILE_ROWS = 16
        try:
            ratio, secs = paired_ratio(base, graph_for(runner, q))
            say(f"  q={q} tiles of 16 rows (vs one tile): {ratio:.4f} ({secs * 1e3:.3f} ms)")
        finally:
            triton_backend.MAX_TILE_ROWS = start_cap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the descent")
    ap.add_argument("--attention-only", action="store_true",
                    help="skip the GEMV descent (section 2), tune the attention knobs only")
    ap.add_argument("--spread", action="store_true",
                    help="skip the attention knobs; the descent tries only SPREAD_CANDIDATES "
                         "(programs covering fewer rows than their tile) at every bucket")
    args = ap.parse_args()
    import triton
    from transformers import LlamaConfig

    t0 = time.perf_counter()
    say(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
    cfg = LlamaConfig(**LLAMA3_8B, rope_parameters=dict(ROPE), pad_token_id=None,
                      bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    runner = ModelRunner(build(cfg, torch.bfloat16), DEV, torch.bfloat16, BLOCK)
    model = runner.model
    runner.init_kv_cache(MAX_BATCH * ((CTX + MAX_QUERY) // BLOCK + 1) + 2)
    assert runner.enable_cuda_graphs(MAX_BATCH, MAX_QUERY, MAX_MODEL_LEN)
    prompt = torch.randint(3, cfg.vocab_size, (CTX,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    start_configs = dict(gemv.ROWS_CONFIGS)
    start_tiles = dict(runner.backend.tile_config)
    ref_runner = ModelRunner(build(cfg, torch.float32, src=model), DEV, torch.float32, BLOCK)
    ref_runner.init_kv_cache(40)
    fp32_logits = verify_logits(ref_runner, prompt)  # eager float32: the reference
    del ref_runner
    torch.cuda.empty_cache()
    say(f"models built in {time.perf_counter() - t0:.0f}s")

    qs = list(range(1, MAX_QUERY + 1))
    say(f"\n== 1. verify graph GPU ms at context {CTX} (no lm_head), and / q=1")
    say("| configs | q=1 | " + " | ".join(f"q={q}" for q in qs[1:]) + " |")
    say("|---|" + "---|" * len(qs))
    before = graph_times(runner, qs)
    say(ratio_row("start, PDL on", before))
    pdl.ENABLED = False
    say(ratio_row("start, PDL off", graph_times(runner, (1, 2, 5, 9))))
    pdl.ENABLED = True
    wall_before = wall_times(runner, qs)
    say(ratio_row("start, execute() wall", wall_before))

    if not args.spread:
        say(f"\n== 2a. attention knobs, {time.perf_counter() - t0:.0f}s")
        tune_attention(runner)
    say(f"\n== 2b. coordinate descent (budget {args.budget:.0f}s)")
    deadline = time.perf_counter() + (0 if args.attention_only else args.budget)
    first: dict[str, list[tuple[float, RowsConfig]]] | None = None
    for bucket, q in BUCKET_ORDER:
        if args.spread:
            cands = SPREAD_CANDIDATES
        elif first is None:
            cands = {name: DOT_CANDIDATES for name in SHAPES}
        else:
            cands = {}
            for name, shape in SHAPES.items():
                best = [c for _, c in first[name][:KEEP_FROM_FIRST]]
                best.append(gemv.ROWS_CONFIGS[(*shape, BUCKET_ORDER[0][0])])
                if bucket <= 4:
                    best += FMA_CANDIDATES
                cands[name] = list(dict.fromkeys(best))
        say(f"-- bucket {bucket} (q = {q}), {time.perf_counter() - t0:.0f}s")
        result = tune_bucket(runner, bucket, q, cands, deadline)
        if first is None:
            first = result

    say("\n== 3. winners (paste into ROWS_CONFIGS)")
    for shape in SHAPES.values():
        for bucket in (2, 4, 8, 16):
            key = (*shape, bucket)
            mark = "" if gemv.ROWS_CONFIGS[key] == start_configs[key] else "   # changed"
            say(f"    {key}: RowsConfig{tuple(gemv.ROWS_CONFIGS[key])},{mark}")
    for shape_rows, tile in sorted(runner.backend.tile_config.items()):
        mark = "" if tile == start_tiles[shape_rows] else "   # changed"
        say(f"    attention TILE_CONFIG {shape_rows}: {tile},{mark}")
    tuned = (dict(gemv.ROWS_CONFIGS), dict(runner.backend.tile_config))
    previous = ({**start_configs, **PREVIOUS_ROWS}, {**start_tiles, **PREVIOUS_TILES})

    def use(configs) -> None:
        gemv.ROWS_CONFIGS.clear()
        gemv.ROWS_CONFIGS.update(configs[0])
        runner.backend.tile_config.clear()
        runner.backend.tile_config.update(configs[1])

    say("\n9-token verification logits (bf16, graphs) against the float32 model (eager):")
    for label, configs in (("previous", previous), ("tuned", tuned)):
        use(configs)
        logits = verify_logits(runner, prompt)
        err = ((logits - fp32_logits).norm() / fp32_logits.norm()).item()
        agree = (logits.argmax(-1) == fp32_logits.argmax(-1)).float().mean().item()
        say(f"  {label:8}: rel err {err:.2e}, argmax agreement {agree:.0%}")
    say(f"\nverify graph GPU ms at context {CTX} (no lm_head) and / q=1; previous = session 18's"
        " configs")
    say("| configs | q=1 | " + " | ".join(f"q={q}" for q in qs[1:]) + " |")
    say("|---|" + "---|" * len(qs))
    say(ratio_row("start, graph", before))
    use(tuned)
    say(ratio_row("tuned, graph", graph_times(runner, qs)))
    say(ratio_row("start, execute() wall", wall_before))
    say(ratio_row("tuned, execute() wall", wall_times(runner, qs)))
    for batch in (8, 32):
        for label, configs in (("previous", previous), ("tuned", tuned), ("previous", previous),
                               ("tuned", tuned)):
            use(configs)
            say(ratio_row(f"batch {batch}, {label}, graph",
                          graph_times(runner, (1, 2, 3, 5, 9), rounds=1, batch=batch)))
    use(previous)
    say(ratio_row("batch 1, previous, execute() wall", wall_times(runner, qs)))
    use(tuned)
    say(ratio_row("batch 1, tuned, execute() wall", wall_times(runner, qs)))
    say(f"[done at {time.perf_counter() - t0:.0f}s]")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune_rows_in_graph.txt").write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
