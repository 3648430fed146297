"""The AMX kernel against the AVX-512 kernel for GGUF blocks, in the engine, in one process.

Why a separate run: whether a CPU with AMX tiles should take the AMX kernel by default
(quantization/gguf_amx.py) is a question about whole decode steps, not kernel timings: plain
decoding and "[suffix]" at batch 1 and 32, on the input-grounded and chat sets of
bench_draft_free_cpu.py. The engines are built with SPECSERVE_AMX=0 and without it and take
turns on every prompt (batch 1) and in every round (batch 32), so the machine's drift falls on
both alike. Both compute the same float32 model in a different summation order, so their greedy
tokens may part where two tokens are nearly tied; the run counts how many outputs agree.

    python benchmarks/bench_amx_ab.py --idle-wait 10
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_draft_free_cpu import (  # noqa: E402
    BATCH,
    BATCH1_PROMPTS,
    BATCH_ROUNDS,
    CHAT_PROMPTS,
    NEW_TOKENS,
    USER_PROMPTS,
    Ours,
    batch1,
    batched,
    humaneval_edit_prompts,
)

from specserve.engine.heap import freeze_startup_heap  # noqa: E402
from specserve.model.layers import cpu_kernels  # noqa: E402
from specserve.model.layers.quantization import gguf_amx  # noqa: E402


def build(amx: bool, **spec) -> Ours:
    """An engine whose GGUF layers take the AMX kernel (amx) or the AVX-512 one."""
    if amx:
        os.environ.pop(gguf_amx.DISABLE_ENV, None)
    else:
        os.environ[gguf_amx.DISABLE_ENV] = "0"
    engine = Ours(**spec)
    os.environ.pop(gguf_amx.DISABLE_ENV, None)
    layer = engine.llm.llm_engine.runner.model.lm_head
    assert layer.format_name.endswith("+amx") == amx, layer.format_name
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--idle-wait", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not gguf_amx.wanted(cpu_kernels.load()):
        sys.exit("this CPU (or this build of the kernels) has no AMX tiles")
    torch.set_num_threads(args.threads)

    engines = {
        ("plain", "avx512"): build(False),
        ("plain", "amx"): build(True),
        ('"[suffix]"', "avx512"): build(False, speculative_model="[suffix]"),
        ('"[suffix]"', "amx"): build(True, speculative_model="[suffix]"),
    }
    named = {f"{m} {k}": e for (m, k), e in engines.items()}
    plain = engines[("plain", "avx512")]
    sets = {
        "input-grounded": [plain.chat_ids(t) for t in humaneval_edit_prompts(BATCH)],
        "chat": [plain.chat_ids(t) for t in CHAT_PROMPTS + USER_PROMPTS],
    }
    warm = plain.chat_ids("Say hello.")
    for engine in named.values():
        engine.generate([warm], 8)
    freeze_startup_heap()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {NEW_TOKENS} new tokens,"
          f" greedy; batch 1: {BATCH1_PROMPTS} prompts per set, batch {BATCH}: best of "
          f"{BATCH_ROUNDS} interleaved rounds; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("\n| set | batch | method | AVX-512 tok/s | AMX tok/s | AMX / AVX-512 | same tokens |")
    print("|---|---:|---|---:|---:|---:|---|")
    for title, prompts in sets.items():
        for batch in (1, BATCH):
            if batch == 1:
                rates, outputs = batch1(named, prompts[:BATCH1_PROMPTS], NEW_TOKENS,
                                        args.idle_wait)
            else:
                rates, outputs = batched(named, (prompts * batch)[:batch], NEW_TOKENS,
                                         args.idle_wait, BATCH_ROUNDS)
            for method in ("plain", '"[suffix]"'):
                a, b = f"{method} avx512", f"{method} amx"
                same = sum(x == y for x, y in zip(outputs[a], outputs[b], strict=True))
                print(f"| {title} | {batch} | {method} | {rates[a]:.1f} | {rates[b]:.1f} | "
                      f"{rates[b] / rates[a]:.2f}x | {same}/{len(outputs[a])} |", flush=True)


if __name__ == "__main__":
    main()
