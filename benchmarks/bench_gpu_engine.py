"""Run the engine once on a GPU: correctness against transformers, then Llama-3-8B-shaped speed.

One script for one device call (issue 2). It prints a table last; with --out it also writes the
numbers as JSON there.

  1. copy bandwidth: a large device-to-device copy, (bytes read + bytes written) / time;
  2. correctness (tests/gpu/check_cuda_engine.py): tiny random Llama (2 layers, hidden 256, GQA)
     in float32 and bfloat16, ``specserve.LLM`` vs transformers ``generate``, greedy; float32
     must match exactly;
  3. a random-weight Llama-3-8B-shaped bf16 checkpoint (hidden 4096, 32 layers, 32 heads / 8 KV
     heads, MLP 14336, vocab 128256, rope_theta 5e5 with llama3 scaling), built directly on the
     GPU, timed under transformers generate (batch 1), saved with safetensors, loaded by
     ``LLM(model=dir, device="cuda", dtype="bfloat16", max_model_len=1024,
     gpu_memory_utilization=0.85)`` and timed greedy at batch 1 (128-token prompt, 256 new
     tokens) and batch 32 (128-token prompts, 128 new tokens each), EOS ignored.

Roofline: a decode step must read every weight it multiplies by once (all parameters except the
token-embedding table, of which it reads one row per token) plus the KV of the whole context;
that many bytes over the measured copy bandwidth is the fastest possible step.

Usage:
  python benchmarks/bench_gpu_engine.py                 # on a GPU machine
  python benchmarks/bench_gpu_engine.py --smoke         # CPU, tiny shapes, minutes: shakes out bugs
  python benchmarks/bench_gpu_engine.py --layers 8      # fewer layers if disk/time is short
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# tests/ first (checkpoints.py); the repo last, so a PYTHONPATH copy of specserve wins over it.
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from checkpoints import build_tokenizer  # noqa: E402  (tests/checkpoints.py)

from specserve import LLM, SamplingParams  # noqa: E402


def _load_check_module():
    path = REPO / "tests" / "gpu" / "check_cuda_engine.py"
    spec = importlib.util.spec_from_file_location("check_cuda_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


CHECK = _load_check_module()  # tests/gpu/check_cuda_engine.py
# Llama-3-8B's shape (Meta-Llama-3-8B config.json), rope scaling as in Llama 3.1.
LLAMA3_8B = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
)
ROPE_8B = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# --smoke: the same code over shapes a CPU runs in seconds (vocab kept: it exercises detokenising
# ids the small test tokenizer does not know, as the 8B run does).
SMOKE_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256)
INIT_STD = 0.02  # small random normals (Llama's initializer_range)
PROMPT_LEN = 128


@dataclass
class Workload:
    prompt_len: int = PROMPT_LEN
    b1_new: int = 256
    b32_batch: int = 32
    b32_new: int = 128
    hf_new: int = 64
    warmup_new: int = 8


SMOKE_WORKLOAD = Workload(b1_new=16, b32_batch=4, b32_new=8, hf_new=8, warmup_new=2)


@dataclass
class RunTiming:
    label: str
    batch: int
    new_tokens: int
    total_s: float
    ttft_s: float  # until every sequence has its first token (prefill)
    decode_s: float  # the rest
    decode_tokens: int
    step_ms_median: float

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def e2e_tok_s(self) -> float:
        return self.batch * self.new_tokens / self.total_s


@dataclass
class Report:
    device: str
    torch_version: str
    copy_bw: float = 0.0  # bytes/s
    checks: list = field(default_factory=list)
    shape: dict = field(default_factory=dict)
    layers_note: str = ""
    weight_bytes_total: int = 0
    weight_bytes_read: int = 0
    kv_bytes_per_token: int = 0
    times_s: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    runs: list = field(default_factory=list)
    hf: RunTiming | None = None
    hf_engine_agree: str = ""
    notes: list = field(default_factory=list)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- 1. bandwidth ----------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> float:
    """Median (bytes read + written) / time of dst.copy_(src) over random float32 data."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    assert torch.equal(dst, src), "copy did not copy"
    del src, dst
    free_memory()
    return 2 * nbytes / statistics.median(times)


# ---- 3. the 8B-shaped model --------------------------------------------------------------------
def build_random_llama(shape: dict, device: torch.device, seed: int = 0):
    """transformers LlamaForCausalLM, bf16, allocated and filled on `device` (no CPU init)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**shape, rope_parameters=dict(ROPE_8B), dtype=torch.bfloat16,
                      initializer_range=INIT_STD, pad_token_id=None)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # re-fill: what HF's init did is not ours to rely on
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD, generator=gen)
            else:
                p.fill_(1.0)
    return model.eval()


def hf_greedy_timed(model, prompt: list[int], new_tokens: int, device: torch.device):
    """Time transformers generate at batch 1; decode rate from (N tokens) - (1 token) runs."""
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)

    def run(n: int):
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, generation_config=cfg, attention_mask=mask)
        sync(device)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    run(4)  # warm-up
    t1 = min(run(1)[0] for _ in range(2))
    tn, tokens = run(new_tokens)
    timing = RunTiming("transformers generate", 1, new_tokens, tn, t1, tn - t1, new_tokens - 1,
                       1e3 * (tn - t1) / max(new_tokens - 1, 1))
    return timing, tokens


def engine_timed(llm: LLM, label: str, prompts: list[list[int]], new_tokens: int) -> tuple[
        RunTiming, list[list[int]]]:
    """Drive the engine step by step: time to all first tokens, then the decode steps."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rids = [f"{label}-{i}" for i in range(len(prompts))]
    counts = dict.fromkeys(rids, 0)
    finished = {}
    step_times = []
    t_first = None
    sync(engine.device)
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=p)
    while engine.has_unfinished_requests():
        decoding = t_first is not None
        ts = time.perf_counter()
        outs = engine.step()  # ends in a host sync (sampled tokens -> list)
        te = time.perf_counter()
        for o in outs:
            counts[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                finished[o.request_id] = o.outputs[0].token_ids
        if decoding:
            step_times.append(te - ts)
        elif all(c >= 1 for c in counts.values()):
            t_first = te
    sync(engine.device)
    t_end = time.perf_counter()
    tokens = [list(finished[r]) for r in rids]
    assert all(len(t) == new_tokens for t in tokens), [len(t) for t in tokens]
    n = len(prompts)
    timing = RunTiming(label, n, new_tokens, t_end - t0, t_first - t0, t_end - t_first,
                       n * (new_tokens - 1),
                       1e3 * statistics.median(step_times) if step_times else float("nan"))
    return timing, tokens


def roofline(report: Report, batch: int, avg_ctx: float) -> tuple[float, float]:
    """(bytes one decode step must move, ideal tokens/s) at this batch and mean context."""
    step_bytes = report.weight_bytes_read + batch * avg_ctx * report.kv_bytes_per_token
    return step_bytes, batch * report.copy_bw / step_bytes


def bench_big_model(args, device: torch.device, report: Report, work: Workload) -> None:
    shape = dict(LLAMA3_8B)
    if args.smoke:
        shape.update(SMOKE_SHAPE)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    report.shape = shape
    rng = torch.Generator().manual_seed(1)
    vocab = shape["vocab_size"]

    def rand_prompts(n):
        return torch.randint(0, vocab, (n, work.prompt_len), generator=rng).tolist()

    t0 = time.perf_counter()
    model = build_random_llama(shape, device)
    sync(device)
    report.times_s["build on device"] = time.perf_counter() - t0
    params = list(model.parameters())
    report.weight_bytes_total = sum(p.numel() * p.element_size() for p in params)
    embed = model.get_input_embeddings().weight
    report.weight_bytes_read = report.weight_bytes_total - embed.numel() * embed.element_size()
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    report.kv_bytes_per_token = (2 * shape["num_hidden_layers"] * shape["num_key_value_heads"]
                                 * head_dim * 2)
    print(f"[8B] built {report.weight_bytes_total / 1e9:.2f} GB of bf16 weights on {device} in "
          f"{report.times_s['build on device']:.1f}s", flush=True)

    b1_prompt = rand_prompts(1)[0]
    report.hf, hf_tokens = hf_greedy_timed(model, b1_prompt, work.hf_new, device)
    print(f"[8B] transformers: {report.hf.decode_tok_s:.1f} tok/s decode", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="llama3_8b_shape_", dir=args.workdir))
    try:
        free_disk = shutil.disk_usage(workdir).free
        print(f"[8B] saving to {workdir} (disk free {free_disk / 1e9:.1f} GB)", flush=True)
        t0 = time.perf_counter()
        model.save_pretrained(str(workdir), max_shard_size="4GB")
        build_tokenizer(workdir)
        report.times_s["save_pretrained"] = time.perf_counter() - t0
        print(f"[8B] saved in {report.times_s['save_pretrained']:.1f}s", flush=True)
        del model, params, embed
        free_memory()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        llm = LLM(model=str(workdir), device=device.type, dtype="bfloat16", max_model_len=1024,
                  gpu_memory_utilization=0.85,
                  **({"kv_cache_memory_bytes": 256 << 20} if device.type == "cpu" else {}))
        report.times_s["LLM() load"] = time.perf_counter() - t0
        report.memory["kv_blocks"] = llm.llm_engine.runner.num_blocks
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            report.memory.update({
                "allocated_GB": torch.cuda.memory_allocated(device) / 1e9,
                "reserved_GB": torch.cuda.memory_reserved(device) / 1e9,
                "peak_allocated_during_load_GB": torch.cuda.max_memory_allocated(device) / 1e9,
                "device_used_GB": (total - free) / 1e9,
                "device_total_GB": total / 1e9,
            })
        print(f"[8B] LLM() ready in {report.times_s['LLM() load']:.1f}s; memory {report.memory}",
              flush=True)

        llm.generate([{"prompt_token_ids": p} for p in rand_prompts(2)],
                     SamplingParams(temperature=0.0, max_tokens=work.warmup_new, ignore_eos=True),
                     use_tqdm=False)  # warm-up through the public API
        b1, b1_tokens = engine_timed(llm, "specserve b=1", [b1_prompt], work.b1_new)
        print(f"[8B] engine b=1: {b1.decode_tok_s:.1f} tok/s decode", flush=True)
        bn, _ = engine_timed(llm, f"specserve b={work.b32_batch}", rand_prompts(work.b32_batch),
                             work.b32_new)
        print(f"[8B] engine b={work.b32_batch}: {bn.decode_tok_s:.1f} tok/s decode", flush=True)
        report.runs = [b1, bn]
        n = min(len(hf_tokens), len(b1_tokens[0]))
        agree = CHECK.agreeing_prefix(b1_tokens[0][:n], hf_tokens[:n])
        report.hf_engine_agree = (f"first {agree}/{n} greedy tokens agree with transformers "
                                  "(bf16, batch 1, same prompt)")
        del llm
        free_memory()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---- --diagnose: where a step's time goes, and bf16/fp32 agreement at the 8B shape -------------
def _start_decoding(engine, label: str, prompts: list[list[int]], new_tokens: int) -> list[str]:
    """Add requests and step until every one has its first token (prefill done)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rids = [f"{label}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=p)
    counts = dict.fromkeys(rids, 0)
    while not all(c >= 1 for c in counts.values()):
        for o in engine.step():
            counts[o.request_id] = len(o.outputs[0].token_ids)
    return rids


def profile_decode(llm: LLM, prompts: list[list[int]], steps: int, out_dir: Path | None) -> dict:
    """Per decode step: wall time, time inside runner.execute (synced), GPU kernel time and
    kernel count (torch.profiler), and the kernels that take the most GPU time."""
    from collections import Counter

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    device = engine.device
    label = f"prof-b{len(prompts)}"
    rids = _start_decoding(engine, label, prompts, 3 * steps + 4)
    runner = engine.runner
    original = runner.execute
    inside: list[float] = []

    def timed_execute(*a, **k):
        sync(device)
        t = time.perf_counter()
        result = original(*a, **k)
        sync(device)
        inside.append(time.perf_counter() - t)
        return result

    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    runner.execute = timed_execute
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_synced = (time.perf_counter() - t0) / steps
    runner.execute = original
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    for rid in rids:
        engine.abort_request(rid)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: Counter = Counter()
    for e in kernels:
        by_name[e.name[:60]] += e.time_range.elapsed_us()
    result = {
        "batch": len(prompts),
        "step_ms": 1e3 * wall,
        "execute_ms": 1e3 * statistics.median(inside),
        "step_ms_with_synced_execute": 1e3 * wall_synced,
        "gpu_kernel_ms": sum(by_name.values()) / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps,
        "top_kernels_ms": {k: v / 1e3 / steps for k, v in by_name.most_common(8)},
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
        (out_dir / f"profile_b{len(prompts)}.txt").write_text(table)
    return result


def first_token_logprobs(llm: LLM, prompt: list[int], top: int) -> dict[int, float]:
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=top, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def greedy_tokens(llm: LLM, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def diagnose(args, device: torch.device, work: Workload) -> list[str]:
    """One call: build + save the 8B-shaped checkpoint; transformers references in bf16 and fp32;
    engine bf16 (first-token logprob error, profiled decode steps at batch 1 and 32) and engine
    fp32 (greedy tokens must equal transformers fp32's)."""
    from transformers import GenerationConfig

    shape = dict(LLAMA3_8B)
    if args.smoke:
        shape.update(SMOKE_SHAPE)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    vocab = shape["vocab_size"]
    rng = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (work.prompt_len,), generator=rng).tolist()
    batch = torch.randint(0, vocab, (work.b32_batch, work.prompt_len), generator=rng).tolist()
    n_greedy, top, steps = 32, 20, (4 if args.smoke else 10)
    out_dir = Path(args.out) if args.out else None
    lines = []

    model = build_random_llama(shape, device)
    workdir = Path(tempfile.mkdtemp(prefix="llama3_8b_shape_", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        model.save_pretrained(str(workdir), max_shard_size="4GB")
        build_tokenizer(workdir)
        lines.append(f"saved in {time.perf_counter() - t0:.1f}s")
        ids = torch.tensor([prompt], device=device)
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            lp_hf_bf16 = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
            model.float()
            lp_ref = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
            cfg = GenerationConfig(max_new_tokens=n_greedy, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
            hf32 = model.generate(ids, generation_config=cfg,
                                  attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
        del model
        free_memory()
        top2 = lp_ref.topk(2).values
        lines.append(f"fp32 reference: first-token top-1 minus top-2 logprob gap "
                     f"{(top2[0] - top2[1]).item():.4f}; transformers bf16 top-1 is "
                     f"{'the same' if lp_hf_bf16.argmax() == lp_ref.argmax() else 'DIFFERENT'}")

        llm = LLM(model=str(workdir), device=device.type, dtype="bfloat16", max_model_len=1024,
                  gpu_memory_utilization=0.85, max_num_seqs=64)
        lp_eng = first_token_logprobs(llm, prompt, top)
        toks = torch.tensor(list(lp_eng), device=device)
        eng_vals = torch.tensor(list(lp_eng.values()), device=device)
        err_eng = (eng_vals - lp_ref[toks]).abs().max().item()
        err_hf = (lp_hf_bf16[toks] - lp_ref[toks]).abs().max().item()
        eng_top1 = max(lp_eng, key=lp_eng.get)
        lines.append(f"bf16 first-token logprobs vs fp32 reference, max |err| over the engine's "
                     f"top-{top}: engine {err_eng:.4f}, transformers bf16 {err_hf:.4f}; engine "
                     f"top-1 {'==' if eng_top1 == int(lp_ref.argmax()) else '!='} fp32 top-1")
        for prompts in ([prompt], batch):
            r = profile_decode(llm, prompts, steps, out_dir)
            top_k = ", ".join(f"{k} {v:.2f}" for k, v in list(r["top_kernels_ms"].items())[:6])
            lines.append(f"batch {r['batch']:2d}: step {r['step_ms']:.1f} ms (with synced execute "
                         f"{r['step_ms_with_synced_execute']:.1f}), runner.execute "
                         f"{r['execute_ms']:.1f} ms, GPU kernels {r['gpu_kernel_ms']:.1f} ms in "
                         f"{r['kernels_per_step']:.0f} launches/step; top: {top_k}")
        del llm
        free_memory()

        llm = LLM(model=str(workdir), device=device.type, dtype="float32", max_model_len=1024,
                  gpu_memory_utilization=0.85, max_num_seqs=8)
        eng32 = greedy_tokens(llm, prompt, n_greedy)
        lp32 = first_token_logprobs(llm, prompt, top)
        toks = torch.tensor(list(lp32), device=device)
        err32 = (torch.tensor(list(lp32.values()), device=device) - lp_ref[toks]).abs().max()
        agree = CHECK.agreeing_prefix(eng32, hf32)
        lines.append(f"fp32 engine vs transformers fp32 (8B shape, greedy): {agree}/{n_greedy} "
                     f"tokens agree ({'PASS' if agree == n_greedy else 'FAIL'}); first-token "
                     f"logprob max |err| {err32.item():.2e}")
        del llm
        free_memory()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return lines


# ---- table ------------------------------------------------------------------------------------
def format_table(report: Report, work: Workload, check_table: str) -> str:
    gb = 1e9
    lines = ["", "=" * 100,
             f"device: {report.device} | torch {report.torch_version}",
             f"copy bandwidth (read+write): {report.copy_bw / 1e12:.2f} TB/s", "",
             "correctness (tiny Llama, engine batch vs transformers generate, greedy):",
             check_table]
    if report.runs:
        s = report.shape
        lines += ["",
                  f"model: Llama-3-8B-shaped, random bf16, {s['num_hidden_layers']} layers, "
                  f"hidden {s['hidden_size']}, heads {s['num_attention_heads']}/"
                  f"{s['num_key_value_heads']}, vocab {s['vocab_size']}: "
                  f"{report.weight_bytes_total / gb:.2f} GB weights, "
                  f"{report.weight_bytes_read / gb:.2f} GB read per decode step (all but the "
                  f"embedding table), KV {report.kv_bytes_per_token / 1024:.0f} KiB/token"]
        if report.layers_note:
            lines.append(report.layers_note)
        lines.append("times: " + ", ".join(f"{k} {v:.1f}s" for k, v in report.times_s.items()))
        if report.memory:
            lines.append("memory: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in report.memory.items()))
        lines += ["",
                  f"{'run':24} {'batch':>5} {'new':>4} {'prefill s':>9} {'step ms':>8} "
                  f"{'decode tok/s':>12} {'e2e tok/s':>9} {'ideal tok/s':>11} {'% roofline':>10}"]
        rows = [(report.hf, work.prompt_len + work.hf_new / 2)] if report.hf else []
        rows += [(r, work.prompt_len + r.new_tokens / 2) for r in report.runs]
        for r, avg_ctx in rows:
            _, ideal = roofline(report, r.batch, avg_ctx)
            lines.append(f"{r.label:24} {r.batch:5d} {r.new_tokens:4d} {r.ttft_s:9.3f} "
                         f"{r.step_ms_median:8.2f} {r.decode_tok_s:12.1f} {r.e2e_tok_s:9.1f} "
                         f"{ideal:11.1f} {100 * r.decode_tok_s / ideal:9.1f}%")
        b1 = report.runs[0]
        if report.hf:
            lines.append(f"engine / transformers decode at batch 1: "
                         f"{b1.decode_tok_s / report.hf.decode_tok_s:.2f}x; "
                         f"{report.hf_engine_agree}")
        step_bytes, _ = roofline(report, 1, work.prompt_len + b1.new_tokens / 2)
        lines.append(f"roofline: a step's bytes / copy bandwidth; batch 1 moves {step_bytes / gb:.2f}"
                     f" GB -> {1e3 * step_bytes / report.copy_bw:.2f} ms/step at best. Counting the "
                     f"whole embedding table too ({report.weight_bytes_total / gb:.2f} GB) would "
                     "lower the ideal by "
                     f"{100 * (1 - report.weight_bytes_read / report.weight_bytes_total):.1f}%.")
    lines += report.notes
    lines.append("=" * 100)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny shapes: check the script itself before using a GPU")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument("--layers", type=int, default=None,
                        help="fewer decoder layers than 32 (disk or time is short)")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--diagnose", action="store_true",
                        help="instead of timing: profile decode steps; bf16/fp32 agreement at 8B")
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--workdir", default=None, help="where the checkpoint is written")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON report")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    work = SMOKE_WORKLOAD if args.smoke else Workload()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = Report(device=name, torch_version=torch.__version__)
    t_start = time.perf_counter()

    report.copy_bw = copy_bandwidth(device, (4 << 30) if device.type == "cuda" else (64 << 20))
    import specserve

    print(f"specserve from {Path(specserve.__file__).parent}", flush=True)
    report.notes.append(f"specserve imported from {Path(specserve.__file__).parent}")
    print(f"copy bandwidth {report.copy_bw / 1e12:.3f} TB/s", flush=True)

    check = CHECK
    check_table = "(skipped)"
    ok = True
    if not args.skip_checks:
        t0 = time.perf_counter()
        results = check.run_checks(device, new_tokens=16 if args.smoke else 32,
                                   num_prompts=6 if args.smoke else 12, workdir=args.workdir)
        report.times_s["correctness checks"] = time.perf_counter() - t0
        report.checks = [asdict(r) for r in results]
        check_table = check.format_results(results)
        ok = all(r.ok for r in results)
        print(check_table, flush=True)
    if args.diagnose:
        lines = diagnose(args, device, work)
        text = "\n".join(["", "=" * 100, f"diagnose on {name} ({report.copy_bw / 1e12:.2f} TB/s)",
                          *lines, "=" * 100])
        print(text, flush=True)
        if args.out:
            Path(args.out, "diagnose.txt").write_text(text + "\n")
        return 0
    if not args.skip_8b:
        if args.layers and not args.smoke:
            report.layers_note = (f"NOTE: {args.layers} of Llama-3-8B's 32 layers; tok/s are for "
                                  "this depth (per-step time scales about linearly with layers).")
        bench_big_model(args, device, report, work)
    report.times_s["whole script"] = time.perf_counter() - t_start
    table = format_table(report, work, check_table)
    print(table, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = asdict(report)
        data["runs"] = [dict(asdict(r), decode_tok_s=r.decode_tok_s, e2e_tok_s=r.e2e_tok_s)
                        for r in report.runs]
        (out / "bench_gpu_engine.json").write_text(json.dumps(data, indent=2, default=str))
        (out / "bench_gpu_engine_table.txt").write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
