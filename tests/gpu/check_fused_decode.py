"""GPU check and A/B timing of the fused decode kernels (issue 6; a script, not collected by pytest).

  PYTHONPATH=$PWD python3 tests/gpu/check_fused_decode.py [--out DIR]     # about 2-3 minutes

On the device, in one process:

  1. kernels (bf16, Llama-3-8B shapes): the Triton backend's rotate_and_write_kv fused vs
     unfused (rotary kernel, then write_kv), padded slots included, and fused_mlp.gate_up_silu
     vs gemv then silu_mul: bit-equality and relative error against float64; then the
     gate_up_silu tile configs timed against gemv + silu_mul (CUDA graphs of 16 calls).
  2. model: a random Llama-3-8B-config model built with specserve's classes in bf16, and a
     float32 copy of the same weights as reference. A 384-token prompt then 8 teacher-forced
     decode steps (graph replays) for each variant (VARIANTS: all off; rotary + KV write;
     and gate_up + silu; and the Triton argmax; and programmatic dependent launch): logits
     bit-equal between variants? relative error vs float32; 32 greedy tokens (the argmax
     graph) equal?
  3. timing: GPU time of the batch-1 greedy decode graph (logits and argmax inside; the
     graphs are sized for max_model_len 1024 as in bench_gpu_spec) at context 384, the
     variants alternately (twice), then per-kernel GPU time per step from torch.profiler.
  4. verification (everything on): the multi-row gate_up + silu kernel off and on
     (fused_mlp.ROWS_ENABLED): 9-token verify logits bit-equal? verify graph GPU time at
     q = 2..9 over q = 1, and the per-kernel profile of q = 1, 2, 9.

The switches are fused_mlp.ENABLED, fused_argmax.ENABLED, pdl.ENABLED and the attention
backend's fused_rotary_kv; graphs are recaptured after each flip.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

sys.path.append(str(REPO / "benchmarks"))
from bench_gpu_spec import cuda_time  # noqa: E402  (median CUDA-event time, as the benchmark)

from specserve.model.layers import fused_argmax, fused_mlp, gemv, pdl, triton_ops  # noqa: E402
from specserve.model.layers.attention import triton_backend  # noqa: E402
from specserve.model.layers.attention.metadata import AttentionMetadata  # noqa: E402
from specserve.model.layers.rotary import RotaryEmbedding  # noqa: E402
from specserve.model.registry import model_class_for  # noqa: E402
from specserve.outputs import agreeing_prefix  # noqa: E402
from specserve.worker.model_runner import ModelRunner, SequenceRun  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
BLOCK = 16
CTX = 384
MAX_MODEL_LEN = 1024
DECODE_STEPS = 8
MAX_QUERY = 9  # verification runs of k + 1 = 2..9 tokens (section 4)
GREEDY_TOKENS = 32
INIT_STD = 0.02
GATE_UP_SWEEP = [(2, 2048, 8, 1), (2, 2048, 8, 3), (4, 2048, 8, 1), (4, 1024, 8, 3),
                 (8, 1024, 8, 1), (2, 1024, 4, 3)]
SMOKE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=512)
DEV = torch.device("cuda")
LINES: list[str] = []


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


def graph_of(fn, calls: int) -> torch.cuda.CUDAGraph:
    """fn() `calls` times in one CUDA graph (launch gaps as in a decode graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


# ---- 1. kernels ---------------------------------------------------------------------------
def kernel_checks() -> None:
    gen = torch.Generator(DEV).manual_seed(1)
    heads, kv_heads, head_dim = 32, 8, 128
    rope = RotaryEmbedding(head_dim, 8192, 5e5)
    for tokens in (1, 5, 37):
        slots = torch.randperm(64 * BLOCK, device=DEV, generator=gen)[:tokens]
        if tokens > 1:
            slots[1] = -1  # a padded token
        positions = torch.randint(0, 8192, (tokens,), device=DEV, generator=gen)
        table = rope.table(positions)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEV, generator=gen,
                          dtype=torch.bfloat16) * 2
        meta = AttentionMetadata(slots, torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                                 torch.ones(1, dtype=torch.int32, device=DEV),
                                 torch.zeros(2, dtype=torch.int32, device=DEV), [tokens],
                                 [tokens], tokens, tokens, BLOCK)
        outs = []
        for fused in (True, False):
            caches = [torch.full((64, BLOCK, kv_heads, head_dim), 7.0, device=DEV,
                                 dtype=torch.bfloat16) for _ in range(2)]
            backend = triton_backend.TritonAttentionBackend(fused_rotary_kv=fused)
            q = backend.rotate_and_write_kv(qkv, rope, table, *caches, meta)
            outs.append((q, *caches))
        same = all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
        h = qkv[:, : (heads + kv_heads) * head_dim].double().view(tokens, -1, 2, head_dim // 2)
        ref = (h * table.cos.double() + h.flip(2) * table.sin.double()).view(tokens, -1, head_dim)
        say(f"rotary+write_kv T={tokens:>2}: fused == unfused (q, k cache, v cache) bit-exact "
            f"{same}; q rel err vs fp64 {rel(outs[0][0], ref[:, :heads]):.2e}")
    x = torch.randn(1, 4096, device=DEV, generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(28672, 4096, device=DEV, generator=gen) * INIT_STD).to(torch.bfloat16)
    unfused = triton_ops.silu_mul(triton_ops.gemv(x, w, None, triton_ops.GEMV_CONFIGS[w.shape]))
    g, u = (x.double() @ w.double().T).split(14336, dim=-1)
    ref = torch.nn.functional.silu(g) * u
    for cfg in GATE_UP_SWEEP:
        out = fused_mlp.gate_up_silu(x, w, cfg)
        say(f"gate_up_silu {cfg}: == gemv+silu_mul bit-exact {torch.equal(out, unfused)}; "
            f"rel err vs fp64 {rel(out, ref):.2e} (unfused {rel(unfused, ref):.2e})")
    base = graph_of(lambda: triton_ops.silu_mul(
        triton_ops.gemv(x, w, None, triton_ops.GEMV_CONFIGS[w.shape])), 16)
    t_base = cuda_time(base.replay, 20) / 16
    argmax_checks(gen)
    rows_per_program_checks(gen)
    say(f"gate_up GEMV + silu_mul: {t_base * 1e6:7.1f} us/call "
        f"({w.numel() * 2 / t_base / 1e12:.2f} TB/s of weight)")
    for cfg in GATE_UP_SWEEP:
        t = cuda_time(graph_of(lambda c=cfg: fused_mlp.gate_up_silu(x, w, c), 16).replay, 20) / 16
        say(f"gate_up_silu {str(cfg):18}: {t * 1e6:7.1f} us/call "
            f"({w.numel() * 2 / t / 1e12:.2f} TB/s)")


def rows_per_program_checks(gen: torch.Generator) -> None:
    """Every ROWS_CONFIGS entry whose programs cover fewer weight rows than their tile
    (rows_per_program) against the same tile covering all its rows: bit-exact at M = 2..16
    (each output row's sums see the same K order whatever rows share its tile)."""
    for (n, k, bucket), cfg in sorted(gemv.ROWS_CONFIGS.items()):
        if not cfg.rows_per_program:
            continue
        w = (torch.randn(n, k, device=DEV, generator=gen) * INIT_STD).to(torch.bfloat16)
        full = cfg._replace(rows_per_program=0)
        same = []
        for m in range(max(2, bucket // 2 + 1), bucket + 1):
            x = torch.randn(m, k, device=DEV, generator=gen, dtype=torch.bfloat16)
            same.append(torch.equal(gemv.gemv_rows(x, w, None, cfg),
                                    gemv.gemv_rows(x, w, None, full)))
            if (n, k) in fused_mlp.GATE_UP_CONFIGS and cfg.pairs_rows:
                same.append(torch.equal(gemv.gate_up_silu_rows(x, w, cfg),
                                        gemv.gate_up_silu_rows(x, w, full)))
        say(f"rows_per_program {(n, k, bucket)} {tuple(cfg)}: == full tiles bit-exact "
            f"{all(same)} ({len(same)} products)")


def argmax_checks(gen: torch.Generator) -> None:
    for rows in (1, 5, 64):
        x = torch.randn(rows, 128256, device=DEV, generator=gen).to(torch.bfloat16)
        x[0, [1000, 70000]] = 30.0  # a tie across blocks: the lower index wins
        same = torch.equal(fused_argmax.argmax(x), x.argmax(-1))
        x[-1, [9, 50000]] = float("nan")
        same_nan = torch.equal(fused_argmax.argmax(x), x.argmax(-1))
        t_torch = cuda_time(graph_of(lambda x=x: x.argmax(-1), 16).replay, 20) / 16
        t_ours = cuda_time(graph_of(lambda x=x: fused_argmax.argmax(x), 16).replay, 20) / 16
        say(f"argmax [{rows}, 128256] bf16: == torch {same} (with NaNs {same_nan}); "
            f"torch {t_torch * 1e6:.1f} us, Triton {t_ours * 1e6:.1f} us per call")


# ---- 2. model -----------------------------------------------------------------------------
def build(cfg, dtype: torch.dtype, src: torch.nn.Module | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_class_for(cfg)(cfg)
    model = model.to(dtype).to_empty(device=DEV)
    gen = torch.Generator(DEV).manual_seed(0)
    with torch.no_grad():
        if src is None:
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, INIT_STD, generator=gen)
                else:  # norm weights away from 1
                    p.uniform_(0.5, 1.5, generator=gen)
        else:
            for p, q in zip(model.parameters(), src.parameters(), strict=True):
                p.copy_(q)
    return model.eval()


# variant -> (rotary + KV write fused, silu_mul in the gate_up GEMV, Triton argmax,
# programmatic dependent launch of the Triton kernels: layers/pdl.py)
VARIANTS = {"off": (False, False, False, False), "rope": (True, False, False, False),
            "rope+mlp": (True, True, False, False), "on": (True, True, True, False),
            "pdl": (True, True, True, True)}


def set_fusions(runner: ModelRunner, variant: str) -> None:
    rope_kv, mlp, argmax, launch_pdl = VARIANTS[variant]
    fused_mlp.ENABLED = mlp
    fused_argmax.ENABLED = argmax
    pdl.ENABLED = launch_pdl
    runner.backend.fused_rotary_kv = rope_kv
    if runner.graphs is not None:  # recapture with the new kernels
        runner.enable_cuda_graphs(1, MAX_QUERY, MAX_MODEL_LEN)


def teacher_forced(runner: ModelRunner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [1 + len(tokens), vocab]: the prompt's last position, then one decode step per
    token (graph replays when graphs are on)."""
    table = list(range(1, 1 + (len(prompt) + len(tokens) + BLOCK) // BLOCK + 1))
    rows = [runner.execute([SequenceRun(prompt, 0, table, [len(prompt) - 1])])]
    for i, t in enumerate(tokens):
        rows.append(runner.execute([SequenceRun([t], len(prompt) + i, table, [0])]))
    return torch.cat(rows).float()


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    table = list(range(1, 1 + (len(prompt) + n + BLOCK) // BLOCK + 1))
    out = runner.execute_argmax([SequenceRun(prompt, 0, table, [len(prompt) - 1])])
    for i in range(n - 1):
        out += runner.execute_argmax([SequenceRun([out[-1]], len(prompt) + i, table, [0])])
    return out


def decode_graph_time(runner: ModelRunner, reps: int) -> float:
    runs = [SequenceRun([5], CTX, list(range(1, 1 + CTX // BLOCK + 1)), [0])]
    runner.execute_argmax(runs)  # captures
    graph = runner.graphs.argmax_graphs[runner.graphs.key_for(runs)]
    return cuda_time(graph.replay, reps)


def verify_runs(q: int) -> list[SequenceRun]:
    """One sequence at context CTX verifying q tokens (logits for all q)."""
    return [SequenceRun([5] * q, CTX, list(range(1, 1 + (CTX + q) // BLOCK + 1)), list(range(q)))]


def verify_graph(runner: ModelRunner, q: int) -> torch.cuda.CUDAGraph:
    """The graph runner.execute replays for verify_runs(q) (no lm_head inside: execute's
    graphs end at the hidden states, as bench_gpu_spec's section 3 times them)."""
    runs = verify_runs(q)
    runner.execute(runs)  # captures
    return runner.graphs.graphs[runner.graphs.key_for(runs)]


def kernel_profile(runner: ModelRunner, steps: int = 5,
                   graph: torch.cuda.CUDAGraph | None = None) -> dict[str, tuple[float, float]]:
    """kernel name -> (launches per step, GPU us per step) over graph replays (the batch-1
    greedy decode graph unless graph is given)."""
    from torch.profiler import ProfilerActivity, profile

    if graph is None:
        runs = [SequenceRun([5], CTX, list(range(1, 1 + CTX // BLOCK + 1)), [0])]
        runner.execute_argmax(runs)
        graph = runner.graphs.argmax_graphs[runner.graphs.key_for(runs)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:60]
            agg[name][0] += 1
            agg[name][1] += ev.time_range.elapsed_us()
    return {k: (n / steps, us / steps) for k, (n, us) in agg.items()}


def model_checks(smoke: bool) -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**LLAMA3_8B, **(SMOKE if smoke else {})}, rope_parameters=dict(ROPE), pad_token_id=None,
                      bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    t0 = time.perf_counter()
    model = build(cfg, torch.bfloat16)
    ref_model = build(cfg, torch.float32, src=model)
    runner = ModelRunner(model, DEV, torch.bfloat16, BLOCK)
    runner.init_kv_cache(96)
    ref = ModelRunner(ref_model, DEV, torch.float32, BLOCK)
    ref.init_kv_cache(96)
    assert runner.enable_cuda_graphs(1, MAX_QUERY, MAX_MODEL_LEN) or smoke
    say(f"models built in {time.perf_counter() - t0:.1f}s")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (CTX,), generator=gen).tolist()
    forced = torch.randint(3, cfg.vocab_size, (DECODE_STEPS,), generator=gen).tolist()

    ref_logits = teacher_forced(ref, prompt, forced)
    logits, tokens = {}, {}
    for v in VARIANTS:
        set_fusions(runner, v)
        logits[v] = teacher_forced(runner, prompt, forced)
        tokens[v] = greedy(runner, prompt, GREEDY_TOKENS)
    ref_tokens = greedy(ref, prompt, GREEDY_TOKENS)
    for v in VARIANTS:
        agree = (logits[v].argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        say(f"fusions {v:8}: logits rel err vs fp32 prefill {rel(logits[v][:1], ref_logits[:1]):.2e}"
            f", decode {rel(logits[v][1:], ref_logits[1:]):.2e}; argmax == fp32 {agree:.0%}; "
            f"greedy agreeing prefix with fp32 {agreeing_prefix(tokens[v], ref_tokens)}"
            f"/{GREEDY_TOKENS}")
    for a, b in (("rope", "off"), ("rope+mlp", "rope"), ("on", "rope+mlp"), ("on", "off"),
                 ("pdl", "on")):
        say(f"{a} vs {b}: prefill logits bit-exact {torch.equal(logits[a][:1], logits[b][:1])}, "
            f"decode logits bit-exact {torch.equal(logits[a][1:], logits[b][1:])} (max |d| "
            f"{(logits[a] - logits[b]).abs().max().item():.3g}); greedy tokens equal "
            f"{tokens[a] == tokens[b]}")
    del ref, ref_model
    if smoke:
        return

    # ---- 3. timing
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n)
    kv = 2 * 32 * 8 * 128 * 2 * CTX
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(2):
        for v in VARIANTS:
            set_fusions(runner, v)
            times[v].append(decode_graph_time(runner, 100))
    profiles = {}
    for v in VARIANTS:
        set_fusions(runner, v)
        try:
            profiles[v] = kernel_profile(runner)
        except Exception as exc:  # noqa: BLE001  (profiling is a bonus)
            say(f"profiler failed: {exc!r}")
    set_fusions(runner, "on")
    roof = (weights + kv) / 4.8e12
    say(f"\nbatch-1 greedy decode graph at context {CTX} (bytes/step {(weights + kv) / 1e9:.2f}"
        f" GB, 4.8 TB/s datasheet roofline {roof * 1e3:.2f} ms)")
    say(f"{'fusions':9} {'GPU ms (2 runs)':>17} {'mean':>7} {'roofline':>8} {'kernels':>7}")
    base = statistics.mean(times["off"])
    for v in VARIANTS:
        m = statistics.mean(times[v])
        n = sum(c for c, _ in profiles[v].values()) if v in profiles else float("nan")
        say(f"{v:9} {times[v][0] * 1e3:8.3f} {times[v][1] * 1e3:8.3f} {m * 1e3:7.3f} "
            f"{roof / m:8.0%} {n:7.0f}   saved vs off {(base - m) * 1e6:5.0f} us "
            f"({(base - m) / base:.1%})")
    if len(profiles) == len(VARIANTS):
        names = sorted({k for prof in profiles.values() for k in prof},
                       key=lambda k: -max(prof.get(k, (0, 0))[1] for prof in profiles.values()))
        say(f"\nper step, from torch.profiler (launches n, GPU us; {len(names)} kernel names)")
        say(f"{'kernel':60}" + "".join(f" {v + ' n':>10} {'us':>7}" for v in VARIANTS))
        for k in names:
            say(f"{k:60}" + "".join(f" {profiles[v].get(k, (0, 0))[0]:10.0f} "
                                    f"{profiles[v].get(k, (0, 0))[1]:7.1f}" for v in VARIANTS))
        for v in VARIANTS:
            us = sum(t for _, t in profiles[v].values())
            say(f"{v:9}: sum of kernel times {us / 1e3:.3f} ms per step")
    verify_checks(runner, prompt, forced)


def verify_checks(runner: ModelRunner, prompt: list[int], forced: list[int]) -> None:
    """4. verification steps (all fusions and PDL on) with the multi-row gate_up + silu
    kernel (fused_mlp.ROWS_ENABLED) off and on: logits of a 9-token verification after the
    prompt bit-equal? Then GPU time of the verify graphs (q = 2..9) over the 1-token graph,
    alternating twice, and the per-kernel profile of q = 1, 2 and 9 with PDL off and on."""
    set_fusions(runner, "pdl")
    table = list(range(1, 1 + (len(prompt) + MAX_QUERY + BLOCK) // BLOCK + 1))
    logits = {}
    for rows in (False, True):
        fused_mlp.ROWS_ENABLED = rows
        set_fusions(runner, "pdl")
        runner.execute([SequenceRun(prompt, 0, table, [len(prompt) - 1])])
        logits[rows] = runner.execute([SequenceRun(([7] + forced)[:MAX_QUERY], len(prompt),
                                                   table, list(range(MAX_QUERY)))])
    say(f"\n9-token verification logits, rows fusion on == off bit-exact "
        f"{torch.equal(logits[True], logits[False])} (max |d| "
        f"{(logits[True] - logits[False]).abs().max().item():.3g})")
    qs = [1, 2, 3, 5, 9]
    times: dict[tuple[bool, int], list[float]] = defaultdict(list)
    for _ in range(2):
        for rows in (False, True):
            fused_mlp.ROWS_ENABLED = rows
            set_fusions(runner, "pdl")
            for q in qs:
                times[rows, q].append(cuda_time(verify_graph(runner, q).replay, 100))
    say(f"verify graph GPU ms at context {CTX} (no lm_head), 2 runs, and / q=1")
    say("| rows fusion | " + " | ".join(f"q={q}" for q in qs) + " |")
    say("|---|" + "---|" * len(qs))
    for rows in (False, True):
        base = statistics.mean(times[rows, 1])
        say(f"| {'on' if rows else 'off'} | " + " | ".join(
            f"{times[rows, q][0] * 1e3:.3f} {times[rows, q][1] * 1e3:.3f} "
            f"({statistics.mean(times[rows, q]) / base:.3f})" for q in qs) + " |")
    # Under PDL a kernel's profiled time includes its wait for the one before, so the
    # per-kernel costs of q = 1 against q = 2 and 9 are read with PDL off ("on").
    profiles = {}
    for variant in ("on", "pdl"):
        set_fusions(runner, variant)
        for q in (1, 2, 9):
            try:
                profiles[f"q{q} {variant}"] = kernel_profile(runner, graph=verify_graph(runner, q))
            except Exception as exc:  # noqa: BLE001  (profiling is a bonus)
                say(f"profiler failed: {exc!r}")
    set_fusions(runner, "pdl")
    names = sorted({k for prof in profiles.values() for k in prof},
                   key=lambda k: -max(prof.get(k, (0, 0))[1] for prof in profiles.values()))
    say("\nverify graphs per step, from torch.profiler (launches n, GPU us)")
    say(f"{'kernel':60}" + "".join(f" {v + ' n':>10} {'us':>7}" for v in profiles))
    for k in names:
        say(f"{k:60}" + "".join(f" {profiles[v].get(k, (0, 0))[0]:10.0f} "
                                f"{profiles[v].get(k, (0, 0))[1]:7.1f}" for v in profiles))
    for v, prof in profiles.items():
        say(f"{v:9}: sum of kernel times {sum(t for _, t in prof.values()) / 1e3:.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny model, no kernels or timing (run with TRITON_INTERPRET=1)")
    args = ap.parse_args()
    import triton

    global DEV
    if args.smoke:
        DEV = torch.device("cpu")
    say(f"torch {torch.__version__}, triton {triton.__version__}, "
        f"{torch.cuda.get_device_name() if DEV.type == 'cuda' else 'cpu'}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
    t0 = time.perf_counter()
    if not args.smoke:
        kernel_checks()
        say(f"[kernels done at {time.perf_counter() - t0:.0f}s]")
    model_checks(args.smoke)
    say(f"[done at {time.perf_counter() - t0:.0f}s]")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "check_fused_decode.txt").write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
