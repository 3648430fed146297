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
  tma      gemv's "tma" variant, for each of CONFIGS (best reported, every one in the log)
The gate_up shape runs fused with silu (gemv.gate_up_silu_rows), as the engine runs it.
Every output is checked against a float32 reference first (relative max and norm <= 1e-2).

  PYTHONPATH=$PWD python3 tests/gpu/sweep_tma_gemv.py [--out DIR] [--smoke] [--shapes 1B]
--smoke: tiny shapes on the CPU under TRITON_INTERPRET=1 (debugs the script only).
"""

from __future__ import annotations

import argparse
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

from specserve.model.layers import gemv, triton_ops  # noqa: E402

SHAPES_8B = {(6144, 4096): "qkv", (4096, 4096): "o", (28672, 4096): "gate_up+silu",
             (4096, 14336): "down", (128256, 4096): "lm_head"}
SHAPES_1B = {(3072, 2048): "1B qkv", (2048, 2048): "1B o", (16384, 2048): "1B gate_up+silu",
             (2048, 8192): "1B down", (128256, 2048): "1B lm_head"}
GATE_UP = {(28672, 4096), (16384, 2048), (96, 128)}  # run fused with silu, as the engine runs them
ROWS = [1, 2, 5, 9]
# (BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = [(64, 128, 4, 4), (64, 128, 4, 6), (128, 128, 4, 4), (128, 128, 4, 6),
           (64, 64, 4, 8), (128, 64, 4, 8), (32, 256, 4, 4), (64, 256, 4, 3)]


def tma_rows(x: torch.Tensor, weight: torch.Tensor, config, gate_up: bool) -> torch.Tensor:
    cfg = gemv.RowsConfig("tma", *config)
    return gemv.gate_up_silu_rows(x, weight, cfg) if gate_up else gemv.gemv_rows(x, weight, None,
                                                                                  cfg)


def now_rows(x: torch.Tensor, weight: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """What a verification runs now: the shape's ROWS_CONFIGS entry (gate_up fused with silu)."""
    n, k = weight.shape
    cfg = gemv.ROWS_CONFIGS.get((n, k, gemv.row_bucket(x.shape[0])),
                                gemv.RowsConfig("dot", 64, 128, 4, 4))
    return gemv.gate_up_silu_rows(x, weight, cfg) if gate_up else gemv.gemv_rows(x, weight, None,
                                                                                  cfg)


def reference(x: torch.Tensor, w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    out = x.float() @ w.float().T
    if gate_up:
        gate, up = out.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--shapes", choices=("8B", "1B"), default="8B")
    args = parser.parse_args()
    bench = sweep_gemv.Bench(argparse.Namespace(smoke=args.smoke, pdl=not args.smoke, out=None))
    if not args.smoke:
        import triton

        def alloc(size: int, alignment: int, stream):
            return torch.empty(size, device="cuda", dtype=torch.int8)
        triton.set_allocator(alloc)
    shapes = ({(96, 128): "tiny a", (200, 256): "tiny b"} if args.smoke
              else SHAPES_1B if args.shapes == "1B" else SHAPES_8B)
    configs = [(32, 64, 4, 2), (64, 128, 4, 3)] if args.smoke else CONFIGS
    log = sweep_gemv.log
    rows_out = []
    for (n, k), name in shapes.items():
        ws = bench.weights(n, k)
        gate_up = (n, k) in GATE_UP
        for m in ROWS:
            x = bench.randn(m, k)
            ref = reference(x, ws[0], gate_up)
            row = {"shape": name, "n": n, "k": k, "m": m, "tma": {}}
            if m == 1 and not gate_up:
                one = triton_ops.GEMV_CONFIGS.get((n, k))
                if one is not None:
                    if bench.check(f"one-row {name}", triton_ops.gemv(x, ws[0], None, one), ref):
                        row["one_row"] = bench.time_calls(
                            [lambda w=w, x=x, c=one: triton_ops.gemv(x, w, None, c) for w in ws])
            elif m > 1:
                if bench.check(f"now {name} M={m}", now_rows(x, ws[0], gate_up), ref):
                    row["dot"] = bench.time_calls(
                        [lambda w=w, x=x, g=gate_up: now_rows(x, w, g) for w in ws])
            for cfg in configs:
                try:
                    out = tma_rows(x, ws[0], cfg, gate_up)
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                    log(f"  skip tma {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                    continue
                if not bench.check(f"tma {name} M={m} {cfg}", out, ref):
                    continue
                row["tma"][str(cfg)] = bench.time_calls(
                    [lambda w=w, x=x, c=cfg, g=gate_up: tma_rows(x, w, c, g) for w in ws])
            best = min(row["tma"].items(), key=lambda kv: kv[1]) if row["tma"] else ("-", float("nan"))
            nbytes = n * k * ws[0].element_size()
            base = row.get("one_row", row.get("dot", float("nan")))
            log(f"{name} M={m}: {'one-row' if m == 1 else 'now'} {base:.2f} us "
                f"({nbytes / base / 1e3:.0f} GB/s) | tma best {best[0]} {best[1]:.2f} us "
                f"({nbytes / best[1] / 1e3:.0f} GB/s) ratio {best[1] / base:.3f}")
            log("    every tma config: " + ", ".join(f"{c} {t:.2f}" for c, t in row["tma"].items()))
            rows_out.append(row)
        del ws
        gemv._descriptors.clear()
        if not args.smoke:
            torch.cuda.empty_cache()
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
