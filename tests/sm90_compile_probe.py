"""Compile every Triton kernel of a CUDA decode/verify step for an H100/H200 (sm_90) on this
CPU, with programmatic dependent launch on, and report what the PTX says (a script:
tests/test_sm90_compile.py runs it in a fresh process and checks its report).

Why: the kernels' PDL branches (layers/pdl.py) only compile for a GPU, so the CPU suite's
interpreter runs never see them; a mistake there used to surface only in a device run. Triton
compiles to PTX and a cubin without a GPU when it is given the target. The launches are the
engine's own: the launch functions (triton_ops, gemv, fused_mlp, the Triton attention backend)
are called on Llama-3-8B-shaped tensors (CPU tensors, never touched) with JITFunction.run
replaced by a recorder, so each recorded launch carries the constexprs, num_warps and
num_stages a GPU step would use.

Output: one JSON object per distinct kernel configuration: kernel name, constexprs, and
where in the PTX the first global load, the first global store and the PDL instructions are.
Run without TRITON_INTERPRET (the test's subprocess clears it).
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from specserve.model.layers import fused_mlp, gemv, pdl, triton_ops  # noqa: E402
from specserve.model.layers.attention import triton_backend  # noqa: E402
from specserve.model.layers.attention.metadata import AttentionMetadata  # noqa: E402
from specserve.model.layers.rotary import RotaryEmbedding  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
LAUNCH_OPTIONS = {"num_warps", "num_stages", "launch_pdl", "num_ctas", "grid", "warmup"}
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                 torch.int32: "*i32", torch.int64: "*i64"}

Launch = tuple[JITFunction, dict, dict]  # kernel, bound arguments, launch options
recorded: list[Launch] = []


def record(self: JITFunction, *args, **kwargs):
    """Stands in for JITFunction.run: keeps the launch instead of compiling and running it."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in LAUNCH_OPTIONS}
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    recorded.append((self, dict(bound.arguments), options))


def type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_launch(kernel: JITFunction, arguments: dict, options: dict) -> dict:
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = arguments[name]
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[name] = type_of(value)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=TARGET, options={
        "num_warps": options.get("num_warps", 4), "num_stages": options.get("num_stages", 3)})
    ptx = compiled.asm["ptx"]
    body = ptx[ptx.index(".entry"):]

    def first(pattern: str) -> int:
        match = re.search(pattern, body)
        return match.start() if match else -1

    return {
        "kernel": kernel.fn.__name__,
        "constexprs": {n: arguments[n] for n in kernel.arg_names if n in constexpr_names},
        "num_warps": options.get("num_warps", 4), "num_stages": options.get("num_stages", 3),
        "launch_pdl": options.get("launch_pdl", False),
        "first_load": first(r"\b(ld\.global|cp\.async)"),
        "first_store": first(r"\b(st\.global|atom\.|red\.)"),
        "launch_dependents": first(r"griddepcontrol\.launch_dependents"),
        "wait": first(r"griddepcontrol\.wait"),
    }


def launch_everything() -> None:
    """One call of every launch function at the Llama-3-8B shapes a step uses (and the
    Llama-3.2-1B draft's GEMV shapes), with PDL on as inside a graph capture."""
    bf16 = {"dtype": torch.bfloat16}
    x = torch.empty(1, 4096, **bf16)
    triton_ops.rms_norm(x, torch.empty(4096, **bf16), 1e-5)
    triton_ops.add_rms_norm(x, x, torch.empty(4096, **bf16), 1e-5)
    triton_ops.silu_mul(torch.empty(3, 28672, **bf16))
    for (n, k), config in triton_ops.GEMV_CONFIGS.items():
        triton_ops.gemv(torch.empty(1, k, **bf16), torch.empty(n, k, **bf16), None, config)
    for (n, k), config in fused_mlp.GATE_UP_CONFIGS.items():
        fused_mlp.gate_up_silu(torch.empty(1, k, **bf16), torch.empty(n, k, **bf16), config)
    for (n, k, bucket), config in gemv.ROWS_CONFIGS.items():
        rows = torch.empty(bucket, k, **bf16)
        gemv.gemv_rows(rows, torch.empty(n, k, **bf16), None, config)
        if (n, k) in fused_mlp.GATE_UP_CONFIGS and config.pairs_rows:
            gemv.gate_up_silu_rows(rows, torch.empty(n, k, **bf16), config)
    heads, kv_heads, head_dim, page = 32, 8, 128, 16
    backend = triton_backend.TritonAttentionBackend(num_sms=132)
    rope = RotaryEmbedding(head_dim, 8192, 5e5)
    for num_tokens, context in ((1, 384), (5, 384)):  # decode, a k = 4 verification
        blocks = (context + page - 1) // page
        meta = AttentionMetadata(
            torch.arange(num_tokens), torch.arange(blocks, dtype=torch.int32)[None],
            torch.tensor([context], dtype=torch.int32),
            torch.tensor([0, num_tokens], dtype=torch.int32), [num_tokens], [context],
            num_tokens, context, page)
        backend.prepare(meta)
        k_cache = torch.empty(blocks, page, kv_heads, head_dim, **bf16)
        qkv = torch.empty(num_tokens, (heads + 2 * kv_heads) * head_dim, **bf16)
        table = rope.table(torch.arange(context - num_tokens, context))
        q = backend.rotate_and_write_kv(qkv, rope, table, k_cache, k_cache, meta)
        key = torch.empty(num_tokens, kv_heads, head_dim, **bf16)
        backend.write_kv(key, key, k_cache, k_cache, meta)
        backend.forward(q, k_cache, k_cache, meta, head_dim**-0.5)


def main() -> None:
    cuda_like = {"launch_pdl": True, "PDL": True}
    with (mock.patch.object(JITFunction, "run", record),
          mock.patch.object(triton_ops, "available", lambda t: True),
          mock.patch.object(pdl, "launch_options", lambda t: dict(cuda_like))):
        launch_everything()
        triton_ops.rms_norm(torch.empty(1, 4096, dtype=torch.bfloat16),
                            torch.empty(4096, dtype=torch.bfloat16), 1e-5)
    recorded[-1][1]["PDL"] = False  # the same kernel once without PDL
    recorded[-1][2]["launch_pdl"] = False
    seen = set()
    for kernel, arguments, options in recorded:
        key = (kernel.fn.__name__, repr(sorted((n, arguments[n]) for n in kernel.arg_names
                                               if n in {p.name for p in kernel.params
                                                        if p.is_constexpr})),
               options.get("num_warps"), options.get("num_stages"))
        if key in seen:
            continue
        seen.add(key)
        print(json.dumps(compile_launch(kernel, arguments, options)), flush=True)


if __name__ == "__main__":
    main()
