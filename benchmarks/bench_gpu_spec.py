"""The H200 benchmark of the GPU fast path (issue 6): one script, one device call.

  python benchmarks/bench_gpu_spec.py --out $OUT          # on a GPU (about 6-8 minutes)
  python benchmarks/bench_gpu_spec.py --smoke             # CPU, tiny shapes: shakes out bugs

Random-weight checkpoints of real shapes are built on the device (weights cannot travel): a
Llama-3-8B config in bf16 as target and a Llama-3.2-1B-shaped draft with the same vocabulary.
They are built as transformers models and handed to the engine in memory (the loader's weight
iterator is pointed at their state dicts; config and tokenizer files are written to disk), so
transformers and specserve run the very same weights in one process.

Measured once: the copy bandwidth (bytes read + written by a large device copy) and the bf16
matmul rate (8192^3). Then:

  0. correctness: tiny fp32 Llama, specserve with CUDA graphs vs enforce_eager vs transformers
     greedy (must match exactly, with and without a draft); 8B: graph replay vs the same padded
     batch run eagerly (bit-exact), vs the unpadded eager path; greedy agreement with eager.
  1. decode at batch 1 (128-token prompt, 256 new tokens): tok/s, bytes per token / copy
     bandwidth = % of roofline (end to end, and for one greedy step: execute_argmax() wall
     and the GPU time of its graph replay, lm_head and argmax included); vs
     transformers generate eager (and static cache + torch.compile, attempted last).
  2. throughput at batch 1, 8, 32, 128, 256 (128-token prompts, 128 new tokens).
  3. verify cost: one target step with k + 1 query tokens per sequence over a plain decode
     step, k = 1..8, batch 1, 8, 32, context 512: the logits step (execute(): the graph
     gives hidden states, lm_head and the float32 logits run after it, as for sampled
     requests) and the greedy step the engine runs for greedy requests (execute_argmax():
     lm_head and argmax inside the graph, token ids read back).
  4. speculative speedup at controlled acceptance (spec_decode/benchmark_proposer.py: the 1B
     draft runs for real, its tokens are replaced by the target's recorded greedy tokens,
     corrupted with probability 1 - a): batch 1 at k = 4 (fixed) for a = 0.5, 0.7, 0.9 against
     the ideal (1 - a^(k+1)) / ((1 - a)(1 + k c)), c = draft step / target step; batch 32
     with adaptive speculation on (the median of B32_PAIRS interleaved plain/speculative
     pairs). Diagnostics after it on request: --timeline, --settled-ab (an A/A control of
     plain runs beside a batch settled on plain decoding), --profile-*, --catch-up-sweep.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO / "tests", REPO):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
os.environ.setdefault("SPECSERVE_BENCHMARK_PROPOSER", "1")  # this script only

from checkpoints import TEST_PROMPTS, build_tiny_checkpoint, build_tokenizer  # noqa: E402

import specserve.worker.loading as loading  # noqa: E402
from specserve import LLM, SamplingParams  # noqa: E402
from specserve.engine.heap import freeze_startup_heap  # noqa: E402
from specserve.outputs import agreeing_prefix  # noqa: E402
from specserve.spec_decode.benchmark_proposer import ReplayProposer  # noqa: E402
from specserve.worker.model_runner import SequenceRun  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA32_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                  max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SMOKE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=256)
INIT_STD = 0.02
WALK_EMBED_STD = 1000.0  # >> the ~20 rms that 32 random layers add to the residual stream
WALK_HEAD_STD = 0.01
PROMPT_LEN = 128
K_SPEC = 4
VERIFY_ROUNDS = 5  # section 3: rounds over q = 1..9 (verify_sweep)
VERIFY_REPS = 6  # ... steps per q per round
MULTI_STEPS = 16  # num_scheduler_steps of the multi-step rows (16: bench_gpu_decode_b1, session 6)
ACCEPTANCES = (0.5, 0.7, 0.9)
STALL_SECONDS = 0.1  # an engine step this slow is a one-time compile, not the policy's doing
# batch-32 adaptive: plain / speculative run pairs per acceptance, interleaved. Nine since
# session 17: two plain runs of one engine paired the same way (--settled-ab's A/A
# control) ranged 0.94-1.07, so a median of five moved by ~2 % between runs.
B32_PAIRS = 9
LOG: list[str] = []
FULL_COLLECTIONS: list[float] = []  # seconds of every full (generation-2) garbage collection
GC_IN_RUNS: dict[str, tuple[int, float]] = {}  # run label -> full collections in its timing


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    gc.unfreeze()  # an engine frozen by freeze() must be collectable once dropped
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def freeze() -> None:
    """Freeze the loaded engine's objects out of the cyclic garbage collector, as the API
    server does once its engine is up (engine/heap.py): a full collection walks every tracked
    object (~400k in this process), and one landing inside a timed batch-32 run (~1 s) would
    add 100-300 ms to it. The timed runs report any full collection they still contain."""
    say(f"heap frozen: {freeze_startup_heap()} objects")


def _time_full_collections(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        FULL_COLLECTIONS.append(-time.perf_counter())
    elif FULL_COLLECTIONS and FULL_COLLECTIONS[-1] < 0:
        FULL_COLLECTIONS[-1] += time.perf_counter()


gc.callbacks.append(_time_full_collections)


def cuda_time(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() by CUDA events (host clock on CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wall_time(fn, reps: int, warmup: int = 3) -> float:
    """Median host seconds of fn() followed by a device sync (what the engine pays)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- ceilings ---------------------------------------------------------------------------------
def copy_bandwidth(device, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), 20)
    assert torch.equal(dst, src)
    return 2 * nbytes / t


def matmul_rate(device, n: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = cuda_time(lambda: a @ b, 10)
    return 2 * n**3 / t


# ---- checkpoints ------------------------------------------------------------------------------
def build_hf(shape: dict, device, seed: int, dtype, walk: bool = False):
    """Random Llama on the device. walk=True makes greedy decoding a fixed random walk: the
    embedding rows are large (std WALK_EMBED_STD, so the residual stream stays dominated by
    the current token's row through all layers) and lm_head row perm[i] is embedding row i
    scaled down, so the argmax after token i is perm[i] by a wide margin. Greedy output then
    cannot flip with kernel choice (bf16 rounding differs between a decode GEMV and a verify
    GEMM), which keeps the replayed proposals' acceptance at its set value at any batch and k.
    Bytes and FLOPs are those of any 8B checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**shape, rope_parameters=dict(ROPE), dtype=dtype,
                      initializer_range=INIT_STD, pad_token_id=None, bos_token_id=1,
                      eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD, generator=gen)
            else:
                p.fill_(1.0)
        if walk:
            emb = model.get_input_embeddings().weight
            emb.normal_(0.0, WALK_EMBED_STD, generator=gen)
            perm = torch.randperm(emb.shape[0], generator=gen, device=device)
            head = model.get_output_embeddings().weight
            head[perm] = emb * (WALK_HEAD_STD / WALK_EMBED_STD)
    model.generation_config.eos_token_id = None
    return model.eval()


IN_MEMORY: dict[str, torch.nn.Module] = {}
_ITER_WEIGHTS = loading.iter_weights


def _iter_weights(source):
    model = IN_MEMORY.get(str(Path(source.path).resolve()))
    if model is None:
        yield from _ITER_WEIGHTS(source)
        return
    yield from model.state_dict().items()


loading.iter_weights = _iter_weights  # the engine's loader reads registered models from memory


def register(hf_model, path: Path) -> str:
    """config.json + tokenizer on disk, a placeholder weights file, weights from memory."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(path)
    build_tokenizer(path)
    save_file({"placeholder": torch.zeros(1)}, str(path / "model.safetensors"))
    IN_MEMORY[str(path.resolve())] = hf_model
    return str(path)


def weight_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads: every weight but the embedding table, total params)."""
    emb = model.get_input_embeddings().weight
    seen, read, params = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        if p is not emb or getattr(model.config, "tie_word_embeddings", False):
            read += p.numel() * p.element_size()
    return read, params


# ---- engine driving ---------------------------------------------------------------------------
def run_engine(llm: LLM, prompts: list[list[int]], new_tokens: int, label: str):
    """Greedy, EOS ignored; returns (decode tok/s after every first token, outputs, steps)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rids = [f"{label}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=p)
    got: dict[str, int] = dict.fromkeys(rids, 0)
    done: dict[str, list[int]] = {}
    t_first = None
    decode_steps = 0
    tokens_at_first = 0
    collections_at_first = len(FULL_COLLECTIONS)
    while engine.has_unfinished_requests():
        outs = engine.step()
        for o in outs:
            got[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        if t_first is None:
            if all(c >= 1 for c in got.values()):
                sync()
                t_first = time.perf_counter()
                tokens_at_first = sum(got.values())
                collections_at_first = len(FULL_COLLECTIONS)
        else:
            decode_steps += 1
    sync()
    elapsed = time.perf_counter() - t_first
    inside = FULL_COLLECTIONS[collections_at_first:]
    GC_IN_RUNS[label] = (len(inside), sum(inside))
    total = sum(len(v) for v in done.values())
    outs = [done[r] for r in rids]
    assert all(len(o) == new_tokens for o in outs), [len(o) for o in outs]
    return (total - tokens_at_first) / elapsed, outs, decode_steps


def set_scheduler_steps(llm: LLM, steps: int) -> None:
    """Switch an engine's multi-step decoding in place (what LLM(num_scheduler_steps=...)
    configures), so one loaded model serves both rows of a comparison."""
    engine = llm.llm_engine
    engine.num_scheduler_steps = steps
    engine.scheduler.num_lookahead_slots = steps - 1
    engine.scheduler.budget_lookahead = False


def hf_decode_rate(model, prompt: list[int], new_tokens: int, device) -> tuple[float, list[int]]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], device=device)

    def gen(n: int):
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, generation_config=cfg,
                                 attention_mask=torch.ones_like(ids))
        sync()
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    gen(2)
    t1 = min(gen(1)[0] for _ in range(2))
    tn, tokens = gen(new_tokens)
    return (new_tokens - 1) / (tn - t1), tokens


def warm_graphs(runner, batches, query_lens=None, heads=(False, True)) -> None:
    """Capture the buckets a timed run will use before it starts (captures are lazy), with
    both heads: hidden states (logits after the replay) and argmax ids (greedy steps)."""
    graphs = runner.graphs
    if graphs is None:
        return
    qs = query_lens or range(1, graphs.max_query_len + 1)
    keys = {graphs.key_for([SequenceRun([0] * q, 0, [], [0])] * b) for b in batches for q in qs}
    graphs.capture_keys([k for k in keys if k is not None], heads)


# ---- section 0: correctness -------------------------------------------------------------------
def tiny_checks(device, workdir: Path) -> list[str]:
    """fp32 tiny Llama: graphs vs eager vs transformers, greedy, with and without a draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = build_tiny_checkpoint(workdir / "tiny", "llama", hidden_size=128)
    draft = build_tiny_checkpoint(workdir / "tiny_draft", "llama", hidden_size=128, seed=1,
                                  num_layers=1)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok.encode(p) for p in TEST_PROMPTS[:12]]
    new = 32
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p], device=device), max_new_tokens=new,
                              do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones(1, len(p), device=device,
                                                        dtype=torch.long))
        refs.append(out[0, len(p):].tolist())
    del hf
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    lines = []
    for label, kw in (("graphs", {}), ("enforce_eager", {"enforce_eager": True}),
                      ("graphs + draft k=3", {"speculative_model": str(draft),
                                              "num_speculative_tokens": 3}),
                      ("eager + draft k=3", {"speculative_model": str(draft),
                                             "num_speculative_tokens": 3,
                                             "enforce_eager": True})):
        llm = LLM(model=str(target), device=device.type, dtype="float32",
                  kv_cache_memory_bytes=256 << 20, max_model_len=512, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        graphs = llm.llm_engine.runner.graphs
        n_graphs = len(graphs.graphs) + len(graphs.argmax_graphs) if graphs is not None else 0
        exact = sum(g == r for g, r in zip(got, refs, strict=True))
        lines.append(f"tiny fp32 {label:<20} vs transformers: {exact}/{len(prompts)} exact "
                     f"({n_graphs} target graphs captured)")
        del llm
        free()
    return lines


def fused_op_checks(device) -> list[str]:
    """bf16 fused RMSNorm / rotary / SiLU-mul kernels vs the torch formulas in float64."""
    from specserve.model.layers import triton_ops
    from specserve.model.layers.rotary import RotaryEmbedding

    if not triton_ops.available(torch.zeros(1, device=device)):
        return ["fused ops: not on this device"]
    gen = torch.Generator(device).manual_seed(5)
    x = torch.randn(37, 4096, device=device, generator=gen, dtype=torch.bfloat16) * 3
    w = (torch.rand(4096, device=device, generator=gen) + 0.5).to(torch.bfloat16)
    x64 = x.double()
    ref = w.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5))
    out = triton_ops.rms_norm(x, w, 1e-5).double()
    lines = [f"fused rms_norm bf16 rel err {((out - ref).norm() / ref.norm()).item():.2e}"]
    rope = RotaryEmbedding(128, 8192, 5e5)
    table = rope.table(torch.randint(0, 8192, (37,), device=device, generator=gen))
    q = torch.randn(37, 40, 128, device=device, generator=gen, dtype=torch.bfloat16)
    h = q.double().view(37, 40, 2, 64)
    ref = (h * table.cos.double() + h.flip(2) * table.sin.double()).view(37, 40, 128)
    out = triton_ops.rotary(q, table.cos, table.sin).double()
    lines.append(f"fused rotary bf16 rel err {((out - ref).norm() / ref.norm()).item():.2e}")
    gu = torch.randn(37, 2 * 14336, device=device, generator=gen, dtype=torch.bfloat16) * 2
    g, u = gu.double().split(14336, dim=-1)
    ref = torch.nn.functional.silu(g) * u
    out = triton_ops.silu_mul(gu).double()
    lines.append(f"fused silu_mul bf16 rel err {((out - ref).norm() / ref.norm()).item():.2e}")
    r = torch.randn(37, 4096, device=device, generator=gen, dtype=torch.bfloat16) * 5
    out, res = triton_ops.add_rms_norm(x, r, w, 1e-5)
    res_ref = x + r  # torch's bf16 add: the fused kernel must round the same way
    h = res_ref.double()
    ref = w.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    lines.append(f"fused add_rms_norm bf16: residual bit-exact {torch.equal(res, res_ref)}, "
                 f"norm rel err {((out.double() - ref).norm() / ref.norm()).item():.2e}")
    from specserve.model.layers.fused_argmax import logits_argmax

    for rows in (1, 32):
        logits = torch.randn(rows, 128256, device=device, generator=gen).to(torch.bfloat16)
        same = torch.equal(logits_argmax(logits), logits.argmax(-1))  # bf16: ties are common
        t_ours = cuda_time(lambda: logits_argmax(logits), 50)  # noqa: B023
        t_torch = cuda_time(lambda: logits.argmax(-1), 50)  # noqa: B023
        lines.append(f"two-stage argmax [{rows}, 128256] bf16 == torch: {same}; "
                     f"{1e6 * t_ours:.1f} us vs torch {1e6 * t_torch:.1f} us")
    return lines


def graph_vs_eager(llm: LLM, device) -> list[str]:
    """8B: graph replay == the same padded batch run eagerly (bit-exact); vs unpadded eager."""
    runner = llm.llm_engine.runner
    if runner.graphs is None:
        return ["no CUDA graphs on this device: replay check skipped"]
    vocab = runner.model.vocab_size
    bs = runner.block_size
    gen = torch.Generator().manual_seed(3)
    lines = []
    for batch, q in ((1, 1), (3, 1), (5, 5), (32, 1)):
        ctx = 200
        runs = []
        for i in range(batch):
            nb = (ctx + q + bs - 1) // bs
            table = list(range(1 + i * nb, 1 + (i + 1) * nb))
            toks = torch.randint(0, vocab, (q,), generator=gen).tolist()
            runs.append(SequenceRun(toks, ctx, table, list(range(q))))
        graphs = runner.graphs
        replay = runner.execute(runs).clone()
        runner.graphs = None
        eager = runner.execute(runs).clone()
        runner.enable_cuda_graphs(graphs.ladder[-1], graphs.max_query_len,
                                  graphs.max_model_len, capture=False)
        padded = runner.execute(runs).clone()
        runner.graphs = graphs
        diff = (replay - eager).abs().max().item()
        same_argmax = (replay.argmax(-1) == eager.argmax(-1)).float().mean().item()
        lines.append(f"8B bf16 batch {batch:>2} x {q} tokens: replay == padded eager: "
                     f"{torch.equal(replay, padded)}; vs unpadded eager max|dlogit| "
                     f"{diff:.3g}, argmax agree {same_argmax:.0%}")
    return lines


# ---- sections 3, 4: step costs ------------------------------------------------------------------
def synthetic_runs(runner, batch: int, q: int, ctx: int, first_block: int) -> list[SequenceRun]:
    bs = runner.block_size
    nb = (ctx + q + bs - 1) // bs
    vocab = runner.model.vocab_size
    return [SequenceRun([(7 * i + j) % vocab for j in range(q)], ctx,
                        list(range(first_block + i * nb, first_block + (i + 1) * nb)),
                        list(range(q))) for i in range(batch)]


def step_time(runner, batch: int, q: int, ctx: int, reps: int,
              argmax: bool = False) -> tuple[float, float]:
    """(host-clock seconds of runner.execute incl. input building and logits, GPU seconds of
    the graph replay alone, nan when eager). argmax=True: the greedy step instead
    (runner.execute_argmax: logits and argmax inside the graph, token ids read back)."""
    runs = synthetic_runs(runner, batch, q, ctx, first_block=1)
    execute = runner.execute_argmax if argmax else runner.execute
    wall = wall_time(lambda: execute(runs), reps)
    gpu = float("nan")
    if runner.graphs is not None and runner.graphs.capture:
        key = runner.graphs.key_for(runs)
        graph = (runner.graphs.argmax_graphs if argmax else runner.graphs.graphs).get(key)
        if graph is not None:
            gpu = cuda_time(graph.replay, reps)
    return wall, gpu


def verify_sweep(runner, batch: int, argmax: bool, rounds: int = VERIFY_ROUNDS,
                 reps: int = VERIFY_REPS) -> list[tuple[float, float]]:
    """step_time at q = 1..9 query tokens per sequence (context 512): [(wall, GPU seconds)]
    per q, each the median over `rounds` rounds that visit every q in turn, of `reps` steps
    each. Why rounds: a host stall that lasts a few hundred ms (another process, a page-cache
    flush) slows every step of the q measured then; measured q after q, 20 steps each, it made
    one q of the H100's batch-1 wall row read 1.158 where its GPU time read 1.071 (session 33).
    Spread over rounds, one stalled round moves no median."""
    samples: list[list[tuple[float, float]]] = [[] for _ in range(9)]
    for _ in range(rounds):
        for q in range(1, 10):
            samples[q - 1].append(step_time(runner, batch, q, 512, reps, argmax=argmax))
    return [(statistics.median(w for w, _ in s), statistics.median(g for _, g in s))
            for s in samples]


def catch_up_sweep(draft_runner, target_runner, batch: int, out: Path | None) -> list[str]:
    """What the pieces of a speculative step cost at this batch: a draft forward in which every
    sequence catches up on q tokens (logits for its last one only, as in propose()), and a
    target pass over q tokens per sequence (logits for all: verification). Wall time of
    execute_argmax (input building, graph or eager forward, argmax, the read), and a
    torch.profiler table of one 16-token draft catch-up."""
    ctx = 200
    lines = ["| runner | batch | q tokens / sequence | path | wall ms | GPU ms (graph) |",
             "|---|---|---|---|---|---|"]

    def runs_last(runner, q):
        return [SequenceRun(r.token_ids, r.start, r.block_table, [q - 1])
                for r in synthetic_runs(runner, batch, q, ctx, first_block=1)]

    for name, runner, qs, last in (("draft", draft_runner, (1, 2, 3, 4, 8, 16, 32, 64), True),
                                   ("target", target_runner, (1, 2, 3, 5), False)):
        for q in qs:
            runs = runs_last(runner, q) if last else synthetic_runs(runner, batch, q, ctx, 1)
            key = runner.graphs.key_for(runs) if runner.graphs is not None else None
            wall = wall_time(lambda runs=runs, runner=runner: runner.execute_argmax(runs), 10)
            gpu = float("nan")
            if key is not None:
                graph = runner.graphs.argmax_graphs.get(key)
                if graph is not None:
                    gpu = cuda_time(graph.replay, 10)
            lines.append(f"| {name} | {batch} | {q} | {'graph' if key else 'eager'} | "
                         f"{1e3 * wall:.2f} | {1e3 * gpu:.2f} |")
    runs = runs_last(draft_runner, 16)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    draft_runner.execute_argmax(runs)
    sync()
    with profile(activities=acts) as prof:
        for _ in range(3):
            draft_runner.execute_argmax(runs)
        sync()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=20)
    table_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=20)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "catch_up_profile.txt").write_text(table + "\n\n" + table_cpu)
    return lines + ["", "3 draft catch-ups of 16 tokens x batch, by device time:", table,
                    "by CPU time:", table_cpu]


def profile_spec_steps(engine, driver, prompts: list[list[int]], new_tokens: int,
                       out: Path | None, steps: int = 4) -> list[str]:
    """torch.profiler over the first decode steps of a speculative batch (the first one makes
    the draft prefill every prompt): per-step wall time and the top ops by CPU and device time,
    with the step's phases labelled (propose, draft forwards, target pass)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def labelled(fn, label):
        def run(*a, **kw):
            with record_function(label):
                return fn(*a, **kw)
        return run

    draft_runner = driver.proposer.runner
    saved = [(driver, "propose"), (engine.runner, "execute_argmax"),
             (draft_runner, "execute_argmax"), (draft_runner, "execute_argmax_steps")]
    originals = [getattr(o, name) for o, name in saved]
    for (o, name), fn in zip(saved, originals, strict=True):
        label = {id(driver): "spec.propose", id(engine.runner): "target"}.get(id(o), "draft")
        setattr(o, name, labelled(fn, f"{label}.{name}"))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prof-{i}-{time.monotonic_ns()}", None, params,
                           prompt_token_ids=prompt)
    lines = []
    try:
        while any(not s.output_token_ids for r in engine.requests.values() for s in r.seqs):
            engine.step()  # prefill, unprofiled
        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                         if torch.cuda.is_available() else [])
        walls = []
        with profile(activities=acts) as prof:
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                sync()
                walls.append(time.perf_counter() - t0)
        lines.append("step wall ms: " + ", ".join(f"{1e3 * w:.1f}" for w in walls))
        for sort in ("cpu_time_total", "cuda_time_total" if torch.cuda.is_available()
                     else "self_cpu_time_total"):
            lines.append(f"by {sort}:")
            lines.append(prof.key_averages().table(sort_by=sort, row_limit=25))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        for (o, name), fn in zip(saved, originals, strict=True):
            setattr(o, name, fn)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec_steps_profile.txt").write_text("\n".join(lines))
    return lines


def add_and_skip(engine, prompts: list[list[int]], params: SamplingParams, tag: str,
                 skip: int) -> None:
    """Add one request per prompt and run `skip` engine steps (prefill and the first decode
    steps), so that what is measured next is the batch's steady state."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}-{time.monotonic_ns()}", None, params,
                           prompt_token_ids=prompt)
    for _ in range(skip):
        engine.step()
    sync()


def timed_steps(engine, steps: int, profile: bool = False):
    """(wall seconds per engine step over `steps` steps, synced at the end; the cProfile of
    them when profile, else None)."""
    import cProfile

    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        engine.step()
    sync()
    if prof is not None:
        prof.disable()
    return (time.perf_counter() - t0) / steps, prof


def profile_steady_steps(engine, prompts: list[list[int]], new_tokens: int, out: Path | None,
                         skip: int = 20, steps: int = 40) -> list[str]:
    """Host time of a batch-32 speculative run in its steady state (after ``skip`` steps): the
    Python functions by cumulative time over ``steps`` steps (cProfile), beside the steps' wall
    time, to show what the host does beyond the GPU's work."""
    import io
    import pstats

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    add_and_skip(engine, prompts, params, "steady", skip)
    wall, prof = timed_steps(engine, steps, profile=True)
    while engine.has_unfinished_requests():
        engine.step()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    lines = [f"{steps} steps after {skip}: {1e3 * wall:.2f} ms per step under cProfile",
             *text.getvalue().splitlines()]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "steady_steps_profile.txt").write_text("\n".join(lines))
    return lines


def profile_caps(engine, driver, replay, prompts: list[list[int]], new_tokens: int,
                 out: Path | None, caps=((0, True), (1, False), (1, True), (4, False), (4, True)),
                 skip: int = 20, steps: int = 40) -> list[str]:
    """Host time per Python function of steady batch steps at fixed caps (0: plain decoding,
    the driver off; else replayed proposals at a = 0.5 capped there), each with the draft's
    proposals launched a step ahead or not (DraftModelProposer.launch_ahead): cProfile over
    `steps` steps sorted by own time, beside the wall time per step of as many steps without
    the profiler. What a speculative step's host does that a plain step's does not is what
    keeps a cap near break-even where verification is not free (batch 32)."""
    import io
    import pstats

    from step_timeline import wrapped

    lines: list[str] = []
    saved_adaptive, saved_ahead = driver.adaptive, replay.launch_ahead_enabled
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    skip = min(skip, new_tokens // 4)
    steps = min(steps, (new_tokens - skip) // 3)
    try:
        replay.acceptance = 0.5
        driver.adaptive = None
        for cap, ahead in caps:
            replay.launch_ahead_enabled = ahead
            engine.speculation = driver if cap else None
            capped = lambda limit, cap=cap: lambda s, b, extra=0: min(  # noqa: E731
                cap, limit(s, b, extra))
            with wrapped(driver, "_limit", capped):
                add_and_skip(engine, prompts, params, f"pcap{cap}", skip)
                wall, _ = timed_steps(engine, steps)
                profiled, prof = timed_steps(engine, steps, profile=True)
                while engine.has_unfinished_requests():
                    engine.step()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
            body = [ln for ln in text.getvalue().splitlines() if ln.strip()]
            title = "plain decoding" if cap == 0 else (
                f"fixed cap {cap}, replay a = 0.5, {'' if ahead else 'not '}launched ahead")
            lines += [f"batch {len(prompts)}, {title}: {1e3 * wall:.3f} ms/step without the "
                      f"profiler, {1e3 * profiled:.3f} under cProfile ({steps} steps each)",
                      *body[:48], ""]
    finally:
        driver.adaptive = saved_adaptive
        engine.speculation = driver
        replay.launch_ahead_enabled = saved_ahead
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_caps.txt").write_text("\n".join(lines))
    return lines


def start_settled(adaptive) -> None:
    """Make the next closed batch settle on plain decoding from its first step: it skips
    learning, and the engine-wide acceptance (0.2; the caller restores it) says plain."""
    adaptive.learning.skip_left = 1
    adaptive.global_acceptance[:] = [0.2, 0.2]


def timeline(engine, driver, replay, adaptive, prompts: list[list[int]], new_tokens: int,
             out: Path | None, caps=(0, "settled", 1, 2), skip: int = 20,
             steps: int = 12) -> list[str]:
    """Where batch-32 steps spend wall time the GPU does not cover (step_timeline.py): plain
    decoding, the speculative engine on a batch that settled on plain decoding (its policy
    on, learning skipped: what a batch that does not speculate costs there), and fixed caps
    of replayed proposals at a = 0.5, `steps` steady-state steps each under torch.profiler,
    phases labelled; a table per run of host and GPU-idle time per phase. The traces are kept
    gzipped under OUT."""
    import gzip
    import shutil

    from step_timeline import phase_seconds, profile_steps, summarize, wrapped

    lines: list[str] = []
    saved_adaptive, saved_acceptance = driver.adaptive, list(adaptive.global_acceptance)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    work = Path(tempfile.mkdtemp(prefix="timeline_"))
    skip, steps = min(skip, new_tokens // 4), min(steps, new_tokens // 4)  # all steady ones
    try:
        replay.acceptance = 0.5
        for cap in caps:
            settled = cap == "settled"
            driver.adaptive = adaptive if settled else None
            if settled:
                start_settled(adaptive)
            engine.speculation = driver if cap else None
            capped = (lambda limit: limit) if settled else (
                lambda limit, cap=cap: lambda s, b, extra=0: min(  # noqa: E731
                    cap, limit(s, b, extra)))
            with wrapped(driver, "_limit", capped):
                add_and_skip(engine, prompts, params, f"timeline{cap}", skip)
                if settled:
                    lines.append(f"settled batch: last cap {adaptive.last_cap}, "
                                 f"fast path {driver._settled_newest is not None}")
                trace = work / f"timeline_cap{cap}.json"
                walls = profile_steps(engine, steps, trace)
                phases = phase_seconds(engine, steps)
                while engine.has_unfinished_requests():
                    engine.step()
            title = ("plain" if cap == 0 else "speculative engine, settled on plain decoding"
                     if settled else f"fixed cap {cap}, replay a = 0.5")
            lines += summarize(trace, f"batch {len(prompts)}, {title}", walls)
            lines += [f"the next {steps} steps, no profiler (inclusive ms/step): " + ", ".join(
                f"{label} {1e3 * t:.3f}" for label, t in sorted(phases.items(),
                                                                  key=lambda x: -x[1])), ""]
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                with trace.open("rb") as src, gzip.open(out / f"{trace.name}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
    finally:
        driver.adaptive = saved_adaptive
        adaptive.global_acceptance[:] = saved_acceptance
        engine.speculation = driver
        shutil.rmtree(work, ignore_errors=True)
    return lines


def settled_ab(llm, driver, adaptive, replay, prompts: list[list[int]], new_tokens: int,
               reps: int = 6) -> list[str]:
    """Does a batch that never speculates cost more in the speculative engine than with
    speculation off? Three arms in one engine, `reps` rounds in rotating order: plain decoding
    twice (A and B: the pair method's own noise, an A/A control) and the driver on a batch
    settled on plain decoding from its first step (learning skipped, engine-wide acceptance
    0.2). Each run's phases are timed without the profiler (step_timeline.timed_phases over
    the whole run), so a gap, if any, shows where it lands."""
    from step_timeline import timed_phases

    engine = llm.llm_engine
    saved_acceptance = list(adaptive.global_acceptance)
    saved_adaptive = driver.adaptive
    driver.adaptive = adaptive  # the policy on (a run without it may have come last)
    replay.acceptance = 0.5
    arms = ("plain A", "plain B", "settled")
    rates: dict[str, list[float]] = {a: [] for a in arms}
    phases: dict[str, dict[str, float]] = {a: {} for a in arms}
    spec_steps = 0
    try:
        for r in range(reps):
            for arm in arms[r % 3:] + arms[: r % 3]:
                settled = arm == "settled"
                engine.speculation = driver if settled else None
                if settled:
                    start_settled(adaptive)
                before = driver.metrics.total.num_spec_steps
                with timed_phases(engine, phases[arm]):
                    rates[arm].append(run_engine(llm, prompts, new_tokens, f"ab-{arm}")[0])
                spec_steps += driver.metrics.total.num_spec_steps - before
    finally:
        engine.speculation = driver
        driver.adaptive = saved_adaptive
        adaptive.global_acceptance[:] = saved_acceptance
    a, b, s = (rates[x] for x in arms)
    ab = sorted(y / x for x, y in zip(a, b, strict=True))
    sa = sorted(y / x for x, y in zip(a, s, strict=True))
    sm = sorted(2 * y / (x + z) for x, y, z in zip(a, s, b, strict=True))
    lines = [f"{reps} rounds, rotating order, batch {len(prompts)}, {new_tokens} tokens; "
             f"speculative steps in the settled runs: {spec_steps}",
             "| arm | tok/s per round | median |", "|---|---|---:|"]
    lines += [f"| {arm} | {', '.join(f'{x:.0f}' for x in rates[arm])} | "
              f"{statistics.median(rates[arm]):.0f} |" for arm in arms]
    lines += [f"plain B / plain A per round (A/A): {', '.join(f'{x:.3f}' for x in ab)}; "
              f"median {statistics.median(ab):.3f}",
              f"settled / plain A: {', '.join(f'{x:.3f}' for x in sa)}; "
              f"median {statistics.median(sa):.3f}",
              f"settled / mean of A and B: {', '.join(f'{x:.3f}' for x in sm)}; "
              f"median {statistics.median(sm):.3f}",
              "inclusive ms per run by phase (mean over rounds): | phase | " + " | ".join(arms)
              + " |"]
    for label in sorted({k for arm in arms for k in phases[arm]},
                        key=lambda k: -phases["settled"].get(k, 0.0)):
        lines.append(f"| {label} | " + " | ".join(
            f"{1e3 * phases[arm].get(label, 0.0) / reps:.1f}" for arm in arms) + " |")
    return lines


def decode_ahead_ab(llm: LLM, prompt_sets: dict[int, list[list[int]]], new_tokens: int,
                    reps: int = 5) -> list[str]:
    """Plain greedy decoding three ways in one engine: the next pass queued before a step's
    read and fed on the device (decode_ahead_unread, on by default since session 27 measured it),
    launched right after the read (decode_ahead_enabled only, the default until session 27), and not
    ahead; `reps` rounds per batch size, the order
    rotating, the outputs compared (launching ahead must change no token)."""
    engine = llm.llm_engine
    saved = engine.decode_ahead_enabled, engine.decode_ahead_unread
    modes = {"before read": (True, True), "after read": (True, False), "not ahead": (False, False)}
    lines = ["| batch | " + " | ".join(f"{m} tok/s per round" for m in modes)
             + " | before / after read (pairs) | before read / not ahead | outputs equal |",
             "|---:|---|---|---|---|---|---|"]
    try:
        for b, ps in prompt_sets.items():
            rates: dict[str, list[float]] = {m: [] for m in modes}
            outs: dict[str, list] = {}
            names = list(modes)
            for r in range(reps):
                for m in names[r % 3:] + names[: r % 3]:
                    engine.decode_ahead_enabled, engine.decode_ahead_unread = modes[m]
                    rate, o, _ = run_engine(llm, ps, new_tokens, f"da-{m}-{b}")
                    rates[m].append(rate)
                    outs.setdefault(m, o)

            def ratios(a: str, c: str, rates: dict = rates) -> str:
                rs = sorted(x / y for x, y in zip(rates[a], rates[c], strict=True))
                return f"{statistics.median(rs):.3f} ({rs[0]:.3f}-{rs[-1]:.3f})"
            lines.append(f"| {b} | " + " | ".join(", ".join(f"{x:.0f}" for x in rates[m])
                                                  for m in modes)
                         + f" | {ratios('before read', 'after read')} | "
                         f"{ratios('before read', 'not ahead')} | "
                         f"{all(o == outs['not ahead'] for o in outs.values())} |")
    finally:
        engine.decode_ahead_enabled, engine.decode_ahead_unread = saved
    return lines


def memory_check(target_dir: str, draft_dir: str, dname: str, device, prompts) -> list[str]:
    """The engine sizes target + draft caches from gpu_memory_utilization after profiling its
    largest step; then a full batch (prefill steps of max_num_batched_tokens, verify steps of
    max_num_seqs x (k + 1) logit rows) must run without running out of memory."""
    import logging

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("specserve.worker.kv_cache")
    handler, level = Grab(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        llm = LLM(model=target_dir, device=device.type, dtype=dname, max_model_len=4096,
                  max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                  speculative_model=draft_dir, num_speculative_tokens=K_SPEC,
                  enable_prefix_caching=False)
        t_init = time.perf_counter() - t0
        lines = [f"engine init {t_init:.1f}s (max_model_len 4096, max_num_seqs 256, "
                 f"max_num_batched_tokens 8192, k={K_SPEC})"] + records
        ps = [p * 8 for p in prompts(256)]  # 1024-token prompts: 32 prefill steps of 8192
        try:
            rate, outs, _ = run_engine(llm, ps, 32, "mem256")
            ok = f"ok, {sum(len(o) for o in outs)} tokens, {rate:.0f} tok/s"
        except torch.OutOfMemoryError as exc:
            ok = f"OUT OF MEMORY: {str(exc)[:200]}"
        free_b, total = torch.cuda.mem_get_info()
        lines.append(f"256 x 1024-token prompts + 32 new tokens with the draft: {ok}")
        lines.append(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
                     f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB, "
                     f"device in use now {(total - free_b) / 2**30:.2f} of "
                     f"{total / 2**30:.2f} GiB ({100 * (total - free_b) / total:.1f}%)")
        del llm
        return lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def finish(args, results: dict) -> int:
    """Write the log and the results (sections cut short end here too)."""
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu_spec.txt").write_text("\n".join(LOG) + "\n")
        (args.out / "bench_gpu_spec.json").write_text(json.dumps(results, indent=1,
                                                                 default=str))
    return 0


COMPILED: list[tuple[str, str]] = []  # (kernel, specialization) of each Triton compile


def log_triton_compiles() -> None:
    """Record every Triton JIT compile (the in-memory cache missed): which kernel variants an
    eager step meets for the first time in the middle of a run."""
    import triton

    def hook(*, key, fn, **_):
        # the key holds the argument specialization and the constexpr values
        COMPILED.append((fn.name, " ".join(str(key).split())[:600]))
        return False  # compile as usual

    try:
        triton.knobs.runtime.jit_cache_hook = hook
    except AttributeError:
        say("this Triton has no knobs.runtime.jit_cache_hook: compiles not logged")


def ideal_speedup(a: float, k: int, c: float) -> float:
    if a >= 1.0:
        return (k + 1) / (1 + k * c)
    return (1 - a ** (k + 1)) / ((1 - a) * (1 + k * c))


def profile_decode(llm: LLM, prompt: list[list[int]], out: Path | None) -> None:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    rate, _, steps = run_engine(llm, prompt, 64, "profile")
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(30)
    buf.write("\n\n")
    stats.stream = buf
    stats.sort_stats("cumulative").print_stats(40)
    text = buf.getvalue()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_b1.txt").write_text(text)
    print(f"profiled 64 tokens at batch 1 ({rate:.1f} tok/s under cProfile)")
    print("\n".join(text.splitlines()[:45]))


# ---- main -------------------------------------------------------------------------------------
def main() -> int:
    global ACCEPTANCES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--skip-compile", action="store_true",
                    help="skip transformers static cache + torch.compile")
    ap.add_argument("--no-walk", action="store_true",
                    help="plain random target (greedy output may flip with kernel choice)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile 64 decode steps at batch 1 (host time per function)")
    ap.add_argument("--no-spec", action="store_true",
                    help="skip section 4 (speculation at controlled acceptance)")
    ap.add_argument("--memory-check", action="store_true",
                    help="size the KV cache from gpu_memory_utilization (profiling pass) and "
                         "run a full batch with a draft through it")
    ap.add_argument("--spec-only", action="store_true",
                    help="only what section 4 needs: plain decode at batch 1 and 32, then "
                         "speculation (skips transformers, eager, the sweeps and compile)")
    ap.add_argument("--catch-up-sweep", action="store_true",
                    help="after section 4: time draft catch-up forwards and target passes at "
                         "batch 32 by tokens per sequence, and profile one draft catch-up")
    ap.add_argument("--profile-spec-steps", action="store_true",
                    help="after section 4: torch.profiler over the first decode steps of a "
                         "batch-32 speculative run (the draft prefills in the first)")
    ap.add_argument("--profile-steady-steps", action="store_true",
                    help="after section 4: cProfile over 40 steady-state steps of a batch-32 "
                         "adaptive run at a = 0.5 (host time per function)")
    ap.add_argument("--timeline", action="store_true",
                    help="after section 4: torch.profiler timelines of steady batch-32 steps "
                         "(plain, a settled speculative batch, fixed caps 1 and 2 at a = 0.5): "
                         "host and GPU-idle time per "
                         "engine phase (step_timeline.py)")
    ap.add_argument("--profile-caps", action="store_true",
                    help="after section 4: wall time and cProfile (own time per function) "
                         "of steady batch-32 and batch-1 steps, plain and at fixed caps 1 and "
                         "4 (a = 0.5), each with the draft's proposals launched ahead and not")
    ap.add_argument("--settled-ab", action="store_true",
                    help="after section 4: batch-32 runs of plain decoding twice (an A/A "
                         "control) and of a batch settled on plain decoding in the speculative "
                         "engine, 6 rounds in rotating order, phases timed without the profiler")
    ap.add_argument("--steps-log", action="store_true",
                    help="write every engine step of section 4's runs to OUT/steps.jsonl "
                         "(time, proposals, draft catch-up tokens, cap, batch)")
    ap.add_argument("--log-compiles", action="store_true",
                    help="print every Triton kernel compiled during section 4's runs")
    ap.add_argument("--compile-deadline", type=float, default=420.0,
                    help="skip the compile attempt if this many seconds have passed")
    ap.add_argument("--no-decode-ahead", action="store_true",
                    help="plain greedy decodes NOT launched a step ahead in the engines of "
                         "sections 1, 2 and 4 (LLMEngine.decode_ahead_enabled, on by default "
                         "on CUDA)")
    ap.add_argument("--acceptances", type=float, nargs="+", default=list(ACCEPTANCES),
                    help="section 4's acceptance rates (default: %(default)s)")
    ap.add_argument("--decode-ahead-ab", action="store_true",
                    help="after section 2: plain decoding at batch 1 and 32 with the next pass "
                         "queued before the step's read, launched after it, and not ahead, "
                         "interleaved in one engine")
    args = ap.parse_args()
    ACCEPTANCES = tuple(args.acceptances)  # (section 4 and its report read the module's)
    t_start = time.perf_counter()
    if args.log_compiles:
        log_triton_compiles()
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    import transformers
    import triton

    say(f"torch {torch.__version__}, triton {triton.__version__}, transformers "
        f"{transformers.__version__}, device "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
    bw = copy_bandwidth(device, (64 if smoke else 4096) << 20)
    mm = matmul_rate(device, 512 if smoke else 8192)
    free()  # the probes' buffers are cached by the allocator
    say(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s; bf16 matmul: {mm / 1e12:.0f} TFLOP/s")
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_spec_"))
    results: dict = {"bandwidth": bw, "matmul": mm}

    say("\n== 0. correctness")
    for line in fused_op_checks(device) + tiny_checks(device, work):
        say(line)

    dtype = torch.float32 if smoke else torch.bfloat16
    dname = "float32" if smoke else "bfloat16"
    tshape = {**LLAMA3_8B, **(SMOKE if smoke else {})}
    dshape = {**LLAMA32_1B, **(SMOKE if smoke else {})}
    hf_target = build_hf(tshape, device, 0, dtype, walk=not args.no_walk)
    hf_draft = build_hf(dshape, device, 1, dtype)
    target_dir = register(hf_target, work / "target")
    draft_dir = register(hf_draft, work / "draft")
    t_read, t_params = weight_bytes(hf_target)
    d_read, _ = weight_bytes(hf_draft)
    kv_per_token = 2 * tshape["num_hidden_layers"] * tshape["num_key_value_heads"] * (
        tshape["hidden_size"] // tshape["num_attention_heads"]) * dtype.itemsize
    gen = torch.Generator().manual_seed(0)
    vocab = tshape["vocab_size"]

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]

    new1 = 32 if smoke else 256
    p1 = prompts(1)
    hf_tok_s, hf_tokens = (float("nan"), []) if args.spec_only else hf_decode_rate(
        hf_target, p1[0], 16 if smoke else 64, device)

    llm = LLM(model=target_dir, device=device.type, dtype=dname, max_model_len=1024,
              max_num_seqs=256, kv_cache_memory_bytes=(1 if smoke else 24) << 30,
              enable_prefix_caching=False)  # synthetic steps below overwrite KV blocks
    llm.llm_engine.decode_ahead_enabled = not args.no_decode_ahead
    runner = llm.llm_engine.runner
    say(f"target: {t_params / 1e9:.2f} B params, {t_read / 1e9:.2f} GB read per step; "
        f"draft: {d_read / 1e9:.2f} GB; graphs: {runner.graphs is not None}")

    # -- 1. decode at batch 1
    run_engine(llm, p1, 8, "warm")
    freeze()
    tok_s, outs1, _ = run_engine(llm, p1, new1, "b1")
    avg_ctx = PROMPT_LEN + new1 / 2
    bytes_tok = t_read + avg_ctx * kv_per_token
    roof = bw / bytes_tok
    wall1, gpu1 = step_time(runner, 1, 1, int(avg_ctx), 30, argmax=True)  # greedy step
    # The same run with multi-step decoding (num_scheduler_steps): the host enqueues
    # MULTI_STEPS forwards and reads their tokens once. Same engine, switched in place.
    set_scheduler_steps(llm, MULTI_STEPS)
    run_engine(llm, p1, 8, "warm-ms")
    ms_tok_s, outs_ms, _ = run_engine(llm, p1, new1, "b1-ms")
    set_scheduler_steps(llm, 1)
    say(f"multi-step b1 output == one-step output: {outs_ms == outs1}")
    if args.profile:
        profile_decode(llm, p1, args.out)
    graphs_saved = runner.graphs
    eager_tok_s = float("nan")
    if not args.spec_only:
        runner.graphs = None
        eager_tok_s, outs_eager, _ = run_engine(llm, p1, 32, "eager")
        runner.graphs = graphs_saved
        say("\n== 0b. 8B graph replay vs eager")
        for line in graph_vs_eager(llm, device):
            say(line)
        say(f"8B greedy, graphs vs enforce_eager path: "
            f"{agreeing_prefix(outs1[0], outs_eager[0])}/32 tokens agree; vs transformers: "
            f"{agreeing_prefix(outs1[0], hf_tokens)}/{len(hf_tokens)}")
    results["decode_b1"] = dict(tok_s=tok_s, ms_tok_s=ms_tok_s, eager_tok_s=eager_tok_s,
                                hf_tok_s=hf_tok_s,
                                bytes_per_token=bytes_tok, roofline_tok_s=roof,
                                step_wall_s=wall1, step_gpu_s=gpu1)

    # -- 2. throughput
    thr = []
    warm_graphs(runner, (1, 8, 32, 128, 256))
    batches = (1, 8) if smoke else (1, 8, 32, 128, 256)
    if args.spec_only:
        batches = (1, 8) if smoke else (1, 32)
    for b in batches:
        ps = p1 if b == 1 else prompts(b)
        rate, outs, _ = run_engine(llm, ps, 16 if smoke else 128, f"thr{b}")
        set_scheduler_steps(llm, MULTI_STEPS)
        ms_rate, ms_outs, _ = run_engine(llm, ps, 16 if smoke else 128, f"thr{b}-ms")
        set_scheduler_steps(llm, 1)
        thr.append((b, rate, ms_rate, ms_outs == outs))
    # FLOPs per token: 2 per weight multiplied (all but the embedding) + attention (ctx 192)
    flops_tok = 2 * t_read / dtype.itemsize + 4 * tshape["num_hidden_layers"] * tshape[
        "hidden_size"] * (PROMPT_LEN + 64)
    results["throughput"] = thr

    if args.decode_ahead_ab:
        say("\n== 2b. plain greedy decodes launched a step ahead, before or after the read, "
            "vs not (interleaved)")
        gen_ab = torch.Generator().manual_seed(7)  # own prompts: the others' stay as they were
        b32ab = [torch.randint(3, vocab, (PROMPT_LEN,), generator=gen_ab).tolist()
                 for _ in range(2 if smoke else 32)]
        for line in decode_ahead_ab(llm, {1: p1, len(b32ab): b32ab}, 16 if smoke else 256):
            say(line)

    # -- 3. verify cost
    runner.enable_cuda_graphs(256, 9, 1024)
    ver, ver_greedy = {}, {}
    for b in () if args.spec_only else ((1, 2) if smoke else (1, 8, 32)):
        ver[b] = verify_sweep(runner, b, argmax=False)
        # the greedy step the engine runs (lm_head and argmax inside the graph, one read)
        ver_greedy[b] = verify_sweep(runner, b, argmax=True)
    results["verify"] = {b: v for b, v in ver.items()}
    results["verify_greedy"] = {b: v for b, v in ver_greedy.items()}
    captured = len(runner.graphs.graphs) + len(runner.graphs.argmax_graphs) if runner.graphs else 0
    del llm, runner, graphs_saved
    free()

    if args.memory_check and not smoke:
        say("\n== 5. KV cache sized after the profiling pass (gpu_memory_utilization=0.9)")
        try:
            for line in memory_check(target_dir, draft_dir, dname, device, prompts):
                say(line)
        except Exception as exc:  # report, never lose the tables above
            say(f"memory check failed: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
        free()

    # -- 4. speculation at controlled acceptance
    if not args.no_spec:
        llm = LLM(model=target_dir, device=device.type, dtype=dname, max_model_len=1024,
                  max_num_seqs=64, kv_cache_memory_bytes=(1 if smoke else 12) << 30,
                  speculative_model=draft_dir, num_speculative_tokens=K_SPEC,
                  speculative_adaptive=True, enable_prefix_caching=False)
        engine = llm.llm_engine
        # its plain runs (speculation off), and its batches settled on plain decoding
        engine.decode_ahead_enabled = not args.no_decode_ahead
        driver = engine.speculation
        adaptive = driver.adaptive
        replay = ReplayProposer(driver.proposer, {}, 0.0, seed=0)
        driver.proposer = replay
        draft_runner = replay.runner
        b32 = prompts(1 if smoke else 32)
        for r in (engine.runner, draft_runner):  # adaptive k: any rung up to 32 may run
            warm_graphs(r, [b for b in r.graphs.ladder if b <= len(b32)] if r.graphs else ())
        freeze()
        t_target, g_target = step_time(engine.runner, 1, 1, int(avg_ctx), 30, argmax=True)
        t_draft, g_draft = step_time(draft_runner, 1, 1, int(avg_ctx), 30)
        c = t_draft / t_target
        spec = {"c": c, "t_target": t_target, "t_draft": t_draft, "g_target": g_target,
                "g_draft": g_draft}
        rows = []

        breakdown: list[tuple[str, dict]] = []  # (run label, category -> step seconds)
        steps_log = None
        if args.steps_log and args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            steps_log = (args.out / "steps.jsonl").open("w")  # written as the runs go
        step_shape: dict[str, int] = {}  # this step's proposals and draft catch-up tokens
        propose, replay_propose = driver.propose, replay.propose

        def propose_logged(scheduled, sampled, on_device=False, **kwargs):
            out = propose(scheduled, sampled, on_device, **kwargs)
            step_shape["proposals"] = sum(len(p) for p in out[0])
            return out

        def replay_logged(seqs, ks, on_device=False):
            out = replay_propose(seqs, ks, on_device)
            step_shape["catch_up"] = step_shape.get("catch_up", 0) + out.num_catch_up_tokens
            return out

        driver.propose, replay.propose = propose_logged, replay_logged

        # Per step, for the steps log: wall time inside the target runner's calls, and GPU
        # time of the CUDA graphs replayed (events around each replay), to tell host work
        # outside the runner, host work inside it and GPU time apart.
        runner = engine.runner
        for name in ("execute_argmax", "execute", "execute_argmax_device", "execute_argmax_steps"):
            original = getattr(runner, name)

            def in_runner(*args, _fn=original, **kwargs):
                t = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    step_shape["runner"] = step_shape.get("runner", 0.0) + time.perf_counter() - t
            setattr(runner, name, in_runner)
        graph_replay = torch.cuda.CUDAGraph.replay

        def replay_timed(graph):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph_replay(graph)
            end.record()
            step_shape.setdefault("events", []).append((start, end))

        if steps_log is not None and torch.cuda.is_available():
            torch.cuda.CUDAGraph.replay = replay_timed

        def timed_engine_steps(label: str):
            """Wrap engine.step: every step's wall time, by kind (plain / speculating /
            speculating with a draft catch-up over more than CATCH_UP_MEASURED tokens per
            proposing sequence); returns the restore function."""
            cats: dict[str, list[float]] = {}
            breakdown.append((label, cats))
            step = engine.step

            def timed():
                # No sync after the step: a speculative step ends with the next step's draft
                # proposals launched on the device (DraftModelProposer.launch_ahead), and
                # waiting for them here would undo the overlap it is for. Every step still
                # ends in its own read of the target's tokens; a step's time then holds the
                # device time of the draft launched at the end of the step before.
                events = step_shape.pop("events", [])  # replays still running last time
                step_shape.clear()
                step_shape["events"] = events
                t0 = time.perf_counter()
                out = step()
                dt = time.perf_counter() - t0
                props, catch = step_shape.get("proposals", 0), step_shape.get("catch_up", 0)
                kind = ("plain" if props == 0 else
                        "spec+catch-up" if catch > 4 * max(props // K_SPEC, 1) else "spec")
                cats.setdefault(kind, []).append(dt)
                cats.setdefault(f"{kind} proposals", []).append(props)
                if steps_log is not None:
                    cap = adaptive.last_cap if driver.adaptive is not None else None
                    done = [(a, b) for a, b in step_shape.get("events", ()) if b.query()]
                    gpu = sum(a.elapsed_time(b) for a, b in done)
                    step_shape["events"] = [e for e in step_shape.get("events", ())
                                            if e not in done]  # counted with the next step
                    steps_log.write(json.dumps(dict(
                        run=label, ms=round(1e3 * dt, 2), proposals=props, catch_up=catch,
                        cap=cap, batch=sum(1 for r in engine.requests.values()
                                           for q in r.seqs if not q.is_finished),
                        finished=sum(o.finished for o in out),
                        runner_ms=round(1e3 * step_shape.get("runner", 0.0), 2),
                        graph_gpu_ms=round(gpu, 2))) + "\n")
                    steps_log.flush()
                return out

            engine.step = timed
            return lambda: setattr(engine, "step", step)

        last_spec_steps = [0]  # speculative steps of the last spec_run

        def spec_run(ps, new, acceptance, adaptive_on):
            """(tok/s, outputs, measured a, (share of decode steps that speculated, engine
            steps over STALL_SECONDS: one-time compiles))"""
            driver.adaptive = adaptive if adaptive_on else None
            replay.acceptance = acceptance
            replay.reset_counts()
            before = copy.deepcopy(driver.metrics.total)
            compiled_before = len(COMPILED)
            step_seconds: list[float] = []
            observe_step = driver.observe_step
            driver.observe_step = lambda t: (step_seconds.append(t), observe_step(t))
            restore = timed_engine_steps(
                f"b{len(ps)} a={acceptance}{' adaptive' if adaptive_on else ''}")
            try:
                rate, outs, steps = run_engine(llm, ps, new, f"spec{acceptance}")
            finally:
                restore()
            driver.observe_step = observe_step
            slow = [t for t in step_seconds if t > STALL_SECONDS]
            for name, signature in COMPILED[compiled_before:]:
                say(f"  compiled during spec a={acceptance} b={len(ps)}: {name} {signature}")
            d = driver.metrics.total.minus(before)
            share = d.num_spec_steps / max(d.num_spec_steps + d.num_non_spec_decode_steps, 1)
            last_spec_steps[0] = d.num_spec_steps
            return (rate, outs, replay.per_token_acceptance,
                    (share, f"{len(slow)} / {sum(slow):.2f} s"))

        # calibration: every proposal rejected, so each step commits the target's greedy token at
        # verification numerics; that continuation is what the replay proposes afterwards
        _, calib, _, _ = spec_run(p1, new1, 0.0, False)
        replay.continuations = {tuple(p1[0]): calib[0]}
        for a in ACCEPTANCES:
            rate, outs, acc, stats = spec_run(p1, new1, a, False)
            ideal = ideal_speedup(acc, K_SPEC, c)
            rows.append((1, a, acc, rate, rate / tok_s, ideal, outs[0] == calib[0], *stats))
        new32 = 16 if smoke else 128
        plain = {b: rate for b, rate, *_ in thr}
        plain32 = plain.get(32) or plain[8]
        _, calib32, _, _ = spec_run(b32, new32, 0.0, False)
        replay.continuations.update({tuple(p): o for p, o in zip(b32, calib32, strict=True)})

        def plain_run(ps, new) -> float:
            """Plain decoding in this same engine (speculation switched off for the run):
            the batch-32 baseline measured right beside each speculative run, so that drift
            between sections does not pass for a speedup or a loss."""
            engine.speculation = None
            restore = timed_engine_steps(f"b{len(ps)} plain")
            try:
                return run_engine(llm, ps, new, "plain32")[0]
            finally:
                restore()
                engine.speculation = driver

        plain_beside = []
        pair_ratios: list[list[float]] = []
        pairs_in_order: list[list[tuple[float, int]]] = []  # (speedup, speculative steps)
        for a in ACCEPTANCES:
            # An unmeasured pass first: adaptive k runs draft catch-ups and batch shapes that
            # fixed k never does, and their one-time compiles (~0.3-0.8 s each) would
            # otherwise land in a run of ~1 s.
            spec_run(b32, new32, a, True)
            # B32_PAIRS pairs of runs, plain and speculative, in alternating order; the
            # speedup is the median pair's. (Until session 15: the faster of two runs each,
            # where plain runs of one engine spread 823-904 ms.)
            measured = []  # (speedup, plain tok/s, spec_run's result)
            pairs_in_order.append([])
            for pair in range(B32_PAIRS):
                if pair % 2 == 0:
                    base = plain_run(b32, new32)
                    result = spec_run(b32, new32, a, True)
                else:
                    result = spec_run(b32, new32, a, True)
                    base = plain_run(b32, new32)
                measured.append((result[0] / base, base, result))
                pairs_in_order[-1].append((result[0] / base, last_spec_steps[0]))
            measured.sort(key=lambda m: m[0])
            speedup, base, (rate, outs, acc, stats) = measured[len(measured) // 2]
            pair_ratios.append([m[0] for m in measured])
            plain_beside.append(base)
            same = sum(o == r for o, r in zip(outs, calib32, strict=True))
            rows.append((len(b32), a, acc, rate, speedup, float("nan"),
                         f"{same}/{len(b32)}", *stats))
        spec["b32_pair_ratios"] = pair_ratios
        spec["b32_pairs_in_order"] = pairs_in_order
        base = plain_run(b32, new32)
        rate, outs, acc, stats = spec_run(b32, new32, 0.9, False)  # without adaptivity
        plain_beside.append(base)
        same = sum(o == r for o, r in zip(outs, calib32, strict=True))
        rows.append((len(b32), "0.9 fixed k", acc, rate, rate / base, float("nan"),
                     f"{same}/{len(b32)}", *stats))
        if args.profile_spec_steps:
            driver.adaptive = None
            replay.acceptance = 0.9
            spec["profile_spec_steps"] = profile_spec_steps(engine, driver, b32, new32, args.out)
        if args.profile_steady_steps:
            driver.adaptive = adaptive  # the policy as users get it, at the hardest rate
            replay.acceptance = 0.5
            spec["profile_steady"] = profile_steady_steps(engine, b32, new32, args.out)
        if args.profile_caps:
            say("\n== 4h. host time per function of steady batch-32 steps, plain and cap 1")
            spec["profile_caps"] = profile_caps(engine, driver, replay, b32, new32, args.out)
            for line in spec["profile_caps"]:
                say(line)
            say("\n== 4h'. the same at batch 1")
            spec["profile_caps_b1"] = profile_caps(engine, driver, replay, b32[:1], new32,
                                                   args.out and args.out / "b1")
            for line in spec["profile_caps_b1"]:
                say(line)
        if args.timeline:
            say("\n== 4f. where batch-32 steps leave the GPU idle (per engine phase)")
            spec["timeline"] = timeline(engine, driver, replay, adaptive, b32, new32,
                                      args.out)
            for line in spec["timeline"]:
                say(line)
        if args.settled_ab:
            say("\n== 4g. a batch that never speculates: speculative engine against plain (A/A/B)")
            spec["settled_ab"] = settled_ab(llm, driver, adaptive, replay, b32, new32)
            for line in spec["settled_ab"]:
                say(line)
        if args.catch_up_sweep:
            spec["catch_up_sweep"] = catch_up_sweep(draft_runner, engine.runner, len(b32),
                                                    args.out)
        spec["breakdown"] = breakdown
        spec["plain32_beside"] = plain_beside
        spec["plain32_section2"] = plain32
        spec["rows"] = rows
        results["spec"] = spec
        llm = engine = driver = replay = draft_runner = None  # free the engine before compiling
        free()

    # -- 1b. transformers static cache + torch.compile (last: slow and may fail)
    compiled = "skipped"
    if not smoke and not args.skip_compile:
        if time.perf_counter() - t_start > args.compile_deadline:
            compiled = "skipped (time budget)"
        else:
            try:
                hf_target.generation_config.cache_implementation = "static"
                hf_target.forward = torch.compile(hf_target.forward, fullgraph=True)
                rate, _ = hf_decode_rate(hf_target, p1[0], 64, device)
                compiled = f"{rate:.1f} tok/s"
                results["hf_compile_tok_s"] = rate
            except Exception as exc:  # report, never fail the benchmark
                compiled = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                traceback.print_exc()

    # -- tables
    d = results["decode_b1"]
    say("\n== 1. decode, batch 1 (128-token prompt, 256 new tokens), Llama-3-8B shape bf16")
    say("| run | tok/s | ms/token | bytes/token | % of roofline | vs transformers eager |")
    say("|---|---|---|---|---|---|")
    say(f"| specserve, CUDA graphs (end to end) | {d['tok_s']:.1f} | {1e3 / d['tok_s']:.2f} | "
        f"{bytes_tok / 1e9:.2f} GB | {100 * d['tok_s'] / roof:.1f}% | "
        f"{d['tok_s'] / hf_tok_s:.1f}x |")
    say(f"| specserve, CUDA graphs, num_scheduler_steps={MULTI_STEPS} (end to end) | "
        f"{d['ms_tok_s']:.1f} | {1e3 / d['ms_tok_s']:.2f} | {bytes_tok / 1e9:.2f} GB | "
        f"{100 * d['ms_tok_s'] / roof:.1f}% | {d['ms_tok_s'] / hf_tok_s:.1f}x |")
    say(f"| specserve, one greedy step: execute_argmax() wall | {1 / wall1:.1f} | "
        f"{1e3 * wall1:.2f} | | "
        f"{100 / wall1 / roof:.1f}% | |")
    say(f"| specserve, one greedy step: graph replay GPU time (with lm_head, argmax) | "
        f"{1 / gpu1:.1f} | {1e3 * gpu1:.2f} | | "
        f"{100 / gpu1 / roof:.1f}% | |")
    say(f"| specserve enforce_eager path | {eager_tok_s:.1f} | {1e3 / eager_tok_s:.2f} | | "
        f"{100 * eager_tok_s / roof:.1f}% | {eager_tok_s / hf_tok_s:.1f}x |")
    say(f"| transformers generate, eager | {hf_tok_s:.1f} | {1e3 / hf_tok_s:.2f} | | "
        f"{100 * hf_tok_s / roof:.1f}% | 1.0x |")
    say(f"| transformers static cache + torch.compile | {compiled} | | | | |")
    say(f"roofline: {bytes_tok / 1e9:.3f} GB / {bw / 1e12:.2f} TB/s = {1e3 / roof:.2f} ms "
        f"= {roof:.0f} tok/s")

    say("\n== 2. throughput (128-token prompts, 128 new tokens, greedy)")
    say(f"| batch | decode tok/s | % of bf16 matmul ceiling | num_scheduler_steps={MULTI_STEPS} "
        "tok/s | same tokens |")
    say("|---|---|---|---|---|")
    for b, rate, ms_rate, same in thr:
        say(f"| {b} | {rate:.0f} | {100 * rate * flops_tok / mm:.1f}% | {ms_rate:.0f} | {same} |")

    say("\n== 3. verify cost: step with k+1 query tokens / plain decode step (context 512)")
    say("| batch | measure | decode ms | " + " | ".join(f"k={k}" for k in range(1, 9)) + " |")
    say("|---|---|---|" + "---|" * 8)
    for sweep, wall_label, graph_label in ((ver, "execute() wall", "graph GPU"),
                                           (ver_greedy, "greedy: execute_argmax() wall",
                                            "greedy: graph GPU")):
        for b, v in sweep.items():
            w0, g0 = v[0]
            say(f"| {b} | {wall_label} | {1e3 * w0:.2f} | "
                + " | ".join(f"{w / w0:.3f}" for w, _ in v[1:]) + " |")
            say(f"| {b} | {graph_label} | {1e3 * g0:.2f} | "
                + " | ".join(f"{g / g0:.3f}" for _, g in v[1:]) + " |")

    if not args.no_spec:
        say(f"\n== 4. speculative decoding, 1B-shaped draft, k={K_SPEC}, replayed proposals")
        say(f"c = draft step / target step = {1e3 * t_draft:.2f} / {1e3 * t_target:.2f} ms = {c:.3f}"
            f" (GPU graph replay: {1e3 * g_draft:.2f} / {1e3 * g_target:.2f} ms)")
        say("measured a: per-position acceptance, accepted / (accepted + rejections)")
        say("| batch | target a | measured a | tok/s | speedup | ideal | % of ideal | "
            f"output == calibration | steps speculating | steps > {STALL_SECONDS} s |")
        say("|---|---|---|---|---|---|---|---|---|---|")
        for b, a, acc, rate, sp, ideal, same, share, stall in rows:
            pct = f"{100 * sp / ideal:.0f}%" if ideal == ideal else "-"
            ideal_s = f"{ideal:.2f}x" if ideal == ideal else "-"
            say(f"| {b} | {a} | {acc:.3f} | {rate:.1f} | {sp:.2f}x | {ideal_s} | {pct} | {same} "
                f"| {100 * share:.0f}% | {stall} |")
        if spec.get("plain32_beside"):
            say(f"batch-32 adaptive rows: the median of {B32_PAIRS} interleaved pairs of runs "
                "(plain decoding in the same engine, then speculative, or the reverse); every "
                "pair's speedup: " + "; ".join(
                    f"a = {a}: " + ", ".join(f"{r:.3f}" for r in ratios)
                    for a, ratios in zip(ACCEPTANCES, spec["b32_pair_ratios"], strict=True))
                + ". Plain runs of the median pairs: "
                + ", ".join(f"{r:.0f}" for r in spec["plain32_beside"])
                + f" tok/s (section 2: {spec['plain32_section2']:.0f}); the 0.9 fixed-k row: "
                "one pair")
        for a, pairs in zip(ACCEPTANCES, spec.get("b32_pairs_in_order", []), strict=False):
            # batches that never speculated (skipped learning, or learned and settled plainly
            # in one step) against those that went on speculating
            quiet = [r for r, n in pairs if n <= 1]
            busy = [r for r, n in pairs if n > 1]
            say(f"  a = {a}, pairs in run order (speculative steps of the batch): " + ", ".join(
                f"{r:.3f} ({n})" for r, n in pairs) + "; median of batches with <= 1 "
                f"speculative step {statistics.median(quiet) if quiet else float('nan'):.3f} "
                f"({len(quiet)}), of the others "
                f"{statistics.median(busy) if busy else float('nan'):.3f} ({len(busy)})")
        runs_with_gc = {k: v for k, v in GC_IN_RUNS.items() if v[0]}
        say("full garbage collections inside timed runs: " + (", ".join(
            f"{k} {n} ({1e3 * t:.0f} ms)" for k, (n, t) in runs_with_gc.items()) or "none"))
    if not args.no_spec and spec.get("profile_spec_steps"):
        say("\n== 4d. first decode steps of a batch-32 speculative run, profiled")
        for line in spec["profile_spec_steps"]:
            say(line)
    if not args.no_spec and spec.get("profile_steady"):
        say("\n== 4e. steady-state batch-32 speculative steps, host profile (a = 0.5, adaptive)")
        for line in spec["profile_steady"][:70]:
            say(line)
    if not args.no_spec and spec.get("catch_up_sweep"):
        say("\n== 4c. draft catch-up and target pass cost by tokens per sequence")
        for line in spec["catch_up_sweep"]:
            say(line)
    if not args.no_spec:
        say("\n== 4b. engine steps by kind (every step of each run, first-token steps included)")
        say("| run | kind | steps | median ms | mean ms | total s | mean proposals |")
        say("|---|---|---|---|---|---|---|")
        for label, cats in spec["breakdown"]:
            for kind in ("plain", "spec", "spec+catch-up"):
                ts = cats.get(kind)
                if ts:
                    props = cats[f"{kind} proposals"]
                    say(f"| {label} | {kind} | {len(ts)} | {1e3 * statistics.median(ts):.2f} | "
                        f"{1e3 * statistics.fmean(ts):.2f} | {sum(ts):.3f} | "
                        f"{statistics.fmean(props):.1f} |")
    say(f"\ngraphs captured in the verify sweep: {captured}; total {time.perf_counter() - t_start:.0f} s")
    return finish(args, results)


if __name__ == "__main__":
    sys.exit(main())
