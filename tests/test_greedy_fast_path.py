"""The greedy fast path: steps whose every sampled row is plain greedy read back argmax token ids
(ModelRunner.execute_argmax; inside the decode graph on a GPU) instead of logits, and the
verifier accepts proposals from those ids alone. It must give exactly what the logits path gives.
"""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_runner, returned_something, tiny_llm

from specserve import SamplingParams
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.sequence import Sequence
from specserve.spec_decode import draft_model
from specserve.spec_decode.verifier import Verifier
from specserve.worker.model_runner import ModelRunner, SequenceRun

VOCAB = 50
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _seq(i: int, params: SamplingParams, num_output: int = 3) -> Sequence:
    seq = Sequence(i, f"r{i}", 0, [1, 2, 3], params, 0.0)
    for t in range(num_output):
        seq.append_token(4 + t)
    return seq


def _verifier(blocked=None) -> Verifier:
    return Verifier(VOCAB, torch.Generator().manual_seed(0), blocked or (lambda s, j: []))


@pytest.mark.parametrize("seed", range(5))
def test_accept_greedy_equals_verify(seed):
    gen = torch.Generator().manual_seed(seed)
    counts = [0, 1, 3, 4, 2, 4]
    logits = torch.randn(sum(c + 1 for c in counts), VOCAB, generator=gen)  # [R, V]
    argmax = logits.argmax(-1).tolist()
    proposals, row = [], 0
    for c in counts:  # proposals that match the argmax for a random prefix, then may not
        n_match = int(torch.randint(0, c + 1, (1,), generator=gen))
        props = [argmax[row + j] if j < n_match else int(torch.randint(0, VOCAB, (1,),
                                                                       generator=gen))
                 for j in range(c)]
        proposals.append(props)
        row += c + 1
    seqs = [_seq(i, GREEDY) for i in range(len(counts))]
    verifier = _verifier()
    assert verifier.argmax_suffices(seqs)
    slow = verifier.verify(seqs, proposals, None, logits)
    fast = Verifier.accept_greedy(proposals, argmax)
    assert fast.emitted == slow.emitted
    assert fast.num_accepted == slow.num_accepted


def test_argmax_suffices_only_for_untouched_greedy_rows():
    verifier = _verifier()
    plain = _seq(0, GREEDY)
    assert verifier.argmax_suffices([plain])
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, seed=3,
                                                                   repetition_penalty=1.2),
                   SamplingParams(temperature=0.0, presence_penalty=0.5),
                   SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
                   SamplingParams(temperature=0.0, allowed_token_ids=[3, 4])):
        assert not verifier.argmax_suffices([plain, _seq(1, params)]), params
    # min_tokens blocking (EOS forbidden for now) transforms the logits too
    blocking = _verifier(lambda s, j: [2])
    assert not blocking.argmax_suffices([plain])


def test_execute_argmax_equals_argmax_of_execute(tiny_llama):
    runner = cpu_runner(tiny_llama, 4, 32)
    runner.execute([SequenceRun([5, 6, 7, 8, 9, 10], 0, [3, 4], [5]),
                    SequenceRun([11, 12, 13], 0, [8], [2])])
    # decode, verify (every row), a run without logit rows, and a partial set of rows
    runs = [SequenceRun([1], 6, [3, 4], [0]), SequenceRun([2, 3, 4], 3, [8, 9], [0, 1, 2]),
            SequenceRun([7, 8], 0, [12], []), SequenceRun([5, 6], 2, [14], [1])]
    logits = runner.execute(runs)
    assert runner.execute_argmax(runs) == logits.argmax(-1).tolist()


def _count_fast_steps(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = ModelRunner.execute_argmax_device  # every argmax pass goes through it

    def spy(self, runs, *a, **kw):
        calls.append(len(runs))
        return original(self, runs, *a, **kw)

    monkeypatch.setattr(ModelRunner, "execute_argmax_device", spy)
    return calls


def test_engine_takes_fast_path_only_when_it_is_exact(tiny_llama, test_prompts, monkeypatch):
    prompts = test_prompts[:3]
    llm = tiny_llm(tiny_llama)
    monkeypatch.setattr(LLMEngine, "_argmax_suffices", lambda *a: False)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    monkeypatch.undo()
    calls = _count_fast_steps(monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == reference
    assert len(calls) == GREEDY.max_tokens  # every step: prefill, then decode steps
    calls.clear()
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3,
                               ignore_eos=True)
    llm.generate(prompts, [GREEDY, with_logprobs, penalised], use_tqdm=False)
    # only the steps after the logprobs and penalty requests have finished
    assert len(calls) == GREEDY.max_tokens - 4


def test_speculative_greedy_unchanged_by_fast_path(tiny_llama, tiny_llama_draft, test_prompts,
                                                   monkeypatch):
    prompts = test_prompts[:3]
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3,
                   speculative_adaptive=False)
    engine = llm.llm_engine
    monkeypatch.setattr(LLMEngine, "_argmax_suffices", lambda *a: False)
    monkeypatch.setattr(draft_model, "is_plain_greedy", lambda params: False)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    monkeypatch.undo()
    calls = _count_fast_steps(monkeypatch)
    draft_probs = []
    propose = engine.speculation.proposer.propose
    monkeypatch.setattr(engine.speculation.proposer, "propose", lambda seqs, ks, dev=False: (
        out := propose(seqs, ks, dev), draft_probs.append(out.probs))[0])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == reference
    # target verify steps and draft steps both read argmax ids; greedy drafts keep no q
    assert len(calls) > GREEDY.max_tokens and draft_probs
    assert all(p is None for p in draft_probs)


def test_replay_proposer_replays_on_the_greedy_draft_path(tiny_llama, tiny_llama_draft,
                                                          test_prompts, monkeypatch):
    """The benchmark proposer swaps the draft's tokens on the argmax path too (bench section 4)."""
    monkeypatch.setenv("SPECSERVE_BENCHMARK_PROPOSER", "1")
    from specserve.spec_decode.benchmark_proposer import ReplayProposer

    plain = tiny_llm(tiny_llama).generate(test_prompts[0], GREEDY, use_tqdm=False)[0]
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3,
                   speculative_adaptive=False)
    driver = llm.llm_engine.speculation
    replay = ReplayProposer(driver.proposer,
                            {tuple(plain.prompt_token_ids): plain.outputs[0].token_ids}, 1.0)
    driver.proposer = replay
    got = llm.generate(test_prompts[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == plain.outputs[0].token_ids
    assert replay.num_accepted > 0 and replay.per_token_acceptance == 1.0


def test_scatter_rows_places_a_subset_and_passes_a_full_batch_through():
    """A draft's per-proposing-sequence tensors become per-batch-row ones: a subset of rows is
    scattered into zeros; every row in order is the tensor itself (no device work)."""
    from specserve.worker.transfer import scatter_rows

    values = torch.tensor([[5, 6], [7, 8]])  # [A=2, K=2]
    placed = scatter_rows(values, [1, 3], 4)
    assert placed.tolist() == [[0, 0], [5, 6], [0, 0], [7, 8]]
    assert scatter_rows(values, [0, 1], 2) is values
    probs = torch.rand(1, 2, 5)  # [A=1, K, V]
    assert torch.equal(scatter_rows(probs, [2], 3)[2], probs[0])


def test_index_tensor_is_made_once_per_list():
    from specserve.worker import transfer

    first = transfer.index_tensor([3, 1, 4], "cpu")
    assert first.dtype == torch.int64 and first.tolist() == [3, 1, 4]
    assert transfer.index_tensor((3, 1, 4), "cpu") is first  # the same list: the same tensor
    assert transfer.index_tensor([3, 1], "cpu").tolist() == [3, 1]
    for n in range(transfer.INDEX_CACHE_SIZE + 1):  # bounded: it starts over when full
        transfer.index_tensor([n], "cpu")
    assert len(transfer._index_cache) <= transfer.INDEX_CACHE_SIZE
    assert transfer.index_tensor([3, 1, 4], "cpu").tolist() == [3, 1, 4]


@pytest.mark.parametrize("unread", [False, True])
def test_plain_decodes_launched_ahead_change_nothing(tiny_llama, test_prompts, monkeypatch,
                                                     unread):
    """Plain greedy decoding with each step's pass launched in the step before
    (LLMEngine.decode_ahead_enabled), after that step's tokens are read or, with
    decode_ahead_unread, queued before the read and fed with them on the device: the same
    tokens as without, with sequences ending at different steps (max_tokens, a stop token,
    the context's end), requests joining and aborted mid-run, and every KV block back at the
    end."""
    from specserve.engine import verify_ahead

    prompts = test_prompts[:6]
    lengths = (30, 7, 19, 30, 12, 25)
    launch = verify_ahead.launch

    def run(ahead: bool, stop_id: int | None = None):
        llm = tiny_llm(tiny_llama, max_model_len=48)
        engine = llm.llm_engine
        engine.decode_ahead_enabled = ahead
        engine.decode_ahead_unread = unread
        positions: list[int] = []  # fed to the passes launched ahead
        launch_pass = engine.runner.execute_argmax_device

        def spy_pass(runs, fed=None):
            positions.extend(r.start + len(r.token_ids) - 1 for r in runs)
            return launch_pass(runs, fed)

        engine.runner.execute_argmax_device = spy_pass
        before_read: list[bool] = []  # was a pass launched before the step's read?
        monkeypatch.setattr(verify_ahead, "launch", lambda *a, **kw: before_read.append(
            kw.get("last_on_device") is not None) or launch(*a, **kw))
        with returned_something(verify_ahead, "serves") as taken:
            outputs, steps = {}, 0
            for i in range(3):
                params = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True,
                                        stop_token_ids=[stop_id] if stop_id and i == 1 else None)
                engine.add_request(f"r{i}", prompts[i], params)
            while engine.has_unfinished_requests():
                if steps == 6:  # requests join while a pass is in flight
                    for i in range(3, 6):
                        engine.add_request(f"r{i}", prompts[i], SamplingParams(
                            temperature=0.0, max_tokens=None if i == 5 else lengths[i],
                            ignore_eos=True))
                if steps == 12:
                    engine.abort_request("r4")
                for out in engine.step():
                    outputs[out.request_id] = out.outputs[0].token_ids
                steps += 1
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not positions or max(positions) < 48 - 1  # the last token is never fed back
        return outputs, taken, before_read

    off, _, _ = run(False)
    stop_id = off["r1"][3]
    off, _, _ = run(False, stop_id)
    on, taken, before_read = run(True, stop_id)
    assert on == off
    assert len(off["r1"]) < lengths[1] and len(off["r5"]) > 10  # a stop; the context's end
    assert sum(taken) >= 20 and not all(taken)  # used, and dropped where requests joined
    assert len(before_read) >= 20 and all(b == unread for b in before_read)


def test_pending_read_keeps_the_values_it_was_given():
    """transfer.PendingRead: the values as they were when it was made (on a CPU a copy; on a
    GPU a copy queued then), whatever is written into the source afterwards."""
    from specserve.worker.transfer import PendingRead

    source = torch.tensor([3, 1, 4])
    pending = PendingRead(source)
    source.fill_(0)  # the next pass reusing the buffer
    assert pending.tolist() == [3, 1, 4]
