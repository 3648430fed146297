"""Every Triton kernel of a CUDA decode/verify step compiles for sm_90 (H100/H200) with
programmatic dependent launch on, and its PTX keeps PDL's contract (layers/pdl.py): release,
then wait, before the first store; the GEMVs issue their first weight load before the wait,
every other kernel loads only after it. Without PDL there is no grid-dependency instruction.

Compiled on this CPU (Triton needs no GPU for PTX and cubin when given the target) in a fresh
process, without TRITON_INTERPRET, by tests/sm90_compile_probe.py; the launches are the
engine's own at Llama-3-8B shapes (every GEMV_CONFIGS, GATE_UP_CONFIGS and ROWS_CONFIGS entry).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

PROBE = Path(__file__).with_name("sm90_compile_probe.py")
WEIGHTS_FIRST = {"_gemv", "_gate_up_silu", "_gemv_rows"}  # peeled first weight block
PDL_KERNELS = WEIGHTS_FIRST | {"_rms_norm_kernel", "_add_rms_norm_kernel", "_silu_mul_kernel",
                               "rotary_write_kv_kernel", "write_kv_kernel",
                               "paged_attention_kernel", "reduce_splits_kernel"}


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's warning
    done = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_pdl_kernel_compiles_for_sm90(compiled):
    names = {r["kernel"] for r in compiled if r["constexprs"].get("PDL")}
    assert names == PDL_KERNELS
    fused_rows = [r for r in compiled if r["kernel"] == "_gemv_rows"
                  and r["constexprs"]["GATE_UP"]]
    assert fused_rows  # the verification step's gate_up + silu kernel


def test_ptx_keeps_the_pdl_contract(compiled):
    for r in compiled:
        if not r["constexprs"].get("PDL"):
            continue
        where = f"{r['kernel']} {r['constexprs']}"
        assert r["launch_pdl"], where
        assert 0 <= r["launch_dependents"] < r["wait"], where
        assert r["wait"] < r["first_store"], where
        if r["kernel"] in WEIGHTS_FIRST:
            assert 0 <= r["first_load"] < r["wait"], where
        else:
            assert r["wait"] < r["first_load"], where


def test_without_pdl_no_grid_dependency_instructions(compiled):
    plain = [r for r in compiled if r["constexprs"].get("PDL") is False]
    assert plain
    for r in plain:
        assert r["launch_dependents"] == -1 and r["wait"] == -1, r
