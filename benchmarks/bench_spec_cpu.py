"""Speculative decoding on this CPU with SmolLM2-135M-Instruct as the target (issue 3).

Prints, in one run:
1. the cost of one verification pass over k+1 query tokens relative to one plain decode step,
   k = 1..8, at batch 1 (context ~ 200 tokens);
2. tokens/s with and without speculation for the drafts we have: SmolLM2 itself (acceptance 1,
   an upper bound on the overhead-free case) and a truncated SmolLM2 (first N layers), plus
   prompt lookup ("[ngram]").

Usage: python benchmarks/bench_spec_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.model.loader import iter_weights, load_hf_config, load_tokenizer, resolve_model
from specserve.worker.model_runner import SequenceRun

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works, with an example in Python.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for pancakes.",
]


def build_truncated_draft(num_layers: int, out: Path) -> Path:
    """SmolLM2's first num_layers layers as a same-vocabulary draft checkpoint."""
    from safetensors.torch import save_file

    source = resolve_model(None)
    config = load_hf_config(source)
    config.num_hidden_layers = num_layers
    weights = {name: t.float().contiguous() for name, t in iter_weights(source)
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    config.save_pretrained(out)
    save_file(weights, str(out / "model.safetensors"))
    load_tokenizer(source).save_pretrained(out)
    return out


def time_verify_cost(llm: LLM, max_k: int, repeats: int) -> list[tuple[int, float, float]]:
    """Median ms of a decode step (1 query token) vs a verify step (k+1 query tokens)."""
    runner = llm.llm_engine.runner
    context = 200
    blocks = list(range((context + max_k + 16) // 16 + 1))
    tokens = torch.randint(0, 49152, (context + max_k + 1,)).tolist()
    runner.execute([SequenceRun(tokens[:context], 0, blocks, [context - 1])])

    def timed(n: int) -> float:
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.execute([SequenceRun(tokens[context : context + n], context, blocks,
                                        list(range(n)))])
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e3

    decode_ms = timed(1)
    return [(k, decode_ms, timed(k + 1)) for k in range(1, max_k + 1)]


def time_generation(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    chats = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    llm.generate(chats[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = []
    for chat in chats:  # batch 1
        outs += llm.generate(chat, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, outs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--draft-layers", type=int, default=4)
    args = parser.parse_args()
    max_tokens = 32 if args.quick else 96
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    plain = LLM(device="cpu", max_model_len=2048)

    print("== verification cost (batch 1, context 200) ==")
    print(f"{'k':>3} {'decode ms':>10} {'verify ms':>10} {'ratio':>6}")
    for k, decode_ms, verify_ms in time_verify_cost(plain, 8, 5 if args.quick else 15):
        print(f"{k:>3} {decode_ms:>10.2f} {verify_ms:>10.2f} {verify_ms / decode_ms:>6.2f}")

    base_tps, base_outs = time_generation(plain, prompts, max_tokens)
    rows = [("none", base_tps, None, True)]
    with tempfile.TemporaryDirectory() as tmp:
        draft = build_truncated_draft(args.draft_layers, Path(tmp))
        configs = [
            ("self-draft k=4", dict(speculative_model="SmolLM2-135M-Instruct",
                                    num_speculative_tokens=4)),
            (f"{args.draft_layers}-layer draft k=4", dict(speculative_model=str(draft),
                                                          num_speculative_tokens=4)),
            ("[ngram] k=5", dict(speculative_model="[ngram]", num_speculative_tokens=5,
                                 ngram_prompt_lookup_max=4)),
        ]
        for name, kwargs in configs:
            llm = LLM(device="cpu", max_model_len=2048, **kwargs)
            tps, outs = time_generation(llm, prompts, max_tokens)
            same = [o.outputs[0].token_ids for o in outs] == [
                o.outputs[0].token_ids for o in base_outs]
            rows.append((name, tps, llm.get_metrics()["spec_decode"], same))
            del llm
    print("\n== greedy generation, batch 1, chat prompts ==")
    print(f"{'speculation':<22} {'tok/s':>7} {'vs none':>8} {'accept':>7} {'mean len':>9} "
          f"{'same output':>12}")
    for name, tps, spec, same in rows:
        accept = f"{spec['draft_acceptance_rate']:.3f}" if spec else "-"
        mean_len = f"{spec['mean_acceptance_length']:.2f}" if spec else "-"
        print(f"{name:<22} {tps:>7.1f} {tps / base_tps:>7.2f}x {accept:>7} {mean_len:>9} "
              f"{str(same):>12}")


if __name__ == "__main__":
    main()
