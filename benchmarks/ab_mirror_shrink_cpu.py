"""A/B of the context mirror's compaction of shrinking batches (issue 4), on the chat set at
batch 32: plain decoding and "[ngram]" speculation, each with compaction on and off
(``COMPACT_SHRUNK_BATCHES``; off: every batch that lost a sequence re-gathers the mirror),
interleaved in one process, best of N rounds.

Printed per configuration: generated tok/s (best round), engine steps, the mirror's rebuilds,
compactions and moved rows per run, and the seconds spent re-gathering (rebuild) and moving rows
(compaction), timed around those calls only. Greedy tokens are checked equal across all four.

Usage: ``python benchmarks/ab_mirror_shrink_cpu.py [--rounds 3] [--batch 32] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from bench_draft_free_cpu import CHAT_PROMPTS, NEW_TOKENS, NGRAM_MAX, NUM_SPECULATIVE_TOKENS, Ours
from bench_offline_cpu import USER_PROMPTS

from specserve.model.layers.attention import torch_context_mirror as tcm

SECONDS: Counter[str] = Counter()  # time inside rebuild gathers / compaction moves


def _instrument() -> None:
    """Time the mirror's rebuild gathers (MirrorStep.context on rebuild steps) and compaction
    moves (the first ContextMirror.buffers call of a layer on a step that moves rows)."""
    context, buffers = tcm.MirrorStep.context, tcm.ContextMirror.buffers

    def timed_context(self, *args):
        t0 = time.perf_counter()
        out = context(self, *args)
        if not self.extend:
            SECONDS["rebuild"] += time.perf_counter() - t0
        return out

    def timed_buffers(self, k_cache, step):
        t0 = time.perf_counter()
        out = buffers(self, k_cache, step)
        if step.moves:
            SECONDS["compaction"] += time.perf_counter() - t0
        return out

    tcm.MirrorStep.context = timed_context
    tcm.ContextMirror.buffers = timed_buffers


def run(engine: Ours, prompts: list[list[int]], compact: bool):
    tcm.COMPACT_SHRUNK_BATCHES = compact
    mirror = engine.llm.llm_engine.runner.backend.mirror
    before, seconds_before = Counter(mirror.counts), Counter(SECONDS)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, NEW_TOKENS)
    wall = time.perf_counter() - t0
    counts = Counter(mirror.counts)
    counts.subtract(before)
    seconds = Counter(SECONDS)
    seconds.subtract(seconds_before)
    return sum(len(o) for o in outs) / wall, wall, counts, seconds, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _instrument()
    engines = {
        "plain": Ours(),
        "[ngram]": Ours(speculative_model="[ngram]", num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
                        ngram_prompt_lookup_max=NGRAM_MAX),
    }
    plain = engines["plain"]
    prompts = [plain.chat_ids(t) for t in CHAT_PROMPTS + USER_PROMPTS]
    prompts = (prompts * args.batch)[: args.batch]
    warm = plain.chat_ids("Say hello.")
    for engine in engines.values():
        engine.generate([warm], 8)
    best: dict[tuple[str, bool], tuple] = {}
    outputs = {}
    for r in range(args.rounds):
        for name, engine in engines.items():
            for compact in (r % 2 == 0, r % 2 == 1):  # alternate which goes first
                rate, wall, counts, seconds, outs = run(engine, prompts, compact)
                key = (name, compact)
                print(f"round {r} {name:8s} compact={compact!s:5s} {rate:6.1f} tok/s "
                      f"{wall:5.1f} s rebuilds {counts['rebuild']:3d} compactions "
                      f"{counts['compact']:3d} moved rows {counts['moved rows']:3d} "
                      f"rebuild {seconds['rebuild']:.3f} s compaction "
                      f"{seconds['compaction']:.3f} s", flush=True)
                if key not in best or rate > best[key][0]:
                    best[key] = (rate, counts, seconds)
                outputs[key] = outs
    same = all(o == outputs[("plain", False)] for o in outputs.values())
    print(f"\nbest of {args.rounds}, batch {args.batch}, chat set; same tokens: {same}")
    for name in engines:
        on, off = best[(name, True)][0], best[(name, False)][0]
        print(f"{name:8s} compaction on {on:6.1f} tok/s, off {off:6.1f} tok/s: on/off "
              f"{on / off:.3f}")
    for compact in (True, False):
        ratio = best[("[ngram]", compact)][0] / best[("plain", compact)][0]
        print(f'"[ngram]" / plain with compaction {"on" if compact else "off"}: {ratio:.3f}x')


if __name__ == "__main__":
    main()
