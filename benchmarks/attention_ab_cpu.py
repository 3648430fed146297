"""The CPU attention kernel of this working tree against the one at a git revision, per layer.

Why: a verification pass attends k + 1 query rows per sequence, and on a CPU without AMX the
attention of those rows was ~15 % of a 9-row SmolLM2 pass. Kernel changes there are judged on
SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64) at the row counts a verification uses
and at grounded-prompt context lengths, with both kernels in one process taking turns (this
repo's machines drift by 10-30 % within minutes). It first checks that both give the same bits
over many runs (row counts, context lengths across the 16-key groups and 64-key chunks, head
dims 32 / 64 / 128), since a token's attention must not depend on how it was batched.

    python benchmarks/attention_ab_cpu.py --ref HEAD~1 [--threads 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

REPO = Path(__file__).resolve().parent.parent
CSRC = "specserve/model/layers/csrc"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def build_at(ref: str, workdir: Path):
    """The kernels module built from `ref`'s csrc (git archive), under its own name."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, CSRC], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True)
    src = workdir / CSRC
    return load(name="attention_ab_ref", sources=[str(p) for p in sorted(src.glob("*.cpp"))],
                extra_include_paths=[str(src)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])


def check_bits(ref_mod, new_mod) -> int:
    """Both kernels' outputs are bit-identical over two sequences per call; returns the count."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for dim in (32, 64, 128):
        k = torch.randn(2, KV_HEADS, 1100, dim, generator=gen)
        v = torch.randn(2, KV_HEADS, 1100, dim, generator=gen)
        for length in (1, 2, 15, 16, 17, 63, 64, 65, 79, 80, 81, 200, 251, 500, 1024):
            for rows in (1, 2, 3, 5, 8, 9, 12, 17, 70):
                if rows > length:
                    continue
                second = min(3, length)
                q = torch.randn(rows + second, HEADS, dim, generator=gen)
                starts = torch.tensor([0, rows, rows + second])
                lens = torch.tensor([length, length])
                a = ref_mod.run_attention(q, k, v, starts, lens, 0.125)
                b = new_mod.run_attention(q, k, v, starts, lens, 0.125)
                if not torch.equal(a, b):
                    raise SystemExit(f"bits differ: head_dim {dim}, context {length}, rows {rows}")
                checked += 1
    return checked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from specserve.model.layers import cpu_kernels

    new_mod = cpu_kernels.load()
    with tempfile.TemporaryDirectory() as tmp:
        ref_mod = build_at(args.ref, Path(tmp))
    torch.set_num_threads(args.threads)
    print(f"bits equal in {check_bits(ref_mod, new_mod)} calls")
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, KV_HEADS, 1100, HEAD_DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, 1100, HEAD_DIM, generator=gen)
    cases = [(length, rows) for length in (251, 500) for rows in (1, 2, 5, 9)]
    best: dict[tuple, float] = {}
    for rnd in range(args.rounds):
        for length, rows in cases:
            q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
            starts, lens = torch.tensor([0, rows]), torch.tensor([length])
            order = [("ref", ref_mod), ("new", new_mod)]
            for name, mod in order if rnd % 2 else order[::-1]:  # take turns
                t0 = time.perf_counter()
                for _ in range(300):
                    mod.run_attention(q, k, v, starts, lens, 0.125)
                seconds = (time.perf_counter() - t0) / 300
                key = (length, rows, name)
                best[key] = min(best.get(key, float("inf")), seconds)
    print(f"torch {torch.__version__}, {args.threads} threads; one layer, fastest of "
          f"{args.rounds} rounds of 300 calls; ref = {args.ref}")
    print("| context | rows | ref (us) | new (us) | new / ref |\n|---:|---:|---:|---:|---:|")
    for length, rows in cases:
        ref_us, new_us = best[(length, rows, "ref")] * 1e6, best[(length, rows, "new")] * 1e6
        print(f"| {length} | {rows} | {ref_us:.1f} | {new_us:.1f} | {new_us / ref_us:.3f} |")


if __name__ == "__main__":
    main()
