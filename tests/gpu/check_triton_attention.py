"""GPU check and timing of the Triton attention backend (a script: pytest does not collect it).

Correctness: the Triton kernels against the torch backend run on fp32 copies of the same caches
(the higher-precision reference), on Llama-3-8B attention shapes (32 query heads, 8 KV heads,
head_dim 128, bf16, 16-token blocks): batch 1/8/32/128 x context 512/2048/8192 x query runs of
1, 2, 5 and 9 tokens with ragged contexts and scattered block tables, mixed query lengths,
prefill chunks over a cached prefix, whole prompts, fp16 and fp32. Pass: relative error
||out - ref|| / ||ref|| <= 1e-2 for bf16/fp16 (METHOD.md), 1e-5 for fp32; the torch backend's
own bf16 error is printed beside it.

Timing (CUDA events via triton.testing.do_bench, median; each measurement replays a CUDA graph
of 32 layers' attention, every layer reading its own blocks so nothing is served from L2):
decode latency at batch 1, the verification cost ratio time(k+1 query tokens) / time(1 token)
for k = 1..8 at batch 1, 8 and 32, and the effective KV bandwidth (K+V bytes read per layer over
the time) against the measured device-to-device copy bandwidth (read + write bytes).

Usage:  python tests/gpu/check_triton_attention.py [--out DIR] [--smoke]
``--smoke`` runs tiny shapes on the CPU under TRITON_INTERPRET=1 (to debug the script itself).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

import triton  # noqa: E402

from specserve.model.layers.attention.metadata import AttentionMetadata  # noqa: E402
from specserve.model.layers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specserve.model.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402

BLOCK = 16
LAYERS = 32
LOG: list[str] = []


def log(line: str = "") -> None:
    print(line, flush=True)
    LOG.append(line)


def make_meta(runs: list[tuple[int, int]], pool_blocks: int, device, gen,
              first_block: int = 0) -> AttentionMetadata:
    """runs: (cached context, query length) per sequence; blocks scattered at random inside
    [first_block, first_block + span) of the pool (so tables are non-contiguous); span is twice
    what the batch needs, or exactly that with first_block given (timing: disjoint layers)."""
    seq_lens = [c + q for c, q in runs]
    nbs = [math.ceil(s / BLOCK) for s in seq_lens]
    need = sum(nbs)
    span = need if first_block else 2 * need
    assert first_block + span <= pool_blocks, "pool too small"
    ids = (torch.randperm(span, generator=gen)[:need] + first_block).tolist()
    tables, slots, used = [], [], 0
    for (c, q), nb in zip(runs, nbs, strict=True):
        t = ids[used:used + nb]
        used += nb
        tables.append(t + [0] * (max(nbs) - nb))
        slots.extend(t[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + q))
    starts = [0]
    for _, q in runs:
        starts.append(starts[-1] + q)

    def tensor(x, dtype):
        return torch.tensor(x, dtype=dtype).to(device)

    return AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64), block_tables=tensor(tables, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32), query_start_loc=tensor(starts, torch.int32),
        query_lens=[q for _, q in runs], seq_lens_host=seq_lens,
        max_query_len=max(q for _, q in runs), max_seq_len=max(seq_lens), block_size=BLOCK)


def fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(**{**meta.__dict__, "backend_state": {}})


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


class Bench:
    def __init__(self, args) -> None:
        self.dev = torch.device("cpu" if args.smoke else "cuda")
        self.smoke = args.smoke
        self.h, self.kvh, self.d = (8, 2, 64) if args.smoke else (32, 8, 128)
        self.gen = torch.Generator().manual_seed(0)
        self.pool = 1024 if args.smoke else 140_000
        shape = (self.pool, BLOCK, self.kvh, self.d)
        # Random caches (never zeros: zeros hide unwritten outputs and run faster).
        self.k = torch.randn(shape, device=self.dev, dtype=torch.bfloat16)
        self.v = torch.randn(shape, device=self.dev, dtype=torch.bfloat16)
        self.scale = self.d ** -0.5
        self.failures: list[str] = []
        self.results: dict = {"correctness": [], "timing": []}

    # ---- correctness -------------------------------------------------------------------------
    def check(self, label: str, runs, dtype=torch.bfloat16, **backend_kw) -> None:
        try:
            self._check(label, runs, dtype, **backend_kw)
        except Exception as exc:  # log and go on: one broken case must not hide the others
            log(f"{label:<44} ERROR {type(exc).__name__}: {exc}"[:300])
            self.failures.append(label)

    def _check(self, label: str, runs, dtype, **backend_kw) -> None:
        meta = make_meta(runs, self.pool, self.dev, self.gen)
        nb = int(meta.block_tables.max()) + 1
        k, v = self.k[:nb], self.v[:nb]
        if dtype != torch.bfloat16:
            k, v = k.to(dtype), v.to(dtype)
        q = torch.randn(meta.num_tokens, self.h, self.d, device=self.dev).to(dtype)
        ref_meta = fresh(meta)
        torch_ref = TorchAttentionBackend()
        torch_ref.prepare(ref_meta)
        ref = torch_ref.forward(q.float(), k.float(), v.float(), ref_meta, self.scale)
        tb_meta = fresh(meta)
        torch_ref.prepare(tb_meta)
        torch_same = torch_ref.forward(q, k, v, tb_meta, self.scale)
        tri = TritonAttentionBackend(**backend_kw)
        tri_meta = fresh(meta)
        tri.prepare(tri_meta)
        out = tri.forward(q, k, v, tri_meta, self.scale)
        err, err_torch = rel_err(out, ref), rel_err(torch_same, ref)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        ok = err <= tol  # NaN fails
        shape = tri_meta.backend_state["triton"].shapes.get((self.h, self.kvh))
        plan = f"rows={shape.block_r} tiles={shape.q_tiles} splits={shape.num_splits}" \
            if shape else "sdpa"
        log(f"{label:<44} {str(dtype)[6:]:>8} {err:10.2e} {err_torch:10.2e}  {plan:<28}"
            f" {'ok' if ok else 'FAIL'}")
        self.results["correctness"].append(dict(label=label, dtype=str(dtype), err=err,
                                                err_torch=err_torch, plan=plan, ok=ok))
        if not ok:
            self.failures.append(label)

    def check_write_kv(self) -> None:
        runs = [(100, 9)] * 4
        meta = make_meta(runs, self.pool, self.dev, self.gen)
        nb = int(meta.block_tables.max()) + 1
        key = torch.randn(meta.num_tokens, self.kvh, self.d, device=self.dev).bfloat16()
        val = torch.randn_like(key)
        ka, va = self.k[:nb].clone(), self.v[:nb].clone()
        kb, vb = ka.clone(), va.clone()
        TritonAttentionBackend().write_kv(key, val, ka, va, meta)
        TorchAttentionBackend().write_kv(key, val, kb, vb, meta)
        ok = torch.equal(ka, kb) and torch.equal(va, vb)
        log(f"{'write_kv 4 x 9 tokens':<44} {'bfloat16':>8} {'exact' if ok else 'DIFFERS':>10}")
        if not ok:
            self.failures.append("write_kv")

    def correctness(self) -> None:
        log(f"{'case':<44} {'dtype':>8} {'rel err':>10} {'torch err':>10}  plan")
        rand = torch.Generator().manual_seed(1)

        def ragged(b, ctx, q):
            lens = torch.randint(ctx // 2, ctx + 1, (b,), generator=rand).tolist()
            lens[0] = ctx
            return [(c - q, q) for c in lens]

        self.check_write_kv()
        batches = (1, 3) if self.smoke else (1, 8, 32, 128)
        contexts = (40, 100) if self.smoke else (512, 2048, 8192)
        for b in batches:
            for ctx in contexts:
                for q in (1, 2, 5, 9):
                    self.check(f"B={b} ctx<={ctx} q={q}", ragged(b, ctx, q))
        mixed_ctx = 100 if self.smoke else 2048
        mixed = [(c, q) for (c, _), q in zip(ragged(32, mixed_ctx, 9),
                                             torch.randint(1, 10, (32,), generator=rand).tolist(),
                                             strict=True)]
        self.check(f"B=32 ctx<={mixed_ctx} q=1..9 mixed", mixed)
        chunk = (30, 20) if self.smoke else (3072, 1024)
        self.check(f"prefill chunk {chunk[1]} over {chunk[0]}", [chunk])
        self.check("chunk + decodes + verify", [chunk, (mixed_ctx, 1), (mixed_ctx // 2, 5)])
        prompt = 50 if self.smoke else 2048
        self.check(f"whole prompt {prompt} (sdpa)", [(0, prompt)])
        self.check(f"whole prompt {prompt} (triton)", [(0, prompt)], sdpa_prefill=False)
        self.check(f"two prompts {prompt}, {prompt // 3}", [(0, prompt), (0, prompt // 3)])
        self.check(f"B=8 ctx<={mixed_ctx} q=5 fp16", ragged(8, mixed_ctx, 5), torch.float16)
        self.check(f"B=8 ctx<={mixed_ctx} q=5 fp32", ragged(8, mixed_ctx, 5), torch.float32)

    # ---- timing ------------------------------------------------------------------------------
    def copy_bandwidth(self) -> float:
        n = 1 << 30  # bytes
        a = torch.randn(n // 2, device=self.dev, dtype=torch.bfloat16)
        b = torch.empty_like(a)
        ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
        return 2 * n / (ms * 1e-3)

    def time_layers(self, backend, b: int, ctx: int, q: int, rep: int = 150
                    ) -> tuple[float, str]:
        """Median ms per layer of a graph of LAYERS attention forwards, each layer reading its
        own blocks; every sequence has context `ctx` after this step."""
        per_layer = b * math.ceil(ctx / BLOCK)
        metas = []
        for layer in range(LAYERS):
            metas.append(make_meta([(ctx - q, q)] * b, self.pool, self.dev, self.gen,
                                   first_block=1 + layer * per_layer))
        qt = torch.randn(b * q, self.h, self.d, device=self.dev, dtype=torch.bfloat16)
        for m in metas:
            backend.prepare(m)

        def step():
            for m in metas:
                backend.forward(qt, self.k, self.v, m, self.scale)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compile + allocate scratch outside the capture
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        ms = triton.testing.do_bench(graph.replay, warmup=min(25, rep), rep=rep,
                                     return_mode="median")
        state = metas[0].backend_state.get("triton")
        plan = ""
        if state is not None:
            s = state.shapes[(self.h, self.kvh)]
            plan = (f"rows={s.block_r} splits={s.num_splits} n={s.block_n} w={s.num_warps}"
                    f" st={s.num_stages}")
        return ms / LAYERS, plan

    def _t(self, backend, b, ctx, q) -> float:
        try:
            return self.time_layers(backend, b, ctx, q, rep=60)[0]
        except Exception as exc:  # e.g. out of shared memory for one config
            log(f"  B={b} q={q}: {type(exc).__name__}: {exc}"[:160])
            return float("inf")

    def tune(self) -> dict:
        """Time (BLOCK_N, num_warps, num_stages) per tile size, then the split knobs; return
        the best backend keyword arguments."""
        combos = [(64, 4, 2), (64, 8, 2), (64, 4, 3), (64, 8, 3), (32, 4, 2), (32, 4, 3),
                  (128, 8, 2), (128, 4, 3)]
        log("\ntuning at context 2048 (per layer us; rows 16/32/64 = k 0/4/8 with group 4)")
        log(f"{'BN,w,st':>10} " + " ".join(f"{f'B{b} r{r}':>9}" for r in (16, 32, 64)
                                           for b in (1, 8, 32)) + f" {'T2048 r128':>11}")
        scores: dict[int, dict] = {16: {}, 32: {}, 64: {}, 128: {}}
        prompt = make_meta([(0, 2048)], self.pool, self.dev, self.gen)
        q_prompt = torch.randn(2048, self.h, self.d, device=self.dev, dtype=torch.bfloat16)
        for combo in combos:
            cfg = {r: combo for r in (16, 32, 64, 128)}
            row = []
            for rows, k in ((16, 0), (32, 4), (64, 8)):
                times = [self._t(TritonAttentionBackend(tile_config=cfg), b, 2048, k + 1)
                         for b in (1, 8, 32)]
                row += [f"{t * 1e3:9.1f}" for t in times]
                scores[rows][combo] = times
                if math.isfinite(sum(times)):
                    self.check(f"tune {combo} B=8 q={k + 1}", [(2000, k + 1)] * 8,
                               tile_config=cfg)
            try:
                be = TritonAttentionBackend(tile_config=cfg, sdpa_prefill=False)
                m = fresh(prompt)
                be.prepare(m)
                ms = triton.testing.do_bench(
                    lambda be=be, m=m: be.forward(q_prompt, self.k, self.v, m, self.scale),
                    warmup=10, rep=60, return_mode="median")
            except Exception as exc:
                log(f"  prefill: {type(exc).__name__}: {exc}"[:160])
                ms = float("inf")
            scores[128][combo] = [ms]
            log(f"{','.join(map(str, combo)):>10} " + " ".join(row) + f" {ms * 1e3:11.1f}")

        def geo(times, base):  # geometric mean of time relative to a baseline
            return math.prod(t / b for t, b in zip(times, base, strict=True)) ** (1 / len(base))

        def fastest(columns: dict) -> list[float]:  # per column, the best time of any option
            return [min(col) for col in zip(*columns.values(), strict=True)]

        best = {}
        for rows, per_combo in scores.items():
            base = fastest(per_combo)
            best[rows] = min(per_combo, key=lambda c, pc=per_combo, b=base: geo(pc[c], b))
            log(f"rows {rows}: best {best[rows]}: {geo(per_combo[best[rows]], base):.3f} x the "
                f"per-column best; default (64, 4, 2): {geo(per_combo[combos[0]], base):.3f}")
        kw: dict = {"tile_config": best}
        log("\nsplit knobs (per layer us, context 2048, best tile config)")
        mk_times = {}
        for mk in (128, 256, 512):
            mk_times[mk] = [self._t(TritonAttentionBackend(tile_config=best,
                                                           min_keys_per_split=mk), 1, 2048, q)
                            for q in (1, 5, 9)]
            log(f"  B=1 min_keys_per_split={mk}: q=1/5/9 -> "
                + " ".join(f"{t * 1e3:7.1f}" for t in mk_times[mk]))
        kw["min_keys_per_split"] = min(mk_times, key=lambda k: sum(mk_times[k]))
        sm_times = {}
        for sms in (132, 264, 528):  # programs aimed at = 2 x this
            sm_times[sms] = [self._t(TritonAttentionBackend(num_sms=sms, **kw), b, 2048, q)
                             for b in (8, 32) for q in (1, 5, 9)]
            log(f"  target programs {2 * sms}: B=8,32 x q=1/5/9 -> "
                + " ".join(f"{t * 1e3:7.1f}" for t in sm_times[sms]))
        sm_base = fastest(sm_times)
        best_sms = min(sm_times, key=lambda k: geo(sm_times[k], sm_base))
        kw["num_sms"] = best_sms
        log(f"CHOSEN: {kw}")
        self.results["chosen"] = repr(kw)
        return kw

    def timing(self, backend_kw: dict | None = None) -> None:
        copy_bw = self.copy_bandwidth()
        log(f"\ncopy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s")
        self.results["copy_bw"] = copy_bw
        tri = TritonAttentionBackend(**(backend_kw or {}))
        kv_bytes = 2 * self.kvh * self.d * 2  # K + V bytes per context token per layer

        log("\ndecode at batch 1 (per layer; x32 for a Llama-3-8B step)")
        log(f"{'ctx':>6} {'triton us':>10} {'KV GB/s':>9} {'% copy':>7}  plan")
        for ctx in (512, 2048, 8192):
            t, plan = self.time_layers(tri, 1, ctx, 1)
            bw = ctx * kv_bytes / (t * 1e-3)
            log(f"{ctx:>6} {t * 1e3:10.1f} {bw / 1e9:9.0f} {100 * bw / copy_bw:6.0f}%  {plan}")
            self.results["timing"].append(dict(kind="decode", b=1, ctx=ctx, us=t * 1e3,
                                               plan=plan))

        for ctx in (2048, 8192):
            batches = (1, 8, 32) if ctx == 2048 else (1,)
            log(f"\nverification cost at context {ctx}: time(k+1 tokens) / time(1 token), "
                "per layer")
            log(f"{'B':>4} {'k':>3} {'us':>8} {'ratio':>6} {'KV GB/s':>9} {'% copy':>7}  plan")
            for b in batches:
                base = None
                for k in range(0, 9):
                    t, plan = self.time_layers(tri, b, ctx, k + 1)
                    base = base or t
                    bw = b * ctx * kv_bytes / (t * 1e-3)
                    log(f"{b:>4} {k:>3} {t * 1e3:8.1f} {t / base:6.3f} {bw / 1e9:9.0f}"
                        f" {100 * bw / copy_bw:6.0f}%  {plan}")
                    self.results["timing"].append(dict(kind="verify", b=b, ctx=ctx, k=k,
                                                       us=t * 1e3, ratio=t / base, plan=plan))

        log("\nprefill, one whole prompt (one layer, eager)")
        for n in (2048, 8192):
            meta = make_meta([(0, n)], self.pool, self.dev, self.gen)
            qt = torch.randn(n, self.h, self.d, device=self.dev, dtype=torch.bfloat16)
            row = []
            for name, be in (("sdpa", TritonAttentionBackend()),
                             ("triton", TritonAttentionBackend(sdpa_prefill=False)),
                             ("torch", TorchAttentionBackend())):
                m = fresh(meta)
                be.prepare(m)
                ms = triton.testing.do_bench(
                    lambda be=be, m=m, qt=qt: be.forward(qt, self.k, self.v, m, self.scale),
                    warmup=25, rep=100, return_mode="median")
                row.append(f"{name} {ms * 1e3:8.1f} us")
            log(f"  T={n}: " + " | ".join(row))

        # Last: the reference backend need not be graph-capturable, and a failed capture can
        # leave the CUDA context unusable for whatever would come after it.
        log("\ntorch backend, same graphs (per layer)")
        for b, ctx, q in ((1, 2048, 1), (1, 8192, 1), (1, 2048, 9), (32, 2048, 1)):
            try:
                t = self.time_layers(TorchAttentionBackend(), b, ctx, q)[0]
                log(f"  B={b} ctx={ctx} q={q}: {t * 1e3:8.1f} us")
            except Exception as exc:
                log(f"  B={b} ctx={ctx} q={q}: failed {type(exc).__name__}: {exc}"[:200])
                break


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--tune", action="store_true",
                        help="sweep tile configs, then time with the best (skips the matrix)")
    args = parser.parse_args()
    t0 = time.time()
    bench = Bench(args)
    if not args.smoke:
        p = torch.cuda.get_device_properties(0)
        log(f"{p.name}, {p.multi_processor_count} SMs; torch {torch.__version__}, "
            f"triton {triton.__version__}")
    if not args.tune:
        bench.correctness()
    if not (args.smoke or args.skip_timing):
        try:
            bench.timing(bench.tune() if args.tune else None)
        except Exception as exc:
            log(f"timing stopped: {type(exc).__name__}: {exc}")
            bench.failures.append("timing")
    log(f"\n{'FAILED: ' + ', '.join(bench.failures) if bench.failures else 'all checks passed'}"
        f" ({time.time() - t0:.0f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_triton_attention.log").write_text("\n".join(LOG) + "\n")
    (out / "check_triton_attention.json").write_text(json.dumps(bench.results, indent=1))
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
