"""How fast could prompt lookup make input-grounded batch 1 on this machine? (issue 4)

The goal for "[ngram]" on the code-editing prompts is 2x our plain decoding at batch 1. This
script bounds what any policy can get from those proposals on this machine, from two
measurements and no timing of speculation itself:

1. the cost of a target pass by rows verified (``runner.execute_argmax`` on one sequence,
   1..25 rows, interleaved rounds, relative to a 1-row decode pass);
2. SmolLM2's greedy continuation of the benchmark's grounded prompts (plain decoding), and at
   every output position how many proposed tokens would be accepted: those of the most recent
   earlier occurrence of the longest matching tail (what "[ngram]" proposes), and the best
   over every earlier occurrence of every tail length (an oracle choosing among candidates,
   more than any tree of candidates could verify for free).

From these, a dynamic program gives the speedup when every step verifies exactly the proposals
that will be accepted (hindsight: no rejected row is ever paid for), and a search over static
rules "propose j(n) tokens after a match of length n" gives what the best such rule, fitted to
this very data, reaches; and the engine's own adaptive policy (spec_decode/adaptive.py), replayed
over the same proposals with these pass costs fed to it as its step times, shows how much of the
hindsight bound the policy itself leaves, free of this machine's noise. The same three numbers
(hindsight, every proposal verified whole, the policy) are given for "[suffix]" proposals at
k = 5 and at its default k = 24, from the engine's SuffixProposer run over the same output; and
for "[suffix]" with the aligned lookup beside it (spec_decode/hybrid.py: the engine's
HybridProposer run over the output), beside the better of the two sources at every position.

Host work outside the pass is left out. It is paid once per step, so speculation pays it less
often, but a step with proposals does more of it: on the CI machine at batch 1 (gguf_a8,
session 26) 0.16 ms per plain step and 0.43 ms per speculative step, against 6-8 ms passes,
so the engine can land a few % either side of these numbers.

    python benchmarks/grounded_ceiling.py [--tokens 128] [--prompts 6] [--quantization gguf_a8]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_draft_free_cpu import (  # noqa: E402
    NUM_SPECULATIVE_TOKENS,
    SUFFIX_DEFAULT_K,
    Ours,
    humaneval_edit_prompts,
)

from specserve.engine.sequence import Sequence, SequenceStatus  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from specserve.spec_decode.adaptive import AdaptiveSpeculation  # noqa: E402
from specserve.spec_decode.evidence import ALIGNED  # noqa: E402
from specserve.spec_decode.hybrid import HybridProposer  # noqa: E402
from specserve.spec_decode.ngram import AlignedNgramIndex, NgramIndex, NgramProposer  # noqa: E402
from specserve.spec_decode.proposer import Proposer  # noqa: E402
from specserve.spec_decode.spec_config import SpeculativeConfig  # noqa: E402
from specserve.spec_decode.suffix import SuffixProposer  # noqa: E402
from specserve.worker.model_runner import SequenceRun  # noqa: E402

MAX_ROWS = SUFFIX_DEFAULT_K + 1  # "[suffix]" at its default k verifies this many rows


def row_costs(runner, context: int, rounds: int = 7) -> dict[int, float]:
    """Seconds of one greedy target pass with r query rows of one sequence, r = 1..MAX_ROWS
    (the fastest of interleaved rounds: other load only ever slows a pass down, and the
    1-row time divides every other one; with the median, three tables measured back to back
    put the 1-row pass at 6.15 / 7.29 / 6.25 ms and 6 rows at 1.29 / 1.21 / 1.52 of it, with
    the fastest at 5.82 / 5.86 / 5.91 ms and 1.31 / 1.34 / 1.30). Each timed pass follows an
    untimed one of the same rows: a pass of more than 16 rows is a prompt chunk to the CPU
    attention backend and drops its decode-context mirror, which the next short pass then
    rebuilds (timed right after a 17-row pass, a 1-row pass cost ~10 % more and made every
    other row count look cheaper)."""
    samples: dict[int, list[float]] = {r: [] for r in range(1, MAX_ROWS + 1)}
    bs = runner.block_size
    for _ in range(rounds):
        for r in samples:
            blocks = list(range(1, 1 + (context + r + bs - 1) // bs))
            run = SequenceRun([(7 * j) % 1000 for j in range(r)], context, blocks, list(range(r)))
            runner.execute_argmax([run])
            t0 = time.perf_counter()
            runner.execute_argmax([run])
            samples[r].append(time.perf_counter() - t0)
    return {r: min(v) for r, v in samples.items()}


def agreement(proposal: list[int], output: list[int], t: int) -> int:
    """How many of proposal's leading tokens equal output[t:]: what greedy verification at
    output position t accepts."""
    a = 0
    while a < len(proposal) and t + a < len(output) and proposal[a] == output[t + a]:
        a += 1
    return a


def accepted_runs(prompt: list[int], output: list[int], n_max: int, k: int,
                  oracle: bool, aligned: bool = False) -> list[tuple[int, int, int]]:
    """Per output position t: (matched tail length n, proposal length, accepted tokens) of
    the proposal made with output[:t] known (oracle: the best earlier occurrence of any tail
    of length <= n_max; n then is 0). aligned: "[ngram]" with ngram_prompt_lookup_aligned
    (ngram.AlignedNgramIndex); n then is the proposal's evidence (evidence.ALIGNED set when
    the copy alignment chose its occurrence)."""
    seq = prompt + output
    index = AlignedNgramIndex(n_max, 1, len(prompt)) if aligned else NgramIndex(n_max, 1)
    rows = []
    for t in range(len(output)):
        pos = len(prompt) + t
        if oracle:
            best = 0
            for n in range(1, min(n_max, pos) + 1):
                tail = seq[pos - n : pos]
                for end in range(n, pos):
                    if seq[end - n : end] == tail:
                        a = 0
                        while (a < k and end + a < pos and pos + a < len(seq)
                               and seq[end + a] == seq[pos + a]):
                            a += 1
                        best = max(best, a)
            rows.append((0, k, best))
            continue
        proposal, n = index.match(seq[:pos], k)
        rows.append((n, len(proposal), agreement(proposal, output, t)))
    return rows


def default_suffix_proposer() -> SuffixProposer:
    """The engine's SuffixProposer with vLLM's default options."""
    defaults = SpeculativeConfig.__dataclass_fields__
    return SuffixProposer(*(defaults[f"suffix_decoding_{name}"].default for name in (
        "max_tree_depth", "max_cached_requests", "max_spec_factor", "min_token_prob")))


def suffix_runs(prompts: list[list[int]], outputs: list[list[int]], k: int,
                proposer: Proposer | None = None) -> list[list[tuple[int, int, int]]]:
    """accepted_runs for "[suffix]": per prompt and output position, (match length, proposal
    length, accepted tokens) of what the engine's SuffixProposer (vLLM's default options)
    proposes with the output so far known, or what `proposer` does (HybridProposer: "[suffix]"
    with the aligned lookup beside it). The prompts run in order through one proposer, so each
    sees the earlier ones' outputs in its global tree, as in the benchmark's run."""
    proposer = proposer or default_suffix_proposer()
    per_prompt = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        seq = Sequence(i, f"replay-{i}", 0, list(prompt), SamplingParams(max_tokens=len(output)),
                       0.0)
        rows = []
        for t in range(len(output)):
            found = proposer.propose([seq], [k])
            tokens, n = found.token_ids[0], found.match_lengths[0]
            rows.append((n, len(tokens), agreement(tokens, output, t)))
            seq.token_ids.append(output[t])
        seq.status = SequenceStatus.FINISHED_LENGTH
        proposer.free(seq)  # its output joins the global tree
        per_prompt.append(rows)
    return per_prompt


def verify_all_cost(rows: list[tuple[int, int, int]], cost: dict[int, float]) -> float:
    """Total pass cost when every proposal is verified whole: the static rule that proposes
    as many tokens as a pass can verify after a match of any length."""
    longest_match = max((n for n, _, _ in rows), default=0)
    return rule_cost(rows, cost, (MAX_ROWS - 1,) * (longest_match + 1))


def hindsight_cost(rows: list[tuple[int, int, int]], cost: dict[int, float]) -> float:
    """Least total pass cost to emit every token when each step may verify any number of the
    proposals that will be accepted (dynamic program over output positions)."""
    length = len(rows)
    best = [0.0] * (length + 1)
    for t in range(length - 1, -1, -1):
        usable = min(rows[t][2], length - 1 - t, MAX_ROWS - 1)
        best[t] = min(cost[j + 1] + best[t + j + 1] for j in range(usable + 1))
    return best[0]


def rule_cost(rows: list[tuple[int, int, int]], cost: dict[int, float],
              table: tuple[int, ...] | dict[int, int]) -> float:
    """Total pass cost when a match of length n proposes table[n] tokens (0: none); n may
    be an evidence int (aligned proposals) with table a dict by it."""
    t, total = 0, 0.0
    while t < len(rows):
        n, available, accepted = rows[t]
        j = min(table[n], available, len(rows) - 1 - t) if n else 0
        total += cost[j + 1]
        t += min(accepted, j) + 1
    return total


def policy_cost(per_prompt: list[list[tuple[int, int, int]]], cost: dict[int, float],
                k: int, plain_seconds: float = 0.005) -> float:
    """Total pass cost when the engine's adaptive policy chooses every step's proposals: one
    AdaptiveSpeculation across the prompts (its evidence classes are engine-wide), each step's
    cost fed to it as that step's time (cost x plain_seconds), a request's first step teaching
    nothing (driver._decodes_only), and a declined proposal scored against the text as the
    driver's shadow scoring does (one at a time: none is taken while one is undecided; it is
    recorded at once here, when the text decides it there)."""
    policy = AdaptiveSpeculation(k)
    total = 0.0
    for seq_id, rows in enumerate(per_prompt):
        t, first, last_spec, shadow_until = 0, True, False, 0
        while t < len(rows):
            n, available, accepted = rows[t]
            available = min(available, k, len(rows) - 1 - t)
            j = 0
            if n and available:
                j = policy.plan([seq_id], [available], match_lengths=[n])[0]
            else:
                policy.costs.step += 1
            total += cost[j + 1]
            if not first:
                policy.costs.observe(1, j, cost[j + 1] * plain_seconds,
                                     after_spec=last_spec and j == 0)
            first, last_spec = False, j > 0
            if n and available and j:  # verified
                policy.record(seq_id, j, min(accepted, j), n)
            elif n and available and t >= shadow_until:  # declined: scored as a shadow
                policy.record(seq_id, available, min(accepted, available), n)
                shadow_until = t + min(accepted + 1, available)  # the text decides it there
            t += min(accepted, j) + 1
    return total


# ---- richer rules, fitted to the data: how much of the hindsight bound could a predictor of
# acceptance recover? (An in-sample fit, so an upper bound on what such a rule would do on new
# text.)
@dataclass(frozen=True)
class Candidates:
    """At one output position: the "[ngram]" proposal (the most recent earlier occurrence of
    the longest matching tail) and what could tell in advance whether it will be accepted."""

    n: int  # matched tail length (0: no proposal)
    available: int  # proposal length
    accepted: int
    context: int  # how far the context before that occurrence matches the current one, <= 64
    agreement: float  # share of the tail's earlier occurrences followed by the proposed token
    n2: int  # a second candidate: the most recent occurrence whose next token differs ...
    available2: int  # ... (of the longest tail that has one), its length and acceptance
    accepted2: int


def candidate_rows(prompt: list[int], output: list[int], n_max: int, k: int
                   ) -> list[Candidates]:
    """Candidates at every output position of one answer."""
    seq = prompt + output
    rows = []
    for t in range(len(output)):
        pos = len(prompt) + t
        first = second = None  # (tail length, end of the occurrence)
        ends_first: list[int] = []
        for n in range(min(n_max, pos - 1), 0, -1):
            tail = seq[pos - n : pos]
            ends = [e for e in range(n, pos) if seq[e - n : e] == tail]
            for e in reversed(ends):
                if first is None:
                    first, ends_first = (n, e), ends
                elif second is None and seq[e] != seq[first[1]]:
                    second = (n, e)
            if second is not None:
                break

        n, available, accepted = _scored(seq, output, first, k, pos, t)
        n2, available2, accepted2 = _scored(seq, output, second, k, pos, t)
        context = agreement_back(seq, first[1], pos) if first else 0
        share = (sum(seq[e] == seq[first[1]] for e in ends_first) / len(ends_first)
                 if first else 0.0)
        rows.append(Candidates(n, available, accepted, context, share, n2, available2,
                               accepted2))
    return rows


def _scored(seq: list[int], output: list[int], found: tuple[int, int] | None, k: int, pos: int,
            t: int) -> tuple[int, int, int]:
    """(tail length, proposal length, accepted) of the occurrence found = (tail length, end)."""
    if found is None:
        return 0, 0, 0
    proposal = seq[found[1] : min(found[1] + k, pos)]
    return found[0], len(proposal), agreement(proposal, output, t)


def agreement_back(seq: list[int], a: int, b: int, limit: int = 64) -> int:
    """How many tokens before positions a and b agree (the context a proposal's occurrence
    shares with the current position)."""
    m = 0
    while m < limit and a - 1 - m >= 0 and seq[a - 1 - m] == seq[b - 1 - m]:
        m += 1
    return m


def context_class(c: Candidates) -> tuple[int, int]:
    """A feature class: shared context in 7 buckets x agreement of the occurrences in 3."""
    shared = next(i for i, top in enumerate((1, 2, 3, 5, 9, 20, 10**9)) if c.context <= top)
    agree = 0 if c.agreement < 0.5 else 1 if c.agreement < 0.99 else 2
    return shared, agree


def match_length(c: Candidates) -> int:
    """The feature class of a rule by match length alone."""
    return c.n


def class_rule_cost(rows: list[Candidates], cost: dict[int, float], table: dict,
                    second: dict | None = None,
                    key: Callable[[Candidates], object] = context_class) -> float:
    """Total pass cost when a proposal in feature class key(c) verifies table[key(c)] tokens,
    plus (second) second[(n, n2)] tokens of the second candidate: a tree of two branches, all
    its rows paid for, the longer accepted branch taken."""
    t, total = 0, 0.0
    while t < len(rows):
        c = rows[t]
        left = len(rows) - 1 - t
        j = min(table.get(key(c), 0), c.available, left)
        j = j if c.n else 0
        j2 = (min(second.get((c.n, c.n2), 0), c.available2, left)
              if second is not None and c.n2 and j else 0)
        total += cost[j + j2 + 1]
        t += max(min(c.accepted, j), min(c.accepted2, j2)) + 1
    return total


def fit_tables(rows: list[list[Candidates]], cost: dict[int, float], k: int,
               tables: list[dict], key: Callable[[Candidates], object] = context_class,
               rounds: int = 3) -> float:
    """coordinate_descent over class_rule_cost's tables (the first, then the second
    candidate's if given); returns the fitted total cost."""
    return coordinate_descent(
        tables, k, lambda: sum(class_rule_cost(r, cost, *tables, key=key) for r in rows), rounds)


def coordinate_descent(tables: list[dict], k: int, total: Callable[[], float],
                       rounds: int = 3) -> float:
    """Coordinate descent over the entries (0..k tokens each) of tables, in place, lowering
    total() (which reads them); an entry moves only to a strictly lower total. Returns the
    lowest total found."""
    best = total()
    for _ in range(rounds):
        for table in tables:
            for entry in list(table):
                for j in range(k + 1):
                    old, table[entry] = table[entry], j
                    value = total()
                    if value < best - 1e-12:
                        best = value
                    else:
                        table[entry] = old
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt (as the "
                    "benchmark: 128)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None,
                    help="as LLM(quantization=...): gguf_a8 for 8-bit activations")
    ap.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                    help="torch.set_float32_matmul_precision before loading (AMX: bfloat16 parts "
                         "of x, see quantization/gguf_amx.py)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(args.matmul_precision)

    plain = Ours() if args.quantization is None else Ours(quantization=args.quantization)
    prompts = [plain.chat_ids(text) for text in humaneval_edit_prompts(args.prompts)]
    outputs = [list(o) for o in plain.generate(prompts, args.tokens)]
    context = int(statistics.median(len(p) for p in prompts)) + args.tokens // 2
    seconds = row_costs(plain.llm.llm_engine.runner, context)
    cost = {r: s / seconds[1] for r, s in seconds.items()}
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, {args.threads} "
          f"threads, quantization {args.quantization or 'default'}, float32 matmul precision "
          f"{args.matmul_precision}; {len(prompts)} grounded prompts, "
          f"{sum(map(len, outputs))} output tokens")
    print(f"\ntarget pass by rows (one sequence, context {context}; 1 row = "
          f"{1e3 * seconds[1]:.2f} ms):")
    print("| rows | " + " | ".join(str(r) for r in cost) + " |")
    print("|---" * (len(cost) + 1) + "|")
    print("| x 1 row | " + " | ".join(f"{c:.2f}" for c in cost.values()) + " |")

    plain_cost = sum(len(o) for o in outputs)  # one 1-row pass per token

    def per_prompt(k: int, oracle: bool) -> list[list[tuple[int, int, int]]]:
        return [accepted_runs(p, o, args.ngram_max, k, oracle)
                for p, o in zip(prompts, outputs, strict=True)]

    print("\n| proposals up to k | hindsight, most recent occurrence | hindsight, oracle "
          "candidate | positions with nothing accepted (most recent / oracle) |")
    print("|---:|---:|---:|---:|")
    recent_by_k = {}
    for k in (5, 8, 16):
        recent, oracle = per_prompt(k, False), per_prompt(k, True)
        recent_by_k[k] = recent
        zero = [100 * sum(a == 0 for rs in x for _, _, a in rs) / plain_cost for x in (recent,
                                                                                     oracle)]
        print(f"| {k} | {plain_cost / sum(hindsight_cost(r, cost) for r in recent):.3f}x | "
              f"{plain_cost / sum(hindsight_cost(r, cost) for r in oracle):.3f}x | "
              f"{zero[0]:.0f} % / {zero[1]:.0f} % |")

    k = 8
    recent = recent_by_k[k]
    best = min(itertools.product(range(k + 1), repeat=args.ngram_max),
               key=lambda tb: sum(rule_cost(r, cost, (0, *tb)) for r in recent))
    speedup = plain_cost / sum(rule_cost(r, cost, (0, *best)) for r in recent)
    print(f"\nbest static rule fitted to this data (k <= {k}): propose {best} tokens after a "
          f"match of length 1..{args.ngram_max}: {speedup:.3f}x")
    for k in (5, 8):
        replayed = plain_cost / policy_cost(recent_by_k[k], cost, k)
        print(f"the engine's adaptive policy replayed on these proposals (k = {k}): "
              f"{replayed:.3f}x")
    k = 8
    rows = [candidate_rows(p, o, args.ngram_max, k) for p, o in zip(prompts, outputs,
                                                                      strict=True)]
    by_class = {(a, b): 3 for a in range(7) for b in range(3)}
    fitted = fit_tables(rows, cost, k, [by_class])
    print(f"best rule by shared context x agreement of the occurrences (21 classes fitted to "
          f"this data, k <= {k}): {plain_cost / fitted:.3f}x")
    first = {n: 3 for n in range(1, args.ngram_max + 1)}
    second = {(a, b): 0 for a in first for b in first if b <= a}
    fitted = fit_tables(rows, cost, k, [first, second], key=match_length)
    print(f"best tree of two candidates (the proposal + the most recent occurrence with "
          f"another next token; tokens per branch by match lengths, fitted, every row paid "
          f"for): {plain_cost / fitted:.3f}x")

    print('\n"[ngram]" with ngram_prompt_lookup_aligned (the occurrence next to the copy '
          "anchor, see spec_decode/ngram.py), the same output:\n")
    print("| k | hindsight | positions with nothing accepted | best rule by evidence class "
          "(fitted) | adaptive policy replayed |")
    print("|---:|---:|---:|---:|---:|")
    for k in (5, 8):
        rows = [accepted_runs(p, o, args.ngram_max, k, False, aligned=True)
                for p, o in zip(prompts, outputs, strict=True)]
        zero = 100 * sum(a == 0 for rs in rows for _, _, a in rs) / plain_cost
        table = {n: 3 for rs in rows for n, _, _ in rs if n}  # tokens per evidence class
        fitted = plain_cost / coordinate_descent(
            [table], k, lambda rows=rows, table=table: sum(rule_cost(r, cost, table)
                                                            for r in rows))
        named = {f"{n & (ALIGNED - 1)}{'a' if n & ALIGNED else ''}": j
                 for n, j in sorted(table.items())}
        print(f"| {k} | {plain_cost / sum(hindsight_cost(r, cost) for r in rows):.3f}x | "
              f"{zero:.0f} % | {fitted:.3f}x {named} | "
              f"{plain_cost / policy_cost(rows, cost, k):.3f}x |")

    print('\n"[suffix]" proposals (vLLM\'s default options), the same output:\n')
    print("| k | hindsight | verify every proposal whole | adaptive policy replayed |")
    print("|---:|---:|---:|---:|")
    for k in (NUM_SPECULATIVE_TOKENS, SUFFIX_DEFAULT_K):
        rows = suffix_runs(prompts, outputs, k)
        speedups = [plain_cost / sum(hindsight_cost(r, cost) for r in rows),
                    plain_cost / sum(verify_all_cost(r, cost) for r in rows),
                    plain_cost / policy_cost(rows, cost, k)]
        print(f"| {k} | " + " | ".join(f"{x:.3f}x" for x in speedups) + " |")

    k = SUFFIX_DEFAULT_K
    print('\n"[suffix]" with the aligned lookup beside it (ngram_prompt_lookup_aligned=True, '
          "spec_decode/hybrid.py), the same output, k = 24:\n")
    suffix = suffix_runs(prompts, outputs, k)
    aligned = [accepted_runs(p, o, args.ngram_max, k, False, aligned=True)
               for p, o in zip(prompts, outputs, strict=True)]
    lookup = NgramProposer(args.ngram_max, 1, aligned=True)
    hybrid = suffix_runs(prompts, outputs, k, HybridProposer(default_suffix_proposer(), lookup))
    better = [[(1, max(a[1], b[1]), max(a[2], b[2])) for a, b in zip(ra, rb, strict=True)]
              for ra, rb in zip(aligned, suffix, strict=True)]
    only = [sum((a[2] > 0) > (b[2] > 0) for ra, rb in zip(x, y, strict=True)
                for a, b in zip(ra, rb, strict=True)) for x, y in ((aligned, suffix),
                                                                  (suffix, aligned))]
    print(f"first token accepted only from the lookup at {only[0]} positions, only from the "
          f"suffix trees at {only[1]}\n")
    print("| proposals | hindsight | adaptive policy replayed |")
    print("|---|---:|---:|")
    for name, rows in (("aligned lookup alone", aligned), ('"[suffix]" alone', suffix),
                       ("the hybrid's choice", hybrid)):
        print(f"| {name} | {plain_cost / sum(hindsight_cost(r, cost) for r in rows):.3f}x | "
              f"{plain_cost / policy_cost(rows, cost, k):.3f}x |")
    print(f"| the better of the two at every position | "
          f"{plain_cost / sum(hindsight_cost(r, cost) for r in better):.3f}x | - |")


if __name__ == "__main__":
    main()
