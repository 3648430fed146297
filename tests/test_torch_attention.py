"""The torch attention backend's step layouts and its decode context mirror, against transformers.

Every scenario runs the same steps on two runners, one with the mirror and one without (plain
block gathers), and checks each step's logits against transformers on the full token prefix: the
mirror must be invisible, including when the batch changes under it (sequences leave and join,
a multi-token verification rewrites positions, a sequence steps back, contexts outgrow its
capacity).
"""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_runner, hf_model

from specserve.model.layers.attention import torch_backend, torch_context_mirror
from specserve.worker.model_runner import ModelRunner, SequenceRun

BLOCK = 4  # small blocks: contexts cross many block and capacity boundaries
# float32 logits vs transformers': a wrong context is off by >1e-2; summation-order noise reached
# 1.03e-4 on a logit of ~4 with the C++ kernel (as close to a float64 reference as SDPA is)
ATOL = 2e-4


def _runner(path) -> ModelRunner:
    return cpu_runner(path, BLOCK, 400)


class _Seq:
    """One sequence's tokens and its (contiguous, never shared) blocks."""

    def __init__(self, ids: list[int], first_block: int, vocab: int) -> None:
        self.ids, self.vocab = ids, vocab
        self.blocks = list(range(first_block, first_block + 40))
        self.done = 0  # tokens whose K/V are cached

    def run(self, n: int, back: int = 0) -> SequenceRun:
        """The next n tokens, after stepping back `back` positions (a rollback: the tokens from
        there on change, so K/V left over from before would give wrong logits)."""
        if back:
            self.done -= back
            self.ids[self.done :] = [3 + (t + 1) % (self.vocab - 3) for t in self.ids[self.done :]]
        run = SequenceRun(self.ids[self.done : self.done + n], self.done, self.blocks,
                          list(range(n)))
        self.done += n
        return run


class _Pair:
    """Two runners (mirror on / off) stepped in lockstep and checked against transformers."""

    def __init__(self, path, monkeypatch) -> None:
        self.mirrored, self.plain = _runner(path), _runner(path)
        self.monkeypatch = monkeypatch
        self.hf = hf_model(path)
        self.vocab = self.hf.config.vocab_size

    def step(self, seqs: list[_Seq], runs: list[SequenceRun]) -> None:
        out = self.mirrored.execute(runs)
        with self.monkeypatch.context() as m:
            m.setattr(torch_context_mirror, "MAX_MIRROR_FRACTION", 0.0)
            ref = self.plain.execute(runs)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        row = 0
        for seq, run in zip(seqs, runs, strict=True):
            with torch.no_grad():
                full = self.hf(torch.tensor([seq.ids[: run.start + len(run.token_ids)]])).logits
            expected = full[0, run.start :]  # [n, vocab]
            torch.testing.assert_close(out[row : row + len(run.token_ids)], expected, atol=ATOL,
                                       rtol=0)
            row += len(run.token_ids)


@pytest.fixture(params=["kernel", "torch"])
def pair(request, tiny_llama, monkeypatch):
    """Decode and verification steps through csrc/attention.cpp ("kernel") or through the torch
    layouts it replaces on float32 CPU tensors ("torch", still the path for other dtypes)."""
    if request.param == "torch":
        monkeypatch.setattr(torch_backend, "MAX_KERNEL_RUN", 0)
    p = _Pair(tiny_llama, monkeypatch)
    p.attention = request.param
    return p


def _seqs(vocab: int, lengths: list[int], seed: int = 0) -> list[_Seq]:
    gen = torch.Generator().manual_seed(seed)
    return [_Seq(torch.randint(3, vocab, (n,), generator=gen).tolist(), 1 + 40 * i, vocab)
            for i, n in enumerate(lengths)]


def test_mirror_uses_less_than_its_budget(pair):
    """The mirror is really used here (the other tests would pass vacuously otherwise)."""
    seqs = _seqs(pair.vocab, [60, 60])
    pair.step(seqs, [s.run(5) for s in seqs])
    pair.step(seqs, [s.run(1) for s in seqs])
    assert pair.mirrored.backend.mirror._seq_lens == [6, 6]


def test_mirror_serves_a_batch_that_needs_most_of_the_cache(pair):
    """A batch whose mirror needs 62 % of the paged cache's tokens (8 rows of 27 blocks plus
    the headroom, of 400 blocks) is still served from the mirror: at half the cache, 32 SmolLM2
    sequences lost it past ~290 tokens and gathered every block of every layer each step
    (torch_context_mirror.MAX_MIRROR_FRACTION)."""
    mirror = pair.mirrored.backend.mirror
    seqs = _seqs(pair.vocab, [120] * 8)  # 105 tokens: 27 blocks of 4, 8 x (27 + 4) x 4 = 992
    for _ in range(8):  # runs of up to 16 tokens: the mirror follows them
        pair.step(seqs, [s.run(13) for s in seqs])
    pair.step(seqs, [s.run(1) for s in seqs])
    assert 0.5 * mirror.cache_tokens < 8 * mirror._capacity <= mirror.cache_tokens
    assert mirror._seq_lens == [105] * 8


def test_cpu_rope_kernel_writes_cache_and_mirror(pair, monkeypatch):
    """float32 CPU steps rotate and write K/V through the C++ kernel (csrc/rope_kv.cpp), on
    extend steps into the mirror too: the other tests here then check that path against
    transformers, not the torch fallback."""
    from specserve.model.layers import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("the CPU kernels did not build")
    calls = []
    real = kernels.rope_write_kv
    monkeypatch.setattr(kernels, "rope_write_kv",
                        lambda *a, **kw: calls.append(len(a)) or real(*a, **kw))
    seqs = _seqs(pair.vocab, [60, 60])
    pair.step(seqs, [s.run(5) for s in seqs])  # prefill: cache only
    pair.step(seqs, [s.run(1) for s in seqs])  # first decode: the mirror is built (gathered)
    pair.step(seqs, [s.run(1) for s in seqs])  # extend: cache and mirror rows
    layers = pair.hf.config.num_hidden_layers
    # Each step runs the mirrored runner's layers, then the plain one's (never mirrored).
    assert calls[: 2 * layers] == [8] * (2 * layers)  # prefill
    assert calls[-2 * layers :] == [11] * layers + [8] * layers  # extend


def test_batch_decode_through_capacity_growth_and_changes(pair):
    seqs = _seqs(pair.vocab, [120, 120, 120])
    prompts = [7, 3, 12]
    pair.step(seqs, [s.run(n) for s, n in zip(seqs, prompts, strict=True)])  # ragged prefill
    for _ in range(25):  # ragged decode; > HEADROOM_BLOCKS * BLOCK tokens: capacity grows
        pair.step(seqs, [s.run(1) for s in seqs])
    kept = [seqs[0], seqs[2]]  # a sequence leaves
    for _ in range(3):
        pair.step(kept, [s.run(1) for s in kept])
    newcomer = _seqs(pair.vocab, [60], seed=1)[0]
    newcomer.blocks = list(range(300, 340))
    both = kept + [newcomer]  # one joins: its prompt shares the step with two decodes
    pair.step(both, [kept[0].run(1), kept[1].run(1), newcomer.run(9)])
    for _ in range(3):
        pair.step(both, [s.run(1) for s in both])


def test_decode_after_verification_and_rollback(pair):
    seqs = _seqs(pair.vocab, [100, 100])
    pair.step(seqs, [s.run(10) for s in seqs])
    for _ in range(3):
        pair.step(seqs, [s.run(1) for s in seqs])
    # A multi-token verification step, then both roll back two positions and decode again:
    # the recomputed positions must not be read from a stale mirror.
    pair.step(seqs, [s.run(4) for s in seqs])
    pair.step(seqs, [s.run(1, back=2) for s in seqs])
    for _ in range(3):
        pair.step(seqs, [s.run(1) for s in seqs])
    # A single-token step that rewrites the last position (as a draft model's catch-up can).
    pair.step(seqs, [s.run(1, back=1) for s in seqs])
    pair.step(seqs, [s.run(1) for s in seqs])


def test_swapped_sequence_is_not_read_from_the_mirror(pair):
    """Same batch size, every context one token longer, but a different sequence in a row: only
    the block tables tell the mirror that the row's context is not the one it holds."""
    a, b, c = _seqs(pair.vocab, [40, 40, 40])
    pair.step([a, b], [a.run(10), b.run(10)])
    pair.step([c], [c.run(13)])
    for _ in range(3):  # a and b reach 13 tokens, like c
        pair.step([a, b], [a.run(1), b.run(1)])
    pair.step([a, c], [a.run(1), c.run(1)])


def test_a_block_table_changed_in_place_is_seen(pair):
    """The runner hands the mirror the callers' block-table lists (the block manager's, which
    change in place); the mirror keeps copies. Here a row's list object is rewritten in place
    to name another sequence's blocks, its context now that sequence's: only a copy taken
    when the mirror was built shows that the row is not the one it holds."""
    a, b, c = _seqs(pair.vocab, [40, 40, 40])
    pair.step([a, b], [a.run(12), b.run(12)])
    pair.step([c], [c.run(13)])
    for _ in range(3):  # a and b reach 15 tokens: the mirror is built, then extended
        pair.step([a, b], [a.run(1), b.run(1)])
    a.blocks[:] = c.blocks  # the same list object, now c's blocks ...
    a.ids, a.done = c.ids, c.done  # ... and c's context (13 tokens: inside what row 0 holds)
    pair.step([a, b], [a.run(1), b.run(1)])


def _extends(pair, monkeypatch) -> list[bool]:
    """Record, per step of the mirrored runner, whether its mirror was extended (not rebuilt)."""
    seen: list[bool] = []
    plan = pair.mirrored.backend.mirror.plan

    def spy(meta):
        step = plan(meta)
        seen.append(step is not None and step.extend)
        return step

    monkeypatch.setattr(pair.mirrored.backend.mirror, "plan", spy)
    return seen


def test_verification_steps_extend_the_mirror(pair, monkeypatch):
    """Speculative steps (runs of k + 1 tokens, ragged across the batch, rejected proposals
    rolled back) keep the mirror: a step starting at or before the end of what it holds writes
    its rows there, and the decode steps around them extend it too."""
    seqs = _seqs(pair.vocab, [120, 120, 120])
    pair.step(seqs, [s.run(n) for s, n in zip(seqs, [9, 5, 14], strict=True)])  # prefill
    extends = _extends(pair, monkeypatch)
    pair.step(seqs, [s.run(1) for s in seqs])  # first decode: builds the mirror
    pair.step(seqs, [s.run(1) for s in seqs])
    pair.step(seqs, [s.run(n) for s, n in zip(seqs, [4, 1, 6], strict=True)])  # verify
    # rejections: the next runs start inside what the last step wrote
    pair.step(seqs, [s.run(n, back=b) for s, n, b in zip(seqs, [3, 2, 1], [2, 0, 4],
                                                         strict=True)])
    pair.step(seqs, [s.run(1, back=b) for s, b in zip(seqs, [1, 1, 0], strict=True)])
    for _ in range(18):  # past the capacity headroom (rebuilds), then extends again
        pair.step(seqs, [s.run(n) for s, n in zip(seqs, [5, 1, 2], strict=True)])
    assert extends[:5] == [False, True, True, True, True]
    assert 1 < extends.count(False) < extends.count(True)


def test_a_prompt_chunk_drops_the_mirror(pair, monkeypatch):
    """Runs longer than MAX_MIRROR_QUERY (prompt chunks) invalidate it: they are not read from
    it and the next short step rebuilds it."""
    long_run = torch_context_mirror.MAX_MIRROR_QUERY + 1
    seqs = _seqs(pair.vocab, [120, 120])
    pair.step(seqs, [s.run(6) for s in seqs])
    extends = _extends(pair, monkeypatch)
    pair.step(seqs, [s.run(1) for s in seqs])
    pair.step(seqs, [seqs[0].run(1), seqs[1].run(long_run)])
    assert pair.mirrored.backend.mirror._seq_lens == []
    pair.step(seqs, [s.run(2) for s in seqs])
    pair.step(seqs, [s.run(1) for s in seqs])
    assert extends == [False, False, False, True]


def test_a_few_longer_runs_in_a_decode_batch_are_split_off(pair, monkeypatch):
    """A large batch where only some sequences verify proposals (or one takes a prompt chunk)
    does not pad every run to the longest: the last query of every run is attended like a
    decode and only the longer runs' other queries one sequence at a time. Same logits as
    transformers, with the mirror and without."""
    layouts: list[str] = []
    prepare = pair.mirrored.backend.prepare

    def spy(meta):
        prepare(meta)
        layouts.append(type(meta.backend_state["torch"]).__name__)

    monkeypatch.setattr(pair.mirrored.backend, "prepare", spy)
    seqs = _seqs(pair.vocab, [120] * 6)
    pair.step(seqs, [s.run(n) for s, n in zip(seqs, [7, 9, 5, 11, 6, 8], strict=True)])
    pair.step(seqs, [s.run(1) for s in seqs])
    pair.step(seqs, [s.run(n) for s, n in zip(seqs, [1, 6, 1, 1, 2, 1], strict=True)])
    pair.step(seqs, [s.run(n, back=b) for s, n, b in zip(seqs, [1, 1, 3, 1, 1, 1],
                                                          [0, 4, 0, 0, 1, 0], strict=True)])
    pair.step(seqs, [s.run(n) for s, n in zip(seqs, [1, 1, 1, 20, 1, 1], strict=True)])
    pair.step(seqs, [s.run(1) for s in seqs])
    if pair.attention == "torch":
        assert layouts == ["_PrefillLayout", "_DecodeLayout", "_SplitLayout", "_SplitLayout",
                           "_SplitLayout", "_DecodeLayout"]
    else:  # every step goes to the kernel: prompts, verifications, the 20-token chunk
        assert layouts == ["_KernelRunsLayout"] * 6


def test_a_shrinking_batch_compacts_the_mirror(pair, monkeypatch):
    """Sequences leaving the batch (finished at different steps) keep the mirror: the kept rows
    move inside the buffers instead of being gathered again, in the steps right after
    verifications with rejected proposals too. Leaving rows are chosen so that rows move down
    (a row near the top leaves), up (near the bottom: the rows above it shift instead) and both
    ways at once, several of them in one step."""
    seqs = _seqs(pair.vocab, [120] * 6)
    pair.step(seqs, [s.run(n) for s, n in zip(seqs, [9, 5, 14, 7, 11, 6], strict=True)])
    extends = _extends(pair, monkeypatch)
    mirror = pair.mirrored.backend.mirror
    pair.step(seqs, [s.run(1) for s in seqs])  # builds the mirror
    pair.step(seqs, [s.run(n) for s, n in zip(seqs, [4, 1, 6, 3, 1, 5], strict=True)])
    # rows 1 and 3 leave; the rest reject some proposals (their runs start inside what the
    # last step wrote): rows 0 and 2 move up to a new base, rows 4 and 5 stay where they are
    kept = [seqs[0], seqs[2], seqs[4], seqs[5]]
    pair.step(kept, [s.run(n, back=b) for s, n, b in zip(kept, [2, 1, 1, 3], [2, 4, 0, 1],
                                                         strict=True)])
    assert mirror.counts["moved rows"] == 2
    pair.step(kept, [s.run(1) for s in kept])
    kept = kept[:2] + kept[3:]  # a row near the end leaves: the last one moves down
    pair.step(kept, [s.run(n, back=b) for s, n, b in zip(kept, [1, 4, 2], [1, 0, 2],
                                                         strict=True)])
    assert mirror.counts["moved rows"] == 3
    kept = kept[1:]  # the first row leaves: no row moves, the window slides
    pair.step(kept, [s.run(1) for s in kept])
    for _ in range(3):
        pair.step(kept, [s.run(n) for s, n in zip(kept, [1, 3], strict=True)])
    assert extends == [False] + [True] * 8
    assert mirror.counts["compact"] == 3
    kept = kept[:1]
    for _ in range(12):  # past the capacity headroom (a rebuild), then shrinking again
        pair.step(kept, [s.run(1) for s in kept])
    assert extends.count(False) == 2


def test_a_shrunk_batch_with_another_sequence_rebuilds(pair, monkeypatch):
    """Fewer rows, but one of them is a sequence the mirror does not hold (same length as the
    one it replaces): its block table differs, so no mirror row matches it and the mirror is
    gathered again rather than compacted."""
    a, b, c, d = _seqs(pair.vocab, [60] * 4)
    pair.step([a, b, c], [a.run(10), b.run(10), c.run(10)])
    pair.step([d], [d.run(12)])
    extends = _extends(pair, monkeypatch)
    for _ in range(2):
        pair.step([a, b, c], [s.run(1) for s in (a, b, c)])
    pair.step([b, d], [b.run(1), d.run(1)])  # b is old row 1; d is in c's place
    pair.step([b, d], [b.run(1), d.run(1)])
    pair.step([d], [d.run(1)])  # b leaves: d, row 1 of the last step, slides to row 0
    assert extends == [False, True, False, True, True]
    assert pair.mirrored.backend.mirror.counts["compact"] == 1


def test_a_growing_mirror_keeps_its_storage(pair):
    """A rebuild for a context that outgrew the mirror's capacity re-views the storage the
    mirror reserved at its first build instead of allocating (and faulting in) new memory, and
    the steps after it still read the right context."""
    mirror = pair.mirrored.backend.mirror
    seqs = _seqs(pair.vocab, [60, 60])
    pair.step(seqs, [seqs[0].run(10), seqs[1].run(7)])
    pair.step(seqs, [s.run(1) for s in seqs])  # first decode: reserves and builds
    first_capacity = mirror._capacity
    storage = {key: held.k_storage.data_ptr() for key, held in mirror._buffers.items()}
    while mirror._capacity == first_capacity:
        pair.step(seqs, [s.run(1) for s in seqs])
    assert mirror._capacity > first_capacity
    assert mirror.counts["rebuild"] == 2
    assert {key: held.k_storage.data_ptr() for key, held in mirror._buffers.items()} == storage
    for _ in range(2):  # extends of the regrown mirror
        pair.step(seqs, [s.run(1) for s in seqs])
