"""Host cost of an eager forward on the GPU: a draft model's catch-up (prefill-shaped, too long
for a CUDA graph) with a 1B-shaped random draft.

Why: at batch 32 on the H200 a draft catch-up step cost ~10 ms more than its arithmetic
(1027 tokens: +12 ms over a cap-1 step; 3108 tokens: +16.5 ms), so the step that learns a
new batch's acceptance costs ~2 % of a 128-token run whatever it prefills. This prints wall
and GPU time of catch-up forwards by batch and tokens, and a cProfile of the host side.

    python benchmarks/profile_eager_forward.py --out OUT     (CUDA)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_spec import (  # noqa: E402
    LLAMA32_1B,
    SMOKE,
    build_hf,
    register,
    synthetic_runs,
)

from specserve import LLM  # noqa: E402
from specserve.worker.model_runner import SequenceRun  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = {**LLAMA32_1B, **(SMOKE if args.smoke else {})}
    work = Path(tempfile.mkdtemp())
    path = register(build_hf(shape, device, 1, dtype), work / "draft")
    llm = LLM(model=path, device=device.type, dtype="float32" if args.smoke else "bfloat16",
              max_model_len=1024, max_num_seqs=64,
              kv_cache_memory_bytes=(1 if args.smoke else 8) << 30, enable_prefix_caching=False)
    runner = llm.llm_engine.runner

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def catch_up(batch: int, q: int) -> list[SequenceRun]:
        return [SequenceRun(r.token_ids, r.start, r.block_table, [q - 1])
                for r in synthetic_runs(runner, batch, q, 128, first_block=1)]

    lines = ["| batch | tokens / seq | tokens | wall ms | host ms (launch, no sync) | "
             "GPU ms |", "|---|---|---|---|---|---|"]
    for batch, q in ((1, 128), (8, 128), (32, 128), (8, 16), (32, 16), (32, 1)):
        runs = catch_up(batch, q)
        for _ in range(3):
            runner.execute_argmax_device(runs)
        sync()
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            runner.execute_argmax(runs)
        wall = (time.perf_counter() - t0) / reps
        hosts = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            runner.execute_argmax_device(runs)
            hosts.append(time.perf_counter() - t)
        sync()
        gpu = float("nan")
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            for _ in range(reps):
                runner.execute_argmax_device(runs)
            end.record()
            sync()
            gpu = start.elapsed_time(end) / reps
        lines.append(f"| {batch} | {q} | {batch * q} | {1e3 * wall:.2f} | "
                     f"{1e3 * min(hosts):.2f} | {gpu:.2f} |")
    runs = catch_up(8, 128)
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(5):
        runner.execute_argmax(runs)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    lines += ["", "cProfile, 5 catch-ups of 8 x 128 tokens, by own time:", text.getvalue()]
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    lines += ["by cumulative time:", text.getvalue()]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "eager_forward.txt").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
