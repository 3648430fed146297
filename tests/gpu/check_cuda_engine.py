"""GPU correctness check for the engine (a script: pytest does not collect it, no test_*.py here).

Builds tiny random Llama checkpoints (2 layers, hidden 256, 4 heads / 2 KV heads, head_dim 64,
llama3 rope scaling, rope_theta 5e5) in float32 and bfloat16 with tests/checkpoints.py, runs
``specserve.LLM`` on the device with ALL prompts in one engine batch, and compares the greedy
continuations token by token with transformers' ``generate`` on the same device, one prompt at a
time (no padding):

  float32   must match exactly (exit status 1 otherwise);
  bfloat16  reported only (exact prompts, shortest and mean agreeing prefix): our fused q/k/v and
            gate/up projections round differently from transformers' separate ones, so long bf16
            continuations may part ways without either being wrong.

Usage:  python tests/gpu/check_cuda_engine.py [--device cuda|cpu] [--new-tokens N]
The benchmark (benchmarks/bench_gpu_engine.py) imports ``run_checks`` from here.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
# tests/ first (checkpoints.py); the repo last, so a PYTHONPATH copy of specserve wins over it.
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from checkpoints import (  # noqa: E402  (tests/checkpoints.py, found through sys.path)
    LLAMA3_ROPE_SCALING,
    TEST_PROMPTS,
    build_tiny_checkpoint,
)

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.outputs import agreeing_prefix  # noqa: E402

HIDDEN = 256
NUM_LAYERS = 2
ROPE_THETA = 500000.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class CheckResult:
    dtype: str
    device: str
    num_prompts: int
    new_tokens: int
    exact: int  # prompts whose continuation equals transformers' exactly
    min_agree: int  # shortest agreeing prefix over prompts
    mean_agree: float
    engine_s: float
    required: bool  # float32: must be exact

    @property
    def ok(self) -> bool:
        return not self.required or self.exact == self.num_prompts


def hf_greedy(model, prompt_ids: list[int], new_tokens: int, device: torch.device) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt, EOS ignored."""
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None  # generate() would fall back to it
    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    ids = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        out = model.generate(ids, generation_config=cfg, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt_ids):].tolist()


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_dtype(dtype_name: str, device: torch.device, workdir: Path, new_tokens: int,
                num_prompts: int) -> CheckResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = DTYPES[dtype_name]
    path = build_tiny_checkpoint(workdir / f"tiny_llama_{dtype_name}", "llama",
                                 num_layers=NUM_LAYERS, hidden_size=HIDDEN, dtype=dtype,
                                 rope_scaling=dict(LLAMA3_ROPE_SCALING), rope_theta=ROPE_THETA)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p) for p in TEST_PROMPTS[:num_prompts]]

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    refs = [hf_greedy(hf, p, new_tokens, device) for p in prompts]
    del hf
    free_device_memory()

    llm = LLM(model=str(path), device=device.type, dtype=dtype_name,
              kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine_s = time.perf_counter() - t0
    got = [o.outputs[0].token_ids for o in outs]
    del llm, outs
    free_device_memory()

    agree = [agreeing_prefix(g, r) for g, r in zip(got, refs, strict=True)]
    exact = sum(g == r for g, r in zip(got, refs, strict=True))
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        if g != r and dtype_name == "float32":
            print(f"  MISMATCH fp32 prompt {i} at token {agree[i]}: engine {g[:agree[i] + 3]} "
                  f"vs transformers {r[:agree[i] + 3]}")
    return CheckResult(dtype_name, str(device), len(prompts), new_tokens, exact, min(agree),
                       sum(agree) / len(agree), engine_s, required=dtype_name == "float32")


def run_checks(device: torch.device, new_tokens: int = 32, num_prompts: int = 12,
               workdir: Path | None = None) -> list[CheckResult]:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        return [check_dtype(name, device, Path(tmp), new_tokens, num_prompts)
                for name in DTYPES]


def format_results(results: list[CheckResult]) -> str:
    lines = [f"{'dtype':9} {'device':7} {'prompts':>7} {'new':>4} {'exact':>5} "
             f"{'min/mean agree':>15} {'engine s':>8}  verdict"]
    for r in results:
        verdict = ("PASS" if r.ok else "FAIL") if r.required else "info (bf16: not required)"
        lines.append(f"{r.dtype:9} {r.device:7} {r.num_prompts:7d} {r.new_tokens:4d} "
                     f"{r.exact:5d} {r.min_agree:7d}/{r.mean_agree:<7.1f} {r.engine_s:8.2f}  "
                     f"{verdict}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=12)
    args = parser.parse_args()
    results = run_checks(torch.device(args.device), args.new_tokens, args.prompts)
    print(format_results(results))
    for r in results:
        print(asdict(r))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
