"""Does a tensor-memory-accelerator (TMA) weight stream make the multi-row GEMV as fast as the
one-row kernel? (a GPU script: pytest does not collect it)

Why: a batch-1 verification step costs 1.10-1.11x a decode step on the H200 (BENCHMARKS.md,
sessions 19-22), and nearly all of the extra is the multi-row GEMV ("dot" in layers/gemv.py)
streaming 3-13 % slower than the one-row kernel at the same bytes. Seven schedules of the same
load path (plain tl.load, staged by Triton's cp.async pipeliner) were measured in sessions 12-13.
This script tries the other load path Hopper has: the weight tile fetched by TMA through a
host-built tensor descriptor (triton.tools.tensor_descriptor), which takes address generation
and masking off the SMs and lands the tile in shared memory where wgmma reads it.

Timed as tests/gpu/sweep_gemv.py times (graphs of calls cycling through weight copies that miss
L2, PDL on as the engine launches), at Llama-3-8B's shapes, M = 1, 2, 5, 9 rows:
  one-row  triton_ops.gemv, the decode kernel (M = 1 only)
  dot      gemv.gemv_rows with its ROWS_CONFIGS (what a verification runs now)
  tma      the kernel below, for each of CONFIGS (best reported, and every one in the log)
Every output is checked against a float32 reference first (relative max and norm <= 1e-2).

  PYTHONPATH=$PWD python3 tests/gpu/sweep_tma_gemv.py [--out DIR] [--smoke]
--smoke: tiny shapes on the CPU under TRITON_INTERPRET=1 (debugs the script only).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
sys.path.append(str(REPO / "tests" / "gpu"))

import sweep_gemv  # noqa: E402

from specserve.model.layers import gemv, pdl, triton_ops  # noqa: E402

SHAPES_8B = {(6144, 4096): "qkv", (4096, 4096): "o", (28672, 4096): "gate_up",
             (4096, 14336): "down", (128256, 4096): "lm_head"}
ROWS = [1, 2, 5, 9]
# (BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = [(64, 128, 4, 4), (64, 128, 4, 6), (64, 128, 4, 8), (128, 128, 4, 4),
           (128, 128, 4, 6), (64, 64, 4, 8), (64, 64, 4, 12), (128, 64, 4, 8),
           (32, 256, 4, 4), (32, 256, 4, 6), (64, 256, 4, 3), (64, 256, 4, 4)]


@functools.cache
def _kernel():
    global triton, tl, pdl_jit  # kernels resolve names in this module's globals
    import triton
    import triton.language as tl

    from specserve.model.layers import pdl_jit

    @triton.jit(do_not_specialize=["n_m"])
    def _gemv_rows_tma(x_ptr, w_desc, out_ptr, n_m, n_rows, n_cols, stride_x, stride_o,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
        """out [n_m, n_rows] = x [n_m, n_cols] @ w.T, w's [BLOCK_N, BLOCK_K] tiles by TMA
        (n_cols % BLOCK_K == 0; rows past n_rows come back as zeros from the descriptor)."""
        n0 = tl.program_id(0) * BLOCK_N
        m = tl.arange(0, BLOCK_M)
        m_mask = m < n_m
        x_ptrs = x_ptr + m[:, None] * stride_x  # [BLOCK_M, 1]
        cols = tl.arange(0, BLOCK_K)
        w = w_desc.load([n0, 0])  # [BLOCK_N, BLOCK_K], before the wait: weights are constant
        pdl_jit.release_and_wait(PDL)
        x = tl.load(x_ptrs + cols[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), tl.zeros((BLOCK_N, BLOCK_M), tl.float32))
        for k0 in tl.range(BLOCK_K, n_cols, BLOCK_K, num_stages=NUM_STAGES):
            w = w_desc.load([n0, k0])
            x = tl.load(x_ptrs + (k0 + cols)[None, :], mask=m_mask[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
        rows = n0 + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + m[:, None] * stride_o + rows[None, :],
                 tl.trans(acc).to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & (rows < n_rows)[None, :])

    return _gemv_rows_tma


_DESCRIPTORS: dict = {}


def gemv_rows_tma(x: torch.Tensor, weight: torch.Tensor, config) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, block_k, warps, stages = config
    (num_m, n_cols), n_rows = x.shape, weight.shape[0]
    assert n_cols % block_k == 0
    key = (weight.data_ptr(), block_n, block_k)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        desc = _DESCRIPTORS[key] = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    out = torch.empty(num_m, n_rows, dtype=x.dtype, device=x.device)
    grid = ((n_rows + block_n - 1) // block_n,)
    _kernel()[grid](x, desc, out, num_m, n_rows, n_cols, x.stride(0), out.stride(0),
                    BLOCK_M=max(16, gemv.row_bucket(num_m)), BLOCK_N=block_n, BLOCK_K=block_k,
                    NUM_STAGES=stages, num_warps=warps, num_stages=stages,
                    **pdl.launch_options(x))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    bench = sweep_gemv.Bench(argparse.Namespace(smoke=args.smoke, pdl=not args.smoke, out=None))
    if not args.smoke:
        import triton

        def alloc(size: int, alignment: int, stream):
            return torch.empty(size, device="cuda", dtype=torch.int8)
        triton.set_allocator(alloc)
    shapes = {(96, 128): "tiny a", (200, 256): "tiny b"} if args.smoke else SHAPES_8B
    configs = [(32, 64, 4, 2), (64, 128, 4, 3)] if args.smoke else CONFIGS
    log = sweep_gemv.log
    rows_out = []
    for (n, k), name in shapes.items():
        ws = bench.weights(n, k)
        ref_w = ws[0].float()
        for m in ROWS:
            x = bench.randn(m, k)
            ref = x.float() @ ref_w.T
            row = {"shape": name, "n": n, "k": k, "m": m, "tma": {}}
            if m == 1:
                one = triton_ops.GEMV_CONFIGS.get((n, k))
                if one is not None or args.smoke:
                    one = one or next(iter(triton_ops.GEMV_CONFIGS.values()))
                    if bench.check(f"one-row {name}", triton_ops.gemv(x, ws[0], None, one), ref):
                        row["one_row"] = bench.time_calls(
                            [lambda w=w, x=x, c=one: triton_ops.gemv(x, w, None, c) for w in ws])
            else:
                cfg = gemv.ROWS_CONFIGS.get((n, k, gemv.row_bucket(m)),
                                            gemv.RowsConfig("dot", 64, 128, 4, 4))
                if bench.check(f"dot {name} M={m}", gemv.gemv_rows(x, ws[0], None, cfg), ref):
                    row["dot"] = bench.time_calls(
                        [lambda w=w, x=x, c=cfg: gemv.gemv_rows(x, w, None, c) for w in ws])
            for cfg in configs:
                try:
                    out = gemv_rows_tma(x, ws[0], cfg)
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                    log(f"  skip tma {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                    continue
                if not bench.check(f"tma {name} M={m} {cfg}", out, ref):
                    continue
                row["tma"][str(cfg)] = bench.time_calls(
                    [lambda w=w, x=x, c=cfg: gemv_rows_tma(x, w, c) for w in ws])
            best = min(row["tma"].items(), key=lambda kv: kv[1]) if row["tma"] else ("-", float("nan"))
            nbytes = n * k * ws[0].element_size()
            base = row.get("one_row", row.get("dot", float("nan")))
            log(f"{name} M={m}: {'one-row' if m == 1 else 'dot'} {base:.2f} us "
                f"({nbytes / base / 1e3:.0f} GB/s) | tma best {best[0]} {best[1]:.2f} us "
                f"({nbytes / best[1] / 1e3:.0f} GB/s) ratio {best[1] / base:.3f}")
            log("    every tma config: " + ", ".join(f"{c} {t:.2f}" for c, t in row["tma"].items()))
            rows_out.append(row)
            _DESCRIPTORS.clear()
        del ws
        torch.cuda.empty_cache() if not args.smoke else None
    log("\n| shape | M | now (one-row at 1, dot) us | tma best us | tma config | tma / now |")
    log("|---|---|---|---|---|---|")
    for row in rows_out:
        base = row.get("one_row", row.get("dot", float("nan")))
        if row["tma"]:
            c, t = min(row["tma"].items(), key=lambda kv: kv[1])
            log(f"| {row['shape']} | {row['m']} | {base:.2f} | {t:.2f} | {c} | {t / base:.3f} |")
    med = [min(r["tma"].values()) / r.get("one_row", r.get("dot"))
           for r in rows_out if r["tma"] and (r.get("one_row") or r.get("dot"))]
    if med:
        log(f"median tma / now: {statistics.median(med):.3f}")
    log(f"failures: {bench.failures or 'none'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep_tma_gemv.json").write_text(json.dumps(rows_out, indent=1))
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
