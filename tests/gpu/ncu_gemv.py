"""GEMV launches for Nsight Compute to compare (a script, not collected by pytest).

Each kernel runs LAUNCHES times on the same weight shape (a different weight copy each time, so
that ncu's serialised launches read HBM), one row through triton_ops' one-row kernel and the
given rows configs through layers/gemv.py:

  PYTHONPATH=$PWD ncu --clock-control none --kernel-name regex:_gemv \\
      --section SpeedOfLight --section Occupancy --section LaunchStats \\
      --section WarpStateStats --section MemoryWorkloadAnalysis \\
      python3 tests/gpu/ncu_gemv.py --shape 6144,4096 --rows 2 dot,64,256,4,4 fma,2,1024,4,3

(--clock-control none: device/METHOD.md says to leave the clocks alone.) Session 12 found with
it that the 8B qkv's "dot" kernel runs 96 programs, one per SM, leaving 36 of 132 SMs idle
(BENCHMARKS.md, "H200, session 12").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from specserve.model.layers import gemv, triton_ops  # noqa: E402

LAUNCHES = 5
COPIES = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="6144,4096", help="N,K of the weight")
    parser.add_argument("--rows", type=int, default=2, help="rows of x for the rows configs")
    parser.add_argument("--device", default="cuda",
                        help="cpu: a smoke run of this script under TRITON_INTERPRET=1")
    parser.add_argument("configs", nargs="*", default=["dot,64,256,4,4"],
                        help="variant,BLOCK_N,BLOCK_K,num_warps,num_stages")
    args = parser.parse_args()
    n, k = map(int, args.shape.split(","))
    # the interpreter's bf16 dot is wrong (see attention/triton_kernels.py): fp16 there
    opts = {"device": args.device,
            "dtype": torch.float16 if args.device == "cpu" else torch.bfloat16}
    torch.manual_seed(0)
    weights = [torch.randn(n, k, **opts) * 0.02
               for _ in range(COPIES)]
    one = triton_ops.GEMV_CONFIGS.get((n, k))
    if one is not None:
        x = torch.randn(1, k, **opts)
        for i in range(LAUNCHES):
            triton_ops.gemv(x, weights[i % COPIES], None, one)
    x = torch.randn(args.rows, k, **opts)
    for spec in args.configs:
        variant, *numbers = spec.split(",")
        config = gemv.RowsConfig(variant, *map(int, numbers))
        for i in range(LAUNCHES):
            gemv.gemv_rows(x, weights[i % COPIES], None, config)
    if args.device != "cpu":
        torch.cuda.synchronize()
    print(f"one-row {one} x {LAUNCHES}, then {args.configs} at {args.rows} rows x {LAUNCHES}")


if __name__ == "__main__":
    main()
