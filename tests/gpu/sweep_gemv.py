"""GPU check, config sweep and timing of the multi-row GEMV (layers/gemv.py) against cuBLAS
(a script: pytest does not collect it).

1. Correctness: every swept config on every shape at its bucket's largest M, the winners at
   every M = 1..16, uneven shapes (masking) with a bias, and a CUDA-graph replay, all against a
   float32 reference of the same bf16 inputs. Pass: max |out - ref| / max |ref| <= 1e-2 and
   ||out - ref|| / ||ref|| <= 1e-2 (bf16 output rounding is ~4e-3), no NaN, every element
   written (outputs are poisoned first for the graph check).
2. Sweep: per weight shape (N, K) and row bucket (2, 4, 8, 16: the BLOCK_M a kernel compiles
   for), a modest set of "fma" and "dot" configs, timed at the bucket's largest M.
3. Table: per shape and M in 1..9 and 16, the bucket's best config against
   torch.nn.functional.linear (cuBLAS), and at M = 1 the tuned one-row kernel too.

Timing: each number replays a CUDA graph of calls that cycle through enough weight copies
(>= COPY_BYTES together, several times the 60 MB L2) that every call streams its weight from
HBM, as a model's layers do; the median of REPLAYS replays over the calls per replay. Inputs are
random (never zeros).

Usage:  python tests/gpu/sweep_gemv.py [--out DIR] [--smoke] [--table-only] [--pdl] [--shapes 8B]
``--table-only`` skips 1-2 and times triton_ops.linear with the configs in the code.
``--smoke`` runs two tiny shapes on the CPU under TRITON_INTERPRET=1 (debugs the script only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from specserve.model.layers import gemv, pdl, triton_ops  # noqa: E402
from specserve.model.layers.gemv import RowsConfig  # noqa: E402

SHAPES = {  # (N, K): name
    (6144, 4096): "8B qkv", (4096, 4096): "8B o", (28672, 4096): "8B gate_up",
    (4096, 14336): "8B down", (128256, 4096): "8B lm_head",
    (3072, 2048): "1B qkv", (2048, 2048): "1B o", (16384, 2048): "1B gate_up",
    (2048, 8192): "1B down", (128256, 2048): "1B lm_head",
}
LAYER_SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
LM_HEAD_8B = (128256, 4096)
BUCKETS = [2, 4, 8, 16]
TABLE_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
COPY_BYTES = 512 << 20
REPLAYS = 7
MAX_FMA_ACC_REGS = 64  # fp32 accumulator registers per thread above which an fma config spills

FMA_CONFIGS = [RowsConfig("fma", bn, bk, w, s) for bn, bk, w, s in [
    (2, 2048, 8, 3), (2, 1024, 4, 3), (2, 1024, 4, 4), (2, 1024, 8, 3), (4, 512, 4, 3),
    (2, 512, 4, 1), (4, 1024, 8, 2)]]
DOT_CONFIGS = [RowsConfig("dot", bn, bk, w, s) for bn, bk, w, s in [
    (16, 256, 4, 4), (16, 512, 4, 4), (16, 256, 4, 8), (16, 512, 4, 6), (32, 256, 4, 4),
    (32, 256, 4, 6), (32, 128, 4, 6), (32, 128, 4, 8), (32, 256, 8, 6), (32, 512, 4, 4),
    (64, 128, 4, 5), (64, 128, 4, 7), (64, 256, 4, 4), (64, 256, 4, 5), (64, 128, 8, 6),
    (128, 128, 4, 4), (128, 128, 8, 5), (128, 64, 4, 8), (128, 256, 8, 3)]]
DISPATCH_MARGIN = 0.99  # a bucket goes to the kernel only if it beats cuBLAS by 1% at every M

LOG: list[str] = []
LOG_FILE: list[Path] = []  # --out DIR/sweep_gemv.log, appended line by line (survives a kill)


def log(line: str = "") -> None:
    print(line, flush=True)
    LOG.append(line)
    for path in LOG_FILE:
        with path.open("a") as f:
            f.write(line + "\n")


def configs_for(bucket: int) -> list[RowsConfig]:
    fma = [c for c in FMA_CONFIGS
           if bucket * c.block_n * c.block_k / (32 * c.num_warps) <= MAX_FMA_ACC_REGS]
    return fma + DOT_CONFIGS


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref| / max |ref|, ||out - ref|| / ||ref||); inf on NaN."""
    diff = out.float() - ref
    if not torch.isfinite(out).all():
        return math.inf, math.inf
    return ((diff.abs().max() / ref.abs().max()).item(),
            (diff.norm() / ref.norm()).item())


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.smoke = args.smoke
        # --pdl: timing graphs captured as the engine captures its own (layers/pdl.py), so that
        # consecutive calls overlap as a model's kernels do
        self.launches = pdl.graph_launches if args.pdl else contextlib.nullcontext
        self.device = "cpu" if args.smoke else "cuda"
        self.dtype = torch.float32 if args.smoke else torch.bfloat16
        self.gen = torch.Generator(device=self.device).manual_seed(0)
        self.failures: list[str] = []
        self.results: dict = {"sweep": [], "table": [], "winners": {}}

    def randn(self, *shape, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen, device=self.device) * scale).to(self.dtype)

    def check(self, label: str, out: torch.Tensor, ref: torch.Tensor) -> bool:
        rel_max, rel_norm = errors(out, ref)
        ok = rel_max <= 1e-2 and rel_norm <= 1e-2
        if not ok:
            self.failures.append(f"{label}: rel max {rel_max:.2e} rel norm {rel_norm:.2e}")
            log(f"FAIL {label}: rel max {rel_max:.2e} rel norm {rel_norm:.2e}")
        return ok

    def time_calls(self, calls) -> float:
        """Median microseconds per call of the list of zero-argument calls (one graph)."""
        if self.smoke:
            start = time.perf_counter()
            for call in calls:
                call()
            return (time.perf_counter() - start) / len(calls) * 1e6
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with self.launches():
            with torch.cuda.stream(stream):
                for call in calls[:2]:  # compile / warm outside the capture
                    call()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for call in calls:
                    call()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(REPLAYS):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e3 / len(calls))
        del graph
        return statistics.median(times)

    def weights(self, n: int, k: int) -> list[torch.Tensor]:
        """Enough copies of a random [N, K] weight that a pass over them misses L2."""
        nbytes = n * k * (2 if self.dtype != torch.float32 else 4)
        copies = 2 if self.smoke else max(2, math.ceil(COPY_BYTES / nbytes))
        return [self.randn(n, k, scale=0.02) for _ in range(copies)]

    def sweep_shape(self, n: int, k: int, ws: list[torch.Tensor]) -> dict[int, RowsConfig]:
        """Best config per bucket at the bucket's largest M (correct ones only)."""
        winners = {}
        ref_w = ws[0].float()
        for bucket in BUCKETS:
            x = self.randn(bucket, k)
            ref = x.float() @ ref_w.T  # [M, N]
            best = None
            for cfg in configs_for(bucket):
                try:
                    out = gemv.gemv_rows(x, ws[0], None, cfg)
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                    log(f"  skip {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    continue
                if not self.check(f"sweep {n}x{k} M={bucket} {cfg}", out, ref):
                    continue
                us = self.time_calls([lambda w=w, x=x, c=cfg: gemv.gemv_rows(x, w, None, c)
                                      for w in ws])
                self.results["sweep"].append(dict(n=n, k=k, m=bucket, cfg=list(cfg), us=us))
                if best is None or us < best[0]:
                    best = (us, cfg)
            winners[bucket] = best[1]
            log(f"  {n}x{k} bucket {bucket}: best {tuple(best[1])} {best[0]:.2f} us")
        return winners

    def table_shape(self, n: int, k: int, ws: list[torch.Tensor],
                    winners: dict[int, RowsConfig]) -> None:
        nbytes = n * k * ws[0].element_size()
        ref_w = ws[0].float()
        every_m = TABLE_ROWS if self.smoke else range(1, gemv.MAX_ROWS + 1)
        for m in every_m:  # correctness of the winners at every M
            x = self.randn(m, k)
            cfg = winners[max(2, gemv.row_bucket(m))]
            self.check(f"winner {n}x{k} M={m} {tuple(cfg)}", gemv.gemv_rows(x, ws[0], None, cfg),
                       x.float() @ ref_w.T)
        for m in TABLE_ROWS:
            x = self.randn(m, k)
            cfg = winners[max(2, gemv.row_bucket(m))]
            ours = self.time_calls([lambda w=w, x=x, c=cfg: gemv.gemv_rows(x, w, None, c)
                                    for w in ws])
            cublas = self.time_calls([lambda w=w, x=x: torch.nn.functional.linear(x, w)
                                      for w in ws])
            again = self.time_calls([lambda w=w, x=x, c=cfg: gemv.gemv_rows(x, w, None, c)
                                     for w in ws])  # the same timing twice: the noise
            row = dict(n=n, k=k, m=m, cfg=list(cfg), us=ours, us_again=again, cublas_us=cublas)
            one_row = triton_ops.GEMV_CONFIGS.get((n, k))
            if m == 1 and one_row is not None:
                row["one_row_us"] = self.time_calls(
                    [lambda w=w, x=x, c=one_row: triton_ops.gemv(x, w, None, c) for w in ws])
            row["gbps"] = nbytes / (ours * 1e-6) / 1e9
            self.results["table"].append(row)

    def uneven(self) -> None:
        """Masking (rows and columns off the blocks) with a bias, and graph replay."""
        uneven = [(37, 50)] if self.smoke else [(1000, 1000), (4099, 4160), (77, 3000)]
        for n, k in uneven:
            w = self.randn(n, k, scale=0.02)
            b = self.randn(n)
            for cfg in [FMA_CONFIGS[0], FMA_CONFIGS[5], DOT_CONFIGS[0], DOT_CONFIGS[9],
                        DOT_CONFIGS[10]]:
                for m in [1, 2, 3, 7, 9, 16]:
                    if (cfg.variant == "fma" and gemv.row_bucket(m) * cfg.block_n * cfg.block_k
                            / (32 * cfg.num_warps) > MAX_FMA_ACC_REGS):
                        continue
                    x = self.randn(m, k)
                    self.check(f"uneven {n}x{k} M={m} {tuple(cfg)} bias",
                               gemv.gemv_rows(x, w, b, cfg), x.float() @ w.float().T + b.float())
        if self.smoke:
            return
        n, k, m = 4096, 4096, 7
        w, b = self.randn(n, k, scale=0.02), self.randn(n)
        for cfg in [DOT_CONFIGS[0], DOT_CONFIGS[10]]:
            x = self.randn(m, k)
            gemv.gemv_rows(x, w, b, cfg)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = gemv.gemv_rows(x, w, b, cfg)
            for replay in range(3):
                out.fill_(float("nan"))  # poison: the replay must write every element
                x.copy_(self.randn(m, k))
                graph.replay()
                torch.cuda.synchronize()
                self.check(f"graph replay {replay} 4096x4096 M=7 bias {tuple(cfg)}", out,
                           x.float() @ w.float().T + b.float())

    def dispatch_configs(self) -> dict[tuple[int, int, int], RowsConfig]:
        """ROWS_CONFIGS as the sweep says: a (shape, bucket) winner that beat cuBLAS by
        DISPATCH_MARGIN at every table M of its bucket (M = 1 belongs to the one-row kernel)."""
        chosen = {}
        for key, per_bucket in self.results["winners"].items():
            n, k = map(int, key.split(","))
            for bucket, cfg in per_bucket.items():
                rows = [r for r in self.results["table"] if (r["n"], r["k"]) == (n, k)
                        and r["m"] > 1 and max(2, gemv.row_bucket(r["m"])) == bucket]
                if rows and all(r["us"] <= DISPATCH_MARGIN * r["cublas_us"] for r in rows):
                    chosen[(n, k, bucket)] = RowsConfig(*cfg)
        return chosen

    def dispatch_pass(self, shapes) -> None:
        """Time triton_ops.linear itself (an nn.Linear per weight copy) with ROWS_CONFIGS set
        from this sweep: what a model step gets (one-row kernel at M = 1, cuBLAS where no
        config), and a check that the dispatch reaches the kernels under graph capture."""
        chosen = self.dispatch_configs()
        gemv.ROWS_CONFIGS.clear()
        gemv.ROWS_CONFIGS.update(chosen)
        for (n, k) in shapes:
            layers = []
            for w in self.weights(n, k):
                layer = torch.nn.Linear(k, n, bias=False, device="meta")
                layer.weight = torch.nn.Parameter(w, requires_grad=False)
                layers.append(layer)
            for r in self.results["table"]:
                if (r["n"], r["k"]) != (n, k):
                    continue
                x = self.randn(r["m"], k)
                r["linear_us"] = self.time_calls(
                    [lambda layer=layer, x=x: triton_ops.linear(layer, x) for layer in layers])
                self.check(f"linear {n}x{k} M={r['m']}", triton_ops.linear(layers[0], x),
                           x.float() @ layers[0].weight.float().T)  # after: see table_only
            del layers
        log()
        log("ROWS_CONFIGS = {  # (N, K, bucket): config")
        for (n, k, b), c in chosen.items():
            log(f"    ({n}, {k}, {b}): RowsConfig{tuple(c)},")
        log("}")

    def table_only(self, shapes) -> None:
        """--table-only: no sweep; triton_ops.linear with the configs in the code (ROWS_CONFIGS,
        GEMV_CONFIGS) against cuBLAS, each timed twice (linear, cuBLAS, linear again)."""
        for (n, k) in shapes:
            ws = self.weights(n, k)
            layers = []
            for w in ws:
                layer = torch.nn.Linear(k, n, bias=False, device="meta")
                layer.weight = torch.nn.Parameter(w, requires_grad=False)
                layers.append(layer)
            for m in TABLE_ROWS:
                x = self.randn(m, k)
                calls = [lambda layer=layer, x=x: triton_ops.linear(layer, x) for layer in layers]
                lin = self.time_calls(calls)
                cublas = self.time_calls([lambda w=w, x=x: torch.nn.functional.linear(x, w)
                                          for w in ws])
                again = self.time_calls(calls)
                # checked after the timings: a lm_head timed right after its float32 reference
                # ran ~12% slow on the H200 (any kernel, the unchanged one-row one too)
                self.check(f"linear {n}x{k} M={m}", triton_ops.linear(layers[0], x),
                           x.float() @ ws[0].float().T)
                cfg = gemv.ROWS_CONFIGS.get((n, k, gemv.row_bucket(m)))
                label = ("one-row " + str(triton_ops.GEMV_CONFIGS.get((n, k))) if m == 1
                         else str(tuple(cfg)) if cfg is not None else "cuBLAS")
                row = dict(n=n, k=k, m=m, cfg=label, us=lin, us_again=again, cublas_us=cublas,
                           linear_us=lin, gbps=n * k * ws[0].element_size() / (lin * 1e-6) / 1e9)
                self.results["table"].append(row)
            del ws, layers
            if not self.smoke:
                torch.cuda.empty_cache()

    def run(self) -> None:
        shapes = {(48, 64): "smoke a", (51, 70): "smoke b"} if self.smoke else SHAPES
        if self.args.shapes:  # e.g. "8B": only the shapes whose name contains it
            shapes = {s: name for s, name in shapes.items() if self.args.shapes in name}
        if self.smoke:
            global FMA_CONFIGS, DOT_CONFIGS, BUCKETS, TABLE_ROWS
            FMA_CONFIGS = [RowsConfig("fma", 2, 32, 4, 1)] * 6
            DOT_CONFIGS = [RowsConfig("dot", 16, 32, 4, 1)] * 10
            BUCKETS, TABLE_ROWS = [2, 16], [1, 2, 9]
        start = time.time()
        if self.args.table_only:
            self.table_only(shapes)
            log(f"table done ({time.time() - start:.0f} s)")
            self.report(shapes)
            return
        self.uneven()
        log(f"uneven/graph checks done ({time.time() - start:.0f} s), "
            f"{len(self.failures)} failures")
        for (n, k), name in shapes.items():
            ws = self.weights(n, k)
            winners = self.sweep_shape(n, k, ws)
            self.results["winners"][f"{n},{k}"] = {b: list(c) for b, c in winners.items()}
            self.table_shape(n, k, ws, winners)
            del ws
            if not self.smoke:
                torch.cuda.empty_cache()
            log(f"{name} done ({time.time() - start:.0f} s)")
        self.dispatch_pass(shapes)
        log(f"dispatch pass done ({time.time() - start:.0f} s)")
        self.report(shapes)

    def report(self, shapes) -> None:
        log()
        log("| shape | M | best config (variant, BN, BK, warps, stages) | us | us again | GB/s | "
            "cuBLAS us | speedup | one-row us | linear() us |")
        log("|---|---|---|---|---|---|---|---|---|---|")
        for r in self.results["table"]:
            name = shapes[(r["n"], r["k"])]
            one = f"{r['one_row_us']:.2f}" if "one_row_us" in r else ""
            cfg = r["cfg"] if isinstance(r["cfg"], str) else str(tuple(r["cfg"]))
            log(f"| {name} {r['n']}x{r['k']} | {r['m']} | {cfg} | {r['us']:.2f} | "
                f"{r['us_again']:.2f} | {r['gbps']:.0f} | {r['cublas_us']:.2f} | "
                f"{r['cublas_us'] / r['us']:.3f} | {one} | {r.get('linear_us', math.nan):.2f} |")
        if not self.smoke and all(s in shapes for s in [*LAYER_SHAPES_8B, LM_HEAD_8B]):
            # 32 layers' projections + the lm_head, the model's linear time
            log()
            log("Llama-3-8B linear time per step (32 x [qkv, o, gate_up, down] + lm_head on M rows),"
                " ms: linear() (the dispatch), rows kernel alone, cuBLAS alone; in brackets the"
                " increase over linear() at M = 1")
            by = {(r["n"], r["k"], r["m"]): r for r in self.results["table"]}

            def step(m: int, field: str) -> float:
                return (sum(32 * by[(*s, m)][field] for s in LAYER_SHAPES_8B)
                        + by[(*LM_HEAD_8B, m)][field]) / 1e3

            one = step(1, "linear_us")
            second, field = (("linear() again", "us_again") if self.args.table_only
                             else ("rows kernel", "us"))
            for m in TABLE_ROWS:
                lin, rows, cub = step(m, "linear_us"), step(m, field), step(m, "cublas_us")
                log(f"  M={m:2d}: linear() {lin:.3f} (+{lin - one:.3f}), {second} {rows:.3f} "
                    f"(+{rows - one:.3f}), cuBLAS {cub:.3f} (+{cub - one:.3f})")
        log()
        log("winners: " + json.dumps(self.results["winners"]))
        log(f"{len(self.failures)} correctness failures" + ("" if not self.failures else ": "
                                                             + "; ".join(self.failures[:20])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--table-only", action="store_true",
                        help="no sweep: time linear() with the code's configs against cuBLAS")
    parser.add_argument("--shapes", default="",
                        help='only the shapes whose name contains this, e.g. "8B"')
    parser.add_argument("--pdl", action="store_true",
                        help="capture the timing graphs with programmatic dependent launch, as "
                             "the engine's graphs are (Hopper+)")
    args = parser.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        LOG_FILE.append(args.out / "sweep_gemv.log")
        LOG_FILE[0].write_text("")
    if not args.smoke:
        log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bench = Bench(args)
    try:
        bench.run()
    finally:
        if args.out is not None:
            (args.out / "sweep_gemv.json").write_text(json.dumps(bench.results, indent=1))
    sys.exit(1 if bench.failures else 0)


if __name__ == "__main__":
    main()
