"""Batch-1 greedy decode on a GPU, one-step vs multi-step decoding, interleaved rounds.

A quick check of issue 6's first goal (>= 85 % of the bandwidth roofline end to end) that costs
about a minute of device time instead of bench_gpu_spec.py's two: the same random Llama-3-8B
"permutation walk" target (bench_gpu_spec.build_hf), 128-token prompt, 256 new tokens, the copy
bandwidth measured in the same run; each round runs every num_scheduler_steps setting once, so
drift hits them alike. Every setting must emit the same tokens (checked).

Usage: ``python3 benchmarks/bench_gpu_decode_b1.py [--steps 1 8 16] [--rounds 3] [--smoke]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu_spec import (
    LLAMA3_8B,
    PROMPT_LEN,
    SMOKE,
    build_hf,
    copy_bandwidth,
    free,
    register,
    run_engine,
    set_scheduler_steps,
    weight_bytes,
)

from specserve import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    bw = copy_bandwidth(device, (64 if args.smoke else 4096) << 20)
    free()
    shape = {**LLAMA3_8B, **(SMOKE if args.smoke else {})}
    hf = build_hf(shape, device, 0, dtype, walk=True)
    read, _ = weight_bytes(hf)
    path = register(hf, Path(tempfile.mkdtemp(prefix="bench_b1_")) / "target")
    new = 32 if args.smoke else 256
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * (
        shape["hidden_size"] // shape["num_attention_heads"]) * dtype.itemsize
    bytes_tok = read + (PROMPT_LEN + new / 2) * kv_per_token
    roof = bw / bytes_tok
    llm = LLM(model=path, device=device.type, dtype=str(dtype).removeprefix("torch."),
              max_model_len=1024, max_num_seqs=8, enable_prefix_caching=False,
              kv_cache_memory_bytes=(1 if args.smoke else 8) << 30)
    prompt = [torch.randint(3, shape["vocab_size"], (PROMPT_LEN,),
                            generator=torch.Generator().manual_seed(0)).tolist()]
    rates: dict[int, list[float]] = {s: [] for s in args.steps}
    outputs: dict[int, list[int]] = {}
    for steps in args.steps:  # warm-up: graphs, kernels
        set_scheduler_steps(llm, steps)
        run_engine(llm, prompt, 16, f"warm{steps}")
    for r in range(args.rounds):
        for steps in args.steps:
            set_scheduler_steps(llm, steps)
            rate, outs, _ = run_engine(llm, prompt, new, f"r{r}s{steps}")
            rates[steps].append(rate)
            outputs.setdefault(steps, outs[0])
    same = all(o == outputs[args.steps[0]] for o in outputs.values())
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s; {bytes_tok / 1e9:.2f} GB per token: roofline "
          f"{1e3 / roof:.2f} ms = {roof:.0f} tok/s; same tokens in every setting: {same}")
    print("| num_scheduler_steps | tok/s per round | median tok/s | ms/token | % of roofline |")
    print("|---|---|---|---|---|")
    for steps, rs in rates.items():
        med = statistics.median(rs)
        print(f"| {steps} | {' / '.join(f'{x:.1f}' for x in rs)} | {med:.1f} | "
              f"{1e3 / med:.2f} | {100 * med / roof:.1f}% |")


if __name__ == "__main__":
    main()
