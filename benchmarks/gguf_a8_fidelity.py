"""How far ``quantization="gguf_a8"`` (and, on AMX CPUs, torch's "high" / "medium" float32 matmul
precision) moves SmolLM2 from its float32 model, beside llama.cpp.

gguf_a8 rounds every block of 32 activations to 8 bits before its integer dot products, as
llama.cpp does for the same Q4_1 / Q8_0 file. This measures, on teacher-forced text (the first
5,000 characters of two files of this repository, code and prose), for specserve's float32
model (``gguf``, the default; equal to transformers' to float32 rounding), gguf_a8 and
llama.cpp (``llama-cpp-python``, if installed):

* perplexity of the text;
* how often the top token equals the float32 model's;
* the mean absolute difference of the text tokens' log-probabilities from float32's.

Usage: ``python benchmarks/gguf_a8_fidelity.py [--threads 2]``
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from specserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "specserve" / "spec_decode" / "adaptive.py", ROOT / "README.md"]


def top(entry: dict) -> int:
    return max(entry.items(), key=lambda kv: kv[1].logprob)[0]


def ours(quantization: str | None, texts: list[str], precision: str = "highest"):
    """Per text: (token ids, log-probability of each next token, top token at each position),
    the model loaded at that float32 matmul precision."""
    llm = LLM(device="cpu", max_model_len=2048, quantization=quantization,
              float32_matmul_precision=precision)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    result = []
    for out in llm.generate(texts, params, use_tqdm=False):
        ids = out.prompt_token_ids
        steps = range(1, len(ids))
        result.append((ids, [out.prompt_logprobs[t][ids[t]].logprob for t in steps],
                       [top(out.prompt_logprobs[t]) for t in steps]))
    return result, llm.llm_engine.source.gguf_file


def llama_cpp_scores(gguf: Path, ids: list[int], threads: int):
    import llama_cpp

    model = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, logits_all=True,
                            n_threads=threads, verbose=False)
    model.eval(ids)
    logits = torch.tensor(model.scores[: len(ids)], dtype=torch.float32)  # [T, V]
    logp = torch.log_softmax(logits, -1)
    return ([logp[t - 1, ids[t]].item() for t in range(1, len(ids))],
            logp[:-1].argmax(-1).tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = [path.read_text()[:5000] for path in TEXTS]
    fp32, gguf = ours(None, texts)
    a8, _ = ours("gguf_a8", texts)
    # On a CPU with AMX, torch's "high" / "medium" float32 matmul precision takes x as 2 / 1
    # bfloat16 parts in the GGUF products (quantization/gguf_amx.py); elsewhere they equal float32.
    lower = {p: ours(None, texts, p)[0] for p in ("high", "medium")}
    try:
        import llama_cpp  # noqa: F401
        have_llama_cpp = True
    except ImportError:
        have_llama_cpp = False
    print("| text | tokens | engine | perplexity | top token = float32's | mean abs d logprob |")
    print("|---|---:|---|---:|---:|---:|")
    for i, (path, (ids, lp32, top32), (_, lpa8, topa8)) in enumerate(zip(TEXTS, fp32, a8,
                                                                          strict=True)):
        rows = {"specserve float32 (gguf)": (lp32, top32), "specserve gguf_a8": (lpa8, topa8)}
        for precision, result in lower.items():
            rows[f'specserve float32, matmul precision "{precision}"'] = result[i][1:]
        if have_llama_cpp:
            rows["llama.cpp (same file)"] = llama_cpp_scores(gguf, ids, args.threads)
        n = len(lp32)
        for name, (lp, tops) in rows.items():
            agree = sum(a == b for a, b in zip(tops, top32, strict=True)) / n
            drift = sum(abs(a - b) for a, b in zip(lp, lp32, strict=True)) / n
            print(f"| {path.name} | {n + 1} | {name} | {math.exp(-sum(lp) / n):.3f} | "
                  f"{100 * agree:.1f} % | {drift:.5f} |")
    if not have_llama_cpp:
        print("\n(llama-cpp-python is not installed: pip install llama-cpp-python)")


if __name__ == "__main__":
    main()
