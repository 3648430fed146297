"""Host cost of "[ngram]" lookups per engine step, vLLM's rule against the aligned lookup
(issue 4: the search must stay cheap at long contexts and large batches).

32 sequences whose prompts are random tokens (a 2000-token vocabulary, so short n-grams repeat)
of 512 / 4096 / 16384 tokens; every step each sequence commits two tokens copied from its prompt
(one in ten replaced: an edit) and the proposer is asked for up to 5 tokens for all of them, as
the engine's driver does. Printed: the first call (which indexes every prompt) and the median
per-step time after it.

    python benchmarks/ngram_lookup_cost.py [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from specserve.engine.sequence import Sequence
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.ngram import NgramProposer

BATCH = 32
VOCAB = 2000
EDIT_RATE = 0.1


def measure(context: int, aligned: bool, steps: int) -> tuple[float, float]:
    """(seconds of the first call, median seconds of a later step)."""
    rng = random.Random(context)
    proposer = NgramProposer(4, 1, aligned=aligned)
    seqs = [Sequence(i, f"r{i}", 0, [rng.randrange(VOCAB) for _ in range(context)],
                     SamplingParams(max_tokens=10**6), 0.0) for i in range(BATCH)]
    t0 = time.perf_counter()
    proposer.propose(seqs, [5] * BATCH)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        for seq in seqs:
            source = seq.num_tokens % context
            copied = seq.prompt_token_ids[source]
            seq.token_ids += [copied if rng.random() > EDIT_RATE else rng.randrange(VOCAB),
                              seq.prompt_token_ids[(source + 1) % context]]
        t0 = time.perf_counter()
        proposer.propose(seqs, [5] * BATCH)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"| context | lookup | first call (indexes {BATCH} prompts) | per step, median |")
    print("|---:|---|---:|---:|")
    for context in (512, 4096, 16384):
        for aligned in (False, True):
            first, step = measure(context, aligned, args.steps)
            print(f"| {context} | {'aligned' if aligned else 'most recent (vLLM)'} | "
                  f"{first * 1e3:.1f} ms | {step * 1e3:.3f} ms |")


if __name__ == "__main__":
    main()
