"""A/B in the engine's greedy graphs: the 8B lm_head by gemv's "tma" variant against the
kernels it replaced (the one-row GEMV at one row, "dot" at 2-16) (a GPU script: pytest does
not collect it).

Why: tests/gpu/sweep_tma_gemv.py timed the lm_head alone, 234-238 us by TMA against 265-270
us; across sessions the same one-row kernel has measured 234 us and 265 us alone, so only an
interleaved A/B of whole graphs in one process says what the engine gains. A random
Llama-3-8B-shaped model in bf16 (check_fused_decode.build); at batch 1 and 32, q = 1, 2, 5, 9
tokens per sequence, context 512: the greedy graph (lm_head and argmax inside, what the engine
replays for greedy requests) captured under each config and replayed in interleaved rounds.
Also: the greedy tokens of a 9-token verification after a real prefill under A and B.

  PYTHONPATH=$PWD python3 tests/gpu/ab_lm_head_tma.py [--out DIR]
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

from bench_gpu_spec import cuda_time, synthetic_runs  # noqa: E402
from check_fused_decode import LLAMA3_8B, ROPE, build  # noqa: E402

from specserve.model.layers import gemv  # noqa: E402
from specserve.worker.model_runner import ModelRunner, SequenceRun  # noqa: E402

DEV = torch.device("cuda")
BLOCK = 16
CTX = 512
LM_HEAD = (128256, 4096)
BEFORE = {(*LM_HEAD, b): gemv.RowsConfig("dot", 128, 128, 4, 4) for b in (2, 4, 8, 16)}
LINES: list[str] = []
KEEP: list = []  # captured graphs and their plans stay alive (they share the pool)


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


def use(tma: bool) -> None:
    for b in (1, 2, 4, 8, 16):
        gemv.ROWS_CONFIGS.pop((*LM_HEAD, b), None)
    if tma:
        gemv.ROWS_CONFIGS.update(TMA)
    else:
        gemv.ROWS_CONFIGS.update(BEFORE)


def greedy_graph(runner: ModelRunner, batch: int, q: int) -> torch.cuda.CUDAGraph:
    runs = synthetic_runs(runner, batch, q, CTX, first_block=1)
    key = runner.graphs.key_for(runs)
    runner.graphs.argmax_graphs.pop(key, None)
    KEEP.append(runner.graphs.metas.pop(key, None))
    runner.execute_argmax(runs)  # captures
    KEEP.append(runner.graphs.argmax_graphs.pop(key))
    return KEEP[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
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
    runner.init_kv_cache(32 * ((CTX + 9) // BLOCK + 1) + 40)
    assert runner.enable_cuda_graphs(32, 9, 1024)

    # greedy tokens of a 9-token verification after a real prefill, A and B
    prompt = torch.randint(3, cfg.vocab_size, (CTX,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    table = list(range(1, 1 + (CTX + 9) // BLOCK + 1))
    runner.execute([SequenceRun(prompt, 0, table, [CTX - 1])])
    tokens = {}
    for tma in (True, False):
        use(tma)
        KEEP.extend(runner.graphs.argmax_graphs.values())  # recapture, keeping the old alive
        runner.graphs.argmax_graphs.clear()
        tokens[tma] = runner.execute_argmax([SequenceRun(prompt[:9], CTX, table,
                                                         list(range(9)))])
    same = sum(a == b for a, b in zip(tokens[True], tokens[False], strict=True))
    say(f"9-token verification greedy tokens, tma == before: {same}/9")

    say("\n| batch | q | before ms | tma ms | tma / before | before q/q1 | tma q/q1 |")
    say("|---|---|---|---|---|---|---|")
    for batch in (1, 32):
        times: dict[tuple[bool, int], list[float]] = {}
        graphs = {}
        for tma in (False, True):
            use(tma)
            for q in (1, 2, 5, 9):
                graphs[(tma, q)] = greedy_graph(runner, batch, q)
        for _ in range(5):
            for q in (1, 2, 5, 9):
                for tma in (False, True):
                    times.setdefault((tma, q), []).append(cuda_time(graphs[(tma, q)].replay, 30))
        med = {k: statistics.median(v) for k, v in times.items()}
        for q in (1, 2, 5, 9):
            b, t = med[(False, q)], med[(True, q)]
            say(f"| {batch} | {q} | {b * 1e3:.3f} | {t * 1e3:.3f} | {t / b:.4f} | "
                f"{b / med[(False, 1)]:.3f} | {t / med[(True, 1)]:.3f} |")
    say(f"[done at {time.perf_counter() - t0:.0f}s]")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ab_lm_head_tma.txt").write_text("\n".join(LINES) + "\n")
    return 0 if same >= 8 else 1


TMA = {(*LM_HEAD, b): gemv.ROWS_CONFIGS[(*LM_HEAD, b)] for b in (1, 2, 4, 8, 16)}

if __name__ == "__main__":
    sys.exit(main())
