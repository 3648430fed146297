"""CUDA-graph buckets and padding (worker/cuda_graphs.py), tested on CPU.

The padded static-buffer path is exactly what a graph captures; with ``capture=False`` it runs
eagerly, so on CPU (Triton kernels under the interpreter, as in test_triton_attention.py) it
must give the eager path's logits, write no KV for padded tokens, and leave generation
unchanged, with and without speculation. Graph replay itself is checked on a GPU by section 0
of benchmarks/bench_gpu_spec.py (replay == padded eager bit for bit; generation == eager).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1"

from specserve.worker.cuda_graphs import (  # noqa: E402
    PAD_SLOT,
    GraphKey,
    batch_ladder,
    pad_inputs,
    pick_key,
)
from specserve.worker.model_runner import SequenceRun  # noqa: E402

BLOCK = 4
needs_interpreter = pytest.mark.skipif(
    not IN_PROCESS, reason="triton was imported before TRITON_INTERPRET=1 could be set; "
    "test_in_fresh_interpreter_process runs these instead")


# ---- buckets and padding (pure host logic) -------------------------------------------------------

def test_batch_ladder():
    assert batch_ladder(1) == (1,)
    assert batch_ladder(8) == (1, 2, 4, 8)
    assert batch_ladder(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert batch_ladder(48) == (1, 2, 4, 8, 16, 32, 48)


def test_pick_key():
    ladder = batch_ladder(16)
    assert pick_key(1, 1, ladder, 5) == GraphKey(1, 1)
    assert pick_key(3, 1, ladder, 5) == GraphKey(4, 1)
    assert pick_key(9, 5, ladder, 5) == GraphKey(16, 5)
    assert pick_key(16, 2, ladder, 5) == GraphKey(16, 2)
    assert pick_key(17, 1, ladder, 5) is None  # above the ladder: eager
    assert pick_key(2, 6, ladder, 5) is None  # longer runs (prefill chunks): eager
    assert pick_key(0, 1, ladder, 5) is None


def test_pad_inputs_layout():
    key = GraphKey(4, 3)
    runs = [SequenceRun([11], 5, [7, 2], [0]),  # decode at position 5 (block 2, offset 1)
            SequenceRun([21, 22, 23], 2, [3, 6], [0, 1, 2])]  # verify at positions 2..4
    width = 3
    p = pad_inputs(key, runs, BLOCK, width)
    t, b = key.num_tokens, key.batch_size
    ids, pos, slots = p.longs[:t], p.longs[t:2 * t], p.longs[2 * t:]
    assert p.num_tokens == 4
    assert ids.tolist() == [11, 21, 22, 23] + [0] * 8
    assert pos.tolist() == [5, 2, 3, 4] + [0] * 8
    assert slots.tolist()[:4] == [2 * BLOCK + 1, 3 * BLOCK + 2, 3 * BLOCK + 3, 6 * BLOCK]
    assert slots.tolist()[4:] == [PAD_SLOT] * 8
    ints = p.ints.tolist()
    assert ints[:b] == [6, 5, 0, 0]  # seq_lens; padded sequences have none
    assert ints[b:2 * b + 1] == [0, 1, 4, 4, 4]  # query starts; padded runs are empty
    assert ints[2 * b + 1:] == [7, 2, 0, 3, 6, 0]  # only the real rows' tables, 0-padded
    assert p.longs.dtype == torch.int64 and p.ints.dtype == torch.int32


def test_pad_inputs_slots_of_verify_run():
    p = pad_inputs(GraphKey(1, 3), [SequenceRun([1, 2, 3], 3, [5, 9], [0, 1, 2])], BLOCK, 2)
    assert p.longs[6:9].tolist() == [5 * BLOCK + 3, 9 * BLOCK, 9 * BLOCK + 1]


def test_empty_batch_pads_everything():
    p = pad_inputs(GraphKey(2, 2), [], BLOCK, 3)
    assert p.longs[8:].tolist() == [PAD_SLOT] * 4
    assert p.ints.tolist() == [0, 0, 0, 0, 0]


def test_static_buffer_fill_is_the_padded_layout():
    """One host->device copy per step fills what each bucket's views read, whatever a larger
    bucket left in the buffer before."""
    from specserve.worker.cuda_graphs import _StaticBuffers

    width = 3
    buffers = _StaticBuffers(4, 3, width, torch.device("cpu"))
    steps = [(GraphKey(4, 3), [SequenceRun([11], 5, [7, 2], [0]),
                               SequenceRun([21, 22, 23], 2, [3, 6], [0, 1, 2]),
                               SequenceRun([31, 32], 9, [1, 4, 5], [1])]),
             (GraphKey(2, 1), [SequenceRun([41], 7, [9, 8], [0])]),
             (GraphKey(1, 1), [])]
    for key, runs in steps:
        assert buffers.fill(key, runs, BLOCK) == sum(len(r.token_ids) for r in runs)
        want = pad_inputs(key, runs, BLOCK, width)
        t, b, n = key.num_tokens, key.batch_size, len(runs)
        ids, pos, slots, seq_lens, starts, tables = buffers.views(key)
        assert torch.equal(torch.cat([ids, pos, slots]), want.longs)
        assert torch.equal(torch.cat([seq_lens, starts]), want.ints[: 2 * b + 1])
        assert torch.equal(tables[:n].reshape(-1), want.ints[2 * b + 1:])
        assert ids.dtype == torch.int64 and tables.dtype == torch.int32
        assert tables.shape == (b, width) and ids.shape == (t,)


# ---- the padded path through a real model (Triton kernels under the interpreter) -----------------

@pytest.fixture
def triton_backend(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "triton")


def _prefill(runner, prompts: list[list[int]], tables: list[list[int]]) -> None:
    runner.execute([SequenceRun(p, 0, t, [len(p) - 1]) for p, t in zip(prompts, tables,
                                                                          strict=True)])


@needs_interpreter
def test_padded_path_matches_eager(tiny_llama, triton_backend, single_thread):
    from helpers import cpu_runner

    runner = cpu_runner(tiny_llama, BLOCK, 32)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22]]
    tables = [[3, 4, 5], [8, 9], [12, 13, 14, 15]]
    _prefill(runner, prompts, tables)
    sentinel = 7.0
    caches = [(layer.k_cache, layer.v_cache) for layer in runner.model.attention_layers()]
    spare = [0, 1, 2, 31]  # blocks no table uses: a padded token must never write there
    for k, v in caches:
        k[spare] = sentinel
        v[spare] = sentinel
    # decode for seq 0 (1 token), verify 3 tokens for seq 1 and 2 tokens for seq 2
    runs = [SequenceRun([1], 6, tables[0], [0]),
            SequenceRun([2, 3, 4], 3, tables[1], [0, 1, 2]),
            SequenceRun([5, 6], 9, tables[2], [1])]
    eager = runner.execute(runs)
    assert runner.execute_argmax(runs) == eager.argmax(-1).tolist()
    assert runner.enable_cuda_graphs(max_batch=4, max_query_len=3, max_model_len=64,
                                     capture=False)
    key = runner.graphs.key_for(runs)
    assert key == GraphKey(4, 3)
    padded = runner.execute(runs)
    assert padded.shape == eager.shape == (5, runner.model.vocab_size)
    torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)
    # the argmax head: logits and argmax computed in the padded forward, real rows read back
    assert runner.execute_argmax(runs) == padded.argmax(-1).tolist()
    for k, v in caches:
        assert (k[spare] == sentinel).all() and (v[spare] == sentinel).all()
    # batches outside the ladder still run (eagerly) and agree
    long_run = [SequenceRun([7, 8, 9, 10], 11, tables[2], [3])]
    assert runner.graphs.key_for(long_run) is None
    runner.execute(long_run)


@needs_interpreter
def test_generation_unchanged_with_padded_path(tiny_llama, tiny_llama_draft, triton_backend,
                                               single_thread, monkeypatch):
    """Engine-level: the graph path (capture off, so it runs on CPU) serves decode, verify and
    draft steps; greedy output equals the eager engine's, with and without a draft model."""
    from helpers import returned_something, tiny_llm

    from specserve import SamplingParams
    from specserve.engine import verify_ahead
    from specserve.spec_decode.draft_model import DraftModelProposer
    from specserve.worker.model_runner import ModelRunner

    used: list[int] = []
    enable = ModelRunner.enable_cuda_graphs

    def force_padded_path(self, *args, **kwargs):
        used.append(1)
        return enable(self, *args, capture=False)

    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate(ahead: bool = False, **kwargs):
        llm = tiny_llm(tiny_llama, max_model_len=128, **kwargs)
        llm.llm_engine.decode_ahead_enabled = ahead  # plain passes launched ahead too,
        llm.llm_engine.decode_ahead_unread = ahead  # queued before the last one's read
        if ahead and llm.llm_engine.speculation is not None:  # the draft's proposals launched
            llm.llm_engine.speculation.proposer.launch_ahead_enabled = True  # after each
            llm.llm_engine.verify_ahead_enabled = True  # verification, and the next verify
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    reference = generate(enforce_eager=True)
    monkeypatch.setattr(ModelRunner, "enable_cuda_graphs", force_padded_path)
    assert generate() == reference
    with returned_something(verify_ahead, "serves") as decoded_ahead:
        assert generate(True) == reference  # each pass queued before the last one's read
    assert decoded_ahead and all(decoded_ahead)
    with (returned_something(DraftModelProposer, "_take_ahead") as taken,
          returned_something(verify_ahead, "serves") as verified_ahead):
        for ahead in (False, True):
            assert generate(ahead, speculative_model=str(tiny_llama_draft),
                            num_speculative_tokens=3, speculative_adaptive=False) == reference
    assert taken and all(taken)  # launched proposals were taken, from the graph path
    assert verified_ahead and all(verified_ahead)  # ... and verifications launched ahead
    assert generate(num_scheduler_steps=5) == reference  # tokens fed back in the buffer
    assert len(used) == 7  # plain target, twice; target + draft, twice; multi-step target


@needs_interpreter
def test_padded_multi_step_feeds_tokens_back(tiny_llama, triton_backend, single_thread):
    """run_argmax_steps: each step's argmax goes into the next step's token ids on the
    device, positions and slots advance; the tokens equal one-step-at-a-time decoding."""
    from helpers import cpu_runner

    runner = cpu_runner(tiny_llama, BLOCK, 32)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    tables = [[3, 4, 5, 6], [8, 9, 10]]  # room for 6 more tokens each
    _prefill(runner, prompts, tables)
    runs = [SequenceRun([1], 6, tables[0], [0]), SequenceRun([2], 3, tables[1], [0])]
    eager = runner.execute_argmax_steps(runs, 6)  # no graphs: a loop of execute_argmax
    assert [len(t) for t in eager] == [6, 6]
    assert runner.enable_cuda_graphs(max_batch=4, max_query_len=2, max_model_len=64,
                                     capture=False)
    assert runner.graphs.key_for(runs) == GraphKey(2, 1)
    assert runner.execute_argmax_steps(runs, 6) == eager
    assert runner.execute_argmax_steps(runs[:1], 6) == eager[:1]  # a padded bucket of 1
    # The first step's tokens given on the device (the runs hold placeholders): the same.
    blank = [SequenceRun([0], r.start, r.block_table, [0]) for r in runs]
    first = torch.tensor([1, 2])
    assert runner.execute_argmax_steps_device(blank, 6, first).T.tolist() == eager


@needs_interpreter
def test_padded_pass_takes_tokens_fed_on_the_device(tiny_llama, triton_backend, single_thread):
    """execute_argmax_device(fed=...): input tokens at the given packed rows are set on the
    device after the host's inputs are sent (a draft's proposals, never read back), in the
    eager and in the padded graph path alike."""
    from helpers import cpu_runner

    runner = cpu_runner(tiny_llama, BLOCK, 32)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    tables = [[3, 4, 5, 6], [8, 9, 10]]
    _prefill(runner, prompts, tables)
    runs = [SequenceRun([1, 30, 31], 6, tables[0], [0, 1, 2]),
            SequenceRun([2, 40], 3, tables[1], [0, 1])]
    blank = [SequenceRun([1, 0, 0], 6, tables[0], [0, 1, 2]),
             SequenceRun([2, 0], 3, tables[1], [0, 1])]
    fed = (torch.tensor([1, 2, 4]), torch.tensor([30, 31, 40]))  # packed rows of the zeros
    want = runner.execute_argmax(runs)
    assert runner.execute_argmax_device(blank, fed).tolist() == want
    assert runner.execute_argmax_device(blank).tolist() != want  # the placeholders matter
    assert runner.enable_cuda_graphs(max_batch=4, max_query_len=3, max_model_len=64,
                                     capture=False)
    assert runner.graphs.key_for(blank) == GraphKey(2, 3)
    assert runner.execute_argmax_device(blank, fed).tolist() == want


def test_in_fresh_interpreter_process():
    if IN_PROCESS:
        pytest.skip("the interpreter is on in this process: the tests above ran here")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             __file__], env=env, capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

