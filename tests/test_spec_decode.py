"""Speculative decoding with a draft model: lossless greedy output, stops, logprobs, metrics."""

from __future__ import annotations

import logging

import pytest
from helpers import returned_something, tiny_llm

from specserve import LLM, SamplingParams

REF_TOKENS = 37


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama_reference(tiny_llama, test_prompts):
    return _tokens(tiny_llm(tiny_llama).generate(test_prompts, _greedy(REF_TOKENS),
                                                 use_tqdm=False))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("pair", [("tiny_llama", "tiny_llama_draft"), ("tiny_opt", "tiny_opt_draft")])
def test_greedy_equals_plain_decoding_with_unrelated_draft(pair, k, request, test_prompts):
    target, draft = (request.getfixturevalue(name) for name in pair)
    prompts = test_prompts[:10]
    plain = _tokens(tiny_llm(target).generate(prompts, _greedy(33), use_tqdm=False))
    llm = tiny_llm(target, speculative_model=str(draft), num_speculative_tokens=k)
    assert _tokens(llm.generate(prompts, _greedy(33), use_tqdm=False)) == plain
    spec = llm.get_metrics()["spec_decode"]
    assert spec["num_draft_tokens"] > 0
    assert spec["draft_acceptance_rate"] < 0.5  # an unrelated draft rarely agrees


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_draft_accepts_everything(tiny_llama, llama_reference, test_prompts, k):
    steps = 6
    max_tokens = 1 + steps * (k + 1)  # the prefill emits 1 token, then full k+1 runs
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=k,
                   speculative_adaptive=False)
    outs = llm.generate(test_prompts, _greedy(max_tokens), use_tqdm=False)
    assert _tokens(outs) == [t[:max_tokens] for t in llama_reference]
    spec = llm.get_metrics()["spec_decode"]
    assert spec["draft_acceptance_rate"] == 1.0
    assert spec["mean_acceptance_length"] == k + 1
    assert spec["system_efficiency"] == 1.0
    assert spec["per_position_acceptance_rate"] == [1.0] * k
    m = outs[0].metrics
    assert m.num_spec_steps == steps and m.num_accepted_tokens == steps * k


def test_self_draft_output_identical_for_long_runs(tiny_llama, llama_reference, test_prompts):
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=4)
    assert _tokens(llm.generate(test_prompts, _greedy(REF_TOKENS), use_tqdm=False)) == llama_reference


def test_mixed_greedy_and_random_batch(tiny_llama, tiny_llama_draft, llama_reference,
                                       test_prompts):
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3)
    params = [_greedy(REF_TOKENS) if i % 2 == 0 else
              SamplingParams(temperature=0.7 + 0.1 * (i % 3), top_p=0.9, max_tokens=REF_TOKENS,
                             ignore_eos=True)
              for i in range(len(test_prompts))]
    outs = llm.generate(test_prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert len(out.outputs[0].token_ids) == REF_TOKENS
        if i % 2 == 0:
            assert out.outputs[0].token_ids == llama_reference[i]


def test_seeded_requests_do_not_depend_on_batch_mates(tiny_llama, tiny_llama_draft,
                                                      test_prompts):
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3)
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=24)
    alone = llm.generate(test_prompts[4], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(test_prompts[4], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mates = [SamplingParams(temperature=0.8, max_tokens=24)] * 6
    batch = llm.generate(test_prompts[:6] + [test_prompts[4]], mates + [seeded],
                         use_tqdm=False)
    assert alone == again == batch[-1].outputs[0].token_ids


def test_unseeded_sampling_reproducible_with_adaptive_speculation(tiny_llama, tiny_llama_draft,
                                                                  test_prompts):
    """Same inputs + same engine seed -> same outputs, although the adaptive policy's k for
    greedy rows depends on measured step times."""
    params = [_greedy(REF_TOKENS) if i % 3 == 0 else
              SamplingParams(temperature=1.0, max_tokens=REF_TOKENS, ignore_eos=True)
              for i in range(len(test_prompts))]
    runs = []
    for _ in range(2):
        llm = tiny_llm(tiny_llama, seed=11, speculative_model=str(tiny_llama_draft),
                       num_speculative_tokens=3)
        runs.append(_tokens(llm.generate(test_prompts, params, use_tqdm=False)))
    assert runs[0] == runs[1]


def test_stops_inside_an_accepted_run(tiny_llama, llama_reference, test_prompts):
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=5)
    ref = llama_reference[8]
    plain = tiny_llm(tiny_llama)
    # stop token id in the middle of a fully accepted run of 6
    stop_id = ref[9]
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True,
                            stop_token_ids=[stop_id])
    spec_out = llm.generate(test_prompts[8], params, use_tqdm=False)[0].outputs[0]
    plain_out = plain.generate(test_prompts[8], params, use_tqdm=False)[0].outputs[0]
    assert spec_out.token_ids == plain_out.token_ids == ref[: ref.index(stop_id) + 1]
    assert spec_out.text == plain_out.text and spec_out.stop_reason == stop_id
    # stop string
    text = plain.generate(test_prompts[8], _greedy(33), use_tqdm=False)[0].outputs[0].text
    stop = text[12:15]
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, stop=[stop])
    spec_out = llm.generate(test_prompts[8], params, use_tqdm=False)[0].outputs[0]
    plain_out = plain.generate(test_prompts[8], params, use_tqdm=False)[0].outputs[0]
    assert spec_out.text == plain_out.text == text[: text.index(stop)]
    assert spec_out.token_ids == plain_out.token_ids
    # max_tokens not a multiple of k+1 and min_tokens
    for params in (_greedy(8), SamplingParams(temperature=0, max_tokens=20, min_tokens=15,
                                              stop_token_ids=[ref[3]])):
        assert (llm.generate(test_prompts[8], params, use_tqdm=False)[0].outputs[0].token_ids
                == plain.generate(test_prompts[8], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_logprobs_are_the_targets(tiny_llama, tiny_llama_draft, test_prompts):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = tiny_llm(tiny_llama).generate(test_prompts[:4], params, use_tqdm=False)
    for draft in (tiny_llama, tiny_llama_draft):
        llm = tiny_llm(tiny_llama, speculative_model=str(draft), num_speculative_tokens=3,
                       disable_logprobs_during_spec_decoding=False)
        spec = llm.generate(test_prompts[:4], params, use_tqdm=False)
        for a, b in zip(plain, spec, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert ea.keys() == eb.keys()
                for tok in ea:
                    assert abs(ea[tok].logprob - eb[tok].logprob) < 1e-4
                    assert ea[tok].rank == eb[tok].rank


def test_preemption_under_speculation(tiny_llama, llama_reference, test_prompts):
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=3,
                   num_gpu_blocks_override=24, max_model_len=256)
    assert _tokens(llm.generate(test_prompts, _greedy(REF_TOKENS), use_tqdm=False)) == llama_reference
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 24
    assert engine.speculation.proposer.block_manager.num_free_blocks == 24
    assert not engine.speculation.proposer.shadows


def test_speculative_limits(tiny_llama, tiny_llama_draft, llama_reference, test_prompts):
    # past speculative_max_model_len sequences decode without speculation (and it is counted)
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=3,
                   speculative_max_model_len=40, speculative_adaptive=False)
    assert _tokens(llm.generate(test_prompts, _greedy(REF_TOKENS), use_tqdm=False)) == llama_reference
    spec = llm.get_metrics()["spec_decode"]
    assert spec["num_past_spec_max_len"] > 0 and spec["num_spec_steps"] > 0
    # speculative_disable_by_batch_size: a batch that large never speculates
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3,
                   speculative_disable_by_batch_size=4)
    outs = llm.generate(test_prompts[:8], _greedy(REF_TOKENS), use_tqdm=False)
    assert _tokens(outs) == llama_reference[:8]


def test_vllm_v1_speculative_config_and_typical_acceptance(tiny_llama, llama_reference,
                                                           test_prompts):
    llm = tiny_llm(tiny_llama, speculative_config={
        "method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2})
    outs = llm.generate(test_prompts[:4], _greedy(REF_TOKENS), use_tqdm=False)
    assert _tokens(outs) == llama_reference[:4]
    lossy = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=2,
                     spec_decoding_acceptance_method="typical_acceptance_sampler")
    outs = lossy.generate(test_prompts[:4], SamplingParams(temperature=1.0, max_tokens=16,
                                                           seed=3), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)


def test_metrics_log_line(tiny_llama, test_prompts, caplog):
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=2)
    llm.generate(test_prompts[:2], _greedy(9), use_tqdm=False)
    with caplog.at_level(logging.INFO, logger="specserve.spec_decode"):
        line = llm.llm_engine.speculation.metrics.maybe_log(force=True)
    assert line.startswith("Speculative metrics: Draft acceptance rate: 1.000")
    assert "Number of speculative tokens: 2" in caplog.text


@pytest.mark.parametrize("kwargs, match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": None}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 3, "speculative_draft_tensor_parallel_size": 2},
     "speculative_draft_tensor_parallel_size"),
    ({"num_speculative_tokens": 3, "speculative_max_model_len": 100000},
     "speculative_max_model_len"),
    ({"num_speculative_tokens": 3, "spec_decoding_acceptance_method": "magic"},
     "spec_decoding_acceptance_method"),
])
def test_bad_speculative_arguments(tiny_llama, tiny_llama_draft, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_llama), device="cpu", speculative_model=str(tiny_llama_draft),
            **kwargs)


def test_mismatched_vocab_is_rejected(tiny_llama, tmp_path):
    from checkpoints import build_tiny_checkpoint

    other = build_tiny_checkpoint(tmp_path / "other", "llama", vocab_size=512, num_layers=1)
    with pytest.raises(ValueError, match="vocab size 512"):
        LLM(model=str(tiny_llama), device="cpu", speculative_model=str(other),
            num_speculative_tokens=2)


def test_verification_is_one_target_pass(tiny_llama, test_prompts, monkeypatch):
    """Each engine step runs the target exactly once, whatever the proposal lengths."""
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=3,
                   speculative_adaptive=False)
    engine = llm.llm_engine
    calls = []
    # logits, or argmax ids (the greedy fast path; proposals may be fed on the device)
    for name in ("execute", "execute_argmax_device"):
        original = getattr(engine.runner, name)
        monkeypatch.setattr(engine.runner, name, lambda runs, *a, original=original, **kw: (
            calls.append([len(r.token_ids) for r in runs]) or original(runs, *a, **kw)))
    steps = 0
    for i, prompt in enumerate(test_prompts[:4]):
        engine.add_request(str(i), prompt, _greedy(9))
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert len(calls) == steps
    assert any(all(n == 4 for n in lens) for lens in calls)  # [last] + 3 proposals, batched


def test_verification_mixed_with_prefill_chunks(tiny_llama, tiny_llama_draft, llama_reference,
                                                test_prompts):
    """A small token budget forces prompt chunks to share steps with verification runs (a
    fixed k: the adaptive policy may find this draft not worth running)."""
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3,
                   max_num_batched_tokens=40, max_num_seqs=6, speculative_adaptive=False)
    engine = llm.llm_engine
    mixed_steps = 0

    def spy(original):
        def run(runs, *a, **kw):
            nonlocal mixed_steps
            kinds = {len(r.logit_offsets) > 1 and r.start > 0 for r in runs}
            mixed_steps += any(len(r.token_ids) > 4 for r in runs) and True in kinds
            return original(runs, *a, **kw)
        return run

    # logits, or argmax ids (the greedy fast path; proposals may be fed on the device)
    engine.runner.execute = spy(engine.runner.execute)
    engine.runner.execute_argmax_device = spy(engine.runner.execute_argmax_device)
    outs = llm.generate(test_prompts, _greedy(REF_TOKENS), use_tqdm=False)
    assert _tokens(outs) == llama_reference
    assert mixed_steps > 0


def test_a_closed_batch_tells_the_policy_the_drafts_lag(tiny_llama, tiny_llama_draft,
                                                        test_prompts):
    """With nobody waiting, the driver hands the adaptive policy each sequence's remaining and
    generated tokens and the draft's lag (the tokens it would catch up on before proposing:
    the prompts, before it ever ran)."""
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3)
    engine = llm.llm_engine
    driver, seen = engine.speculation, []
    plan = driver.adaptive.plan

    def spy(ids, limits, *args, **kwargs):
        seqs = [s for r in engine.requests.values() for s in r.seqs if s.seq_id in ids]
        seen.append((kwargs, driver.proposer.catch_up_tokens(seqs),
                     sum(max(s.num_tokens - 2, 0) for s in seqs)))
        return plan(ids, limits, *args, **kwargs)

    driver.adaptive.plan = spy
    for i, prompt in enumerate(test_prompts[:3]):
        engine.add_request(str(i), prompt, _greedy(10))
    while engine.has_unfinished_requests():
        engine.step()
    kwargs, lag, prompts = seen[0]
    assert kwargs["closed"] and kwargs["lag"] == lag == prompts > 0  # the draft never ran
    assert kwargs["remaining"] == [9, 9, 9] and kwargs["generated"] == [1, 1, 1]


def test_a_batch_is_closed_when_every_waiting_request_fits_in_it(tiny_llama, test_prompts):
    """Requests that wait only for prefill budget will join the batch anyway: a sequence that
    finishes early frees a row nobody needs. One that waits for a row makes it open."""
    for max_num_seqs, closed in ((3, True), (2, False)):
        engine = tiny_llm(tiny_llama, max_num_seqs=max_num_seqs).llm_engine
        for i, prompt in enumerate(test_prompts[:3]):
            engine.add_request(str(i), prompt, _greedy(4))
        assert engine.scheduler.is_closed() is closed
        engine.step()
        assert engine.scheduler.is_closed() is closed


def test_a_closed_batch_settled_on_plain_decoding_skips_planning(tiny_llama, tiny_llama_draft,
                                                                 llama_reference, test_prompts,
                                                                 monkeypatch):
    """Once a closed batch past its start settles on plain decoding, nothing can make
    speculation pay again before a sequence joins, so the driver stops planning (its host
    time made those plain steps ~15 % slower on the H200). A joining sequence plans again."""
    import specserve.spec_decode.batch_cap as batch_cap

    monkeypatch.setattr(batch_cap, "MIN_SPEEDUP", 100.0)  # no cap ever pays
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3)
    engine = llm.llm_engine
    calls, limits = [], []
    plan = engine.speculation.adaptive.plan
    engine.speculation.adaptive.plan = lambda *a, **kw: calls.append(1) or plan(*a, **kw)
    limit = engine.speculation._limit
    engine.speculation._limit = lambda *a: limits.append(1) or limit(*a)
    reserved = []  # per step: KV slots reserved for proposals, over the batch
    schedule = engine.scheduler.schedule

    def spy_schedule():
        out = schedule()
        reserved.append(sum(s.num_lookahead for s in out.scheduled))
        return out

    engine.scheduler.schedule = spy_schedule
    committed = []  # per-sequence commit calls (only sequences that had proposals get one)
    on_committed = engine.speculation.on_committed
    engine.speculation.on_committed = lambda *a: committed.append(a[3]) or on_committed(*a)
    for i, prompt in enumerate(test_prompts[:3]):
        engine.add_request(str(i), prompt, _greedy(REF_TOKENS))
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        if steps == REF_TOKENS // 2:
            before = len(calls)
            engine.add_request("late", test_prompts[3], _greedy(4))
            for _ in range(2):  # its prompt, then its first decode
                steps += 1
                for out in engine.step():
                    outputs[out.request_id] = out.outputs[0].token_ids
            assert len(calls) > before  # a new sequence decodes: planned again
    assert [outputs[str(i)] for i in range(3)] == llama_reference[:3]
    assert len(calls) < steps // 2, (len(calls), steps)
    # nor any per-sequence work before it (limits, lists: ~2 % of a plain step on the H200),
    # nor KV slots reserved for proposals and rolled back
    assert len(limits) < 3 * steps // 2, (len(limits), steps)
    assert reserved.count(0) > steps // 2, reserved
    # the policy's clock counted every step (cap measurements keep expiring)
    assert engine.speculation.adaptive.costs.step >= steps - 2
    # and no per-sequence commit call for a row without proposals (counted once per step,
    # ~0.2 ms a step at batch 32 on the H200), while the counters still count every row
    assert all(n > 0 for n in committed)
    total = engine.speculation.metrics.total
    assert total.num_spec_steps == len(committed)
    # every generated token came from a speculative row or from a plain row (one each)
    assert sum(len(t) for t in outputs.values()) == (total.num_emitted_tokens
                                                     + total.num_non_spec_decode_steps)


def test_plain_passes_launched_ahead_in_a_batch_settled_on_plain_decoding(
        tiny_llama, tiny_llama_draft, llama_reference, test_prompts, monkeypatch):
    """A draft model's closed batch settled on plain decoding proposes nothing until a
    sequence joins, so with decode_ahead_enabled each of its plain steps launches the next
    pass (as plain decoding without speculation does): the same tokens, most steps take the
    pass launched ahead, and the one launched when a sequence joins is dropped (that step
    plans again), with every KV block back at the end."""
    import specserve.spec_decode.batch_cap as batch_cap
    from specserve.engine import verify_ahead

    monkeypatch.setattr(batch_cap, "MIN_SPEEDUP", 100.0)  # no cap ever pays: settles plain

    def run(ahead: bool):
        llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft),
                       num_speculative_tokens=3)
        engine = llm.llm_engine
        engine.decode_ahead_enabled = ahead
        for i, prompt in enumerate(test_prompts[:3]):
            engine.add_request(str(i), prompt, _greedy(REF_TOKENS))
        outputs, steps = {}, 0
        with returned_something(verify_ahead, "serves") as taken:
            while engine.has_unfinished_requests():
                if steps == REF_TOKENS // 2:
                    engine.add_request("late", test_prompts[3], _greedy(4))
                for out in engine.step():
                    outputs[out.request_id] = out.outputs[0].token_ids
                steps += 1
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return outputs, taken, steps

    off, _, _ = run(False)
    on, taken, steps = run(True)
    assert on == off and [on[str(i)] for i in range(3)] == llama_reference[:3]
    assert sum(taken) > steps // 2 and not all(taken), (sum(taken), len(taken), steps)


def test_plain_steps_of_a_batch_still_planning_launch_their_next_pass_ahead(
        tiny_llama, tiny_llama_draft, llama_reference, test_prompts):
    """A draft model's closed batch that has not settled on plain decoding plans each next
    step as soon as a step's tokens are read, after plain steps too
    (SpeculationDriver.plan_after_plain): when the next step decodes plainly its pass is
    launched then, whether this step speculated or not, and when it speculates it drafts at
    the planned k. With a scripted plan (two speculative steps, two plain ones, ...) every
    transition happens: the tokens are plain decoding's, the plain passes launched ahead are
    used, the one launched when a request joins is dropped, and every KV block comes back."""
    from specserve.engine import verify_ahead

    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3)
    engine = llm.llm_engine
    driver = engine.speculation
    driver.proposer.launch_ahead_enabled = True  # (off the GPU all three are off)
    engine.verify_ahead_enabled = True
    engine.decode_ahead_enabled = True
    adaptive = driver.adaptive
    policy = adaptive.plan
    plans: list[bool] = []  # per plan: speculates?

    def scripted(seq_ids, limits, *args, **kwargs):
        policy(seq_ids, limits, *args, **kwargs)
        adaptive.settled_plain = False
        speculate = (len(plans) // 2) % 2 == 0
        plans.append(speculate)
        return [min(2, k) if speculate else 0 for k in limits]

    adaptive.plan = scripted
    for i, prompt in enumerate(test_prompts[:3]):
        engine.add_request(str(i), prompt, _greedy(REF_TOKENS))
    outputs, steps = {}, 0
    with (returned_something(verify_ahead, "serves") as taken,
          returned_something(driver, "plan_after_plain") as after_plain):
        while engine.has_unfinished_requests():
            if steps == 8:
                engine.add_request("late", test_prompts[3], _greedy(4))
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
            steps += 1
    assert [outputs[str(i)] for i in range(3)] == llama_reference[:3]
    assert outputs["late"] == llama_reference[3][:4]
    assert sum(after_plain) >= 3 and not all(after_plain)  # plain -> plain, plain -> spec
    assert sum(taken) > steps // 2 and not all(taken), (sum(taken), len(taken), steps)
    assert driver.metrics.total.num_draft_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert driver.proposer.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not driver._recorded_early


def test_a_closed_batch_starts_speculating_only_once_its_prompts_are_in(tiny_llama,
                                                                        tiny_llama_draft,
                                                                        llama_reference,
                                                                        test_prompts):
    """While prompt chunks still run, a closed batch whose draft is far behind (the prompts it
    never saw) does not start speculating, whatever the previous batch ended with: the draft
    would catch up on the prompts decoded so far beside the target's chunks and on the others
    in the next steps (on the H200 at batch 32 ~54 ms over three steps, against ~18 ms in one
    decode step). It starts in the first step of decodes only."""
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft), num_speculative_tokens=3,
                   max_num_batched_tokens=32)
    engine = llm.llm_engine
    driver = engine.speculation
    propose = driver.propose
    mixed, early = [], []  # steps with prompt chunks beside decodes; of those, proposing ones

    def spy(scheduled, sampled, *args, **kwargs):
        out = propose(scheduled, sampled, *args, **kwargs)
        chunks = any(s.num_new_tokens > 1 for s in scheduled)
        if chunks and any(s.num_lookahead for s in sampled):
            mixed.append(1)
            if any(out[0]):
                early.append(1)
        return out

    longest = sorted(range(len(test_prompts)), key=lambda i: len(test_prompts[i]))[-4:]
    for run in range(2):  # the second run's policy has step costs measured from its start
        driver.propose = spy if run else propose
        driver.adaptive.last_cap = 1  # as after a batch that ended speculating
        for i in longest:  # prefilled in chunks of 32 tokens over several steps
            engine.add_request(f"{run}-{i}", test_prompts[i], _greedy(REF_TOKENS))
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
        assert [outputs[f"{run}-{i}"] for i in longest] == [llama_reference[i] for i in longest]
    assert mixed and not early, (len(mixed), len(early))
    assert driver.metrics.total.num_spec_steps > 0  # it did start, once the prompts were in


def _ahead_run(target, draft, prompts, params, ahead: bool, k: int, limit=None):
    """Greedy generation with a draft, proposals launched a step ahead or not; returns the
    tokens, the speculation counters, per step that had proposals launched whether it took
    them, and how many launched windows were continued."""
    llm = tiny_llm(target, speculative_model=str(draft), num_speculative_tokens=k,
                   speculative_adaptive=False)
    driver = llm.llm_engine.speculation
    proposer = driver.proposer
    proposer.launch_ahead_enabled = ahead  # (off the GPU it is off by default)
    if limit is not None:
        plain_limit = driver._limit
        driver._limit = lambda s, b, extra=0: min(plain_limit(s, b, extra), limit(s.seq))
    with (returned_something(proposer, "_take_ahead") as taken,
          returned_something(proposer, "_extend") as extended):
        outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_metrics()["spec_decode"]
    assert proposer._ahead is None  # nothing left in flight once every request is done
    assert not proposer._verified_early
    assert all(not s.block_table for s in proposer.shadows.values())
    return _tokens(outs), stats, taken, len(extended)


@pytest.mark.parametrize("what", ["proposals", "verification"])
@pytest.mark.parametrize("draft_name", ["tiny_llama", "tiny_llama_draft"])
def test_proposals_launched_ahead_change_nothing(tiny_llama, draft_name, request, test_prompts,
                                                 what):
    """Proposals drafted right after a step's verification (before its commits) for the next
    step are the proposals the next step would draft, and with what="verification" the next
    verification launched behind them (planned then) is the one the step would run: same
    tokens, same acceptance counts at a fixed k, with sequences finishing at different steps
    (max_tokens, a stop token inside an accepted run) so that later steps take a subset of
    the rows."""
    run = _ahead_run if what == "proposals" else _verify_ahead_run
    draft = request.getfixturevalue(draft_name)
    prompts = test_prompts[:6]
    params = [_greedy(n) for n in (30, 7, 19, 30, 12, 25)]
    plain_llm = tiny_llm(tiny_llama)
    stop_id = plain_llm.generate(prompts[3], params[3], use_tqdm=False)[0].outputs[0].token_ids[9]
    params[3] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                               stop_token_ids=[stop_id])
    plain = _tokens(plain_llm.generate(prompts, params, use_tqdm=False))
    assert len(plain[3]) <= 10  # the stop fires
    for k in (1, 3):
        off = run(tiny_llama, draft, prompts, params, False, k)
        on = run(tiny_llama, draft, prompts, params, True, k)
        assert off[0] == on[0] == plain
        assert off[1] == on[1]  # every proposal and acceptance count
        assert not off[2] and len(on[2]) >= 5  # launched ...
        assert sum(on[2]) >= 0.8 * len(on[2])  # ... and taken


def test_proposals_launched_ahead_with_changing_lengths(tiny_llama, tiny_llama_draft,
                                                        test_prompts):
    """When the next step wants more tokens than were launched the window is continued, when
    it wants none from some sequences their shadows are put back, and when nothing fits the
    launch is dropped: the draft's state is exactly as if nothing had been launched, same
    tokens and acceptance as without."""
    prompts = test_prompts[:5]
    params = _greedy(26)
    plain = _tokens(tiny_llm(tiny_llama).generate(prompts, params, use_tqdm=False))

    def limit(seq):  # 0..3 proposals, changing from step to step and between sequences
        return (seq.num_tokens * 7 + seq.seq_id * 3) % 4

    off = _ahead_run(tiny_llama, tiny_llama, prompts, params, False, 3, limit)
    on = _ahead_run(tiny_llama, tiny_llama, prompts, params, True, 3, limit)
    assert off[0] == on[0] == plain
    assert off[1] == on[1]
    assert any(on[2]) and not all(on[2])  # some taken, some dropped

    def rising(seq):  # one sequence: its k often rises above the launched one
        return 1 + (seq.num_tokens // 2) % 3

    for draft in (tiny_llama, tiny_llama_draft):
        off = _ahead_run(tiny_llama, draft, prompts[:1], params, False, 3, rising)
        on = _ahead_run(tiny_llama, draft, prompts[:1], params, True, 3, rising)
        assert off[0] == on[0] == plain[:1]
        assert off[1] == on[1]
        assert on[3] > 0  # some windows continued past the launched k


@pytest.mark.parametrize("verify", [False, True])
def test_proposals_launched_ahead_under_preemption_and_aborts(tiny_llama, llama_reference,
                                                               test_prompts, verify):
    """Sequences preempted or aborted while their next proposals (and with verify, the next
    verification: engine/verify_ahead.py) are in flight: the others' output is unchanged and
    every KV block of target and draft comes back."""
    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=3,
                   speculative_adaptive=False, num_gpu_blocks_override=24, max_model_len=256)
    engine = llm.llm_engine
    proposer = engine.speculation.proposer
    proposer.launch_ahead_enabled = True
    engine.verify_ahead_enabled = verify
    assert _tokens(llm.generate(test_prompts, _greedy(REF_TOKENS), use_tqdm=False)) == llama_reference
    assert engine.scheduler.num_preemptions > 0

    params = _greedy(REF_TOKENS)
    for i in range(6):
        engine.add_request(f"r{i}", test_prompts[i], params)
    aborted, outputs, steps, in_flight = {"r1", "r4"}, {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        steps += 1
        in_flight += engine._verify_ahead is not None
        if steps == 6:
            assert proposer._ahead is not None  # proposals in flight for the next step
            assert (engine._verify_ahead is not None) == verify  # ... and its verification
            for request_id in aborted:
                engine.abort_request(request_id)
    assert in_flight > steps // 2 if verify else in_flight == 0
    for i in range(6):
        if f"r{i}" not in aborted:
            assert outputs[f"r{i}"] == llama_reference[i]
    assert engine.block_manager.num_free_blocks == 24
    assert proposer.block_manager.num_free_blocks == 24
    assert not proposer.shadows and proposer._ahead is None and not proposer._verified_early


def _verify_ahead_run(target, draft, prompts, params, ahead: bool, k: int,
                      adaptive: bool = False):
    """Greedy generation with a draft, its proposals launched a step ahead, and the next
    verification too or not (engine/verify_ahead.py); returns the tokens, the speculation
    counters and, per step with a verification launched ahead, whether it was used."""
    from specserve.engine import verify_ahead

    llm = tiny_llm(target, speculative_model=str(draft), num_speculative_tokens=k,
                   speculative_adaptive=adaptive)
    engine = llm.llm_engine
    engine.speculation.proposer.launch_ahead_enabled = True  # (off the GPU both are off)
    engine.verify_ahead_enabled = ahead
    with returned_something(verify_ahead, "serves") as taken:
        outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_metrics()["spec_decode"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.speculation._recorded_early
    return _tokens(outs), stats, taken


def test_verification_launched_ahead_with_the_adaptive_policy(tiny_llama, tiny_llama_draft,
                                                              test_prompts):
    """With the adaptive policy planning each step when the last verification is read: the
    tokens are plain decoding's, the launched verifications are used, and every KV block
    comes back (_verify_ahead_run)."""
    prompts = test_prompts[:8]
    params = _greedy(40)
    plain = _tokens(tiny_llm(tiny_llama).generate(prompts, params, use_tqdm=False))
    for draft in (tiny_llama, tiny_llama_draft):
        tokens, stats, taken = _verify_ahead_run(tiny_llama, draft, prompts, params, True, 4,
                                                 adaptive=True)
        assert tokens == plain
        assert stats["num_draft_tokens"] > 0
        assert taken and sum(taken) >= 0.5 * len(taken), taken


def test_verification_launched_ahead_when_requests_join(tiny_llama, llama_reference,
                                                        test_prompts):
    """Requests that arrive while a verification launched ahead is in flight: the step that
    admits them verifies as usual (the launched pass is discarded and its KV slots rolled
    back), the batch goes on launching ahead once it is closed again, and every output is
    plain decoding's."""
    from specserve.engine import verify_ahead

    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama), num_speculative_tokens=3,
                   speculative_adaptive=False)
    engine = llm.llm_engine
    engine.speculation.proposer.launch_ahead_enabled = True
    engine.verify_ahead_enabled = True
    with returned_something(verify_ahead, "serves") as taken:
        params = _greedy(REF_TOKENS)
        for i in range(3):
            engine.add_request(f"r{i}", test_prompts[i], params)
        outputs, steps, joined = {}, 0, 0
        while engine.has_unfinished_requests():
            if steps in (5, 9) and engine._verify_ahead is not None:
                for _ in range(2):
                    i = 3 + joined
                    engine.add_request(f"r{i}", test_prompts[i], params)
                    joined += 1
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
            steps += 1
    assert joined == 4
    assert [outputs[f"r{i}"] for i in range(7)] == llama_reference[:7]
    assert sum(taken) >= 5 and not all(taken)  # used, and discarded where requests joined
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_verification_launched_ahead_is_used_only_for_its_own_step():
    """verify_ahead.take reads the pass launched ahead only when every scheduled sequence is
    one it verified, at its length, decoding one token, with the planned proposals of that very
    launch, and its block table unchanged; a sequence that finished meanwhile is skipped."""
    import torch

    from specserve.engine import verify_ahead
    from specserve.engine.scheduler import ScheduledSequence
    from specserve.engine.sequence import Sequence

    def seq(seq_id: int, length: int, table: list[int]) -> Sequence:
        return Sequence(seq_id, f"r{seq_id}", 0, [1] * (length - 1), _greedy(8), 0.0,
                        token_ids=[1] * length, num_computed_tokens=length - 1,
                        block_table=list(table))

    def ahead() -> verify_ahead.VerifyAhead:
        # seq 1: length 10, 2 proposals (rows 0-2); seq 2: length 20, 1 proposal (rows 3-4)
        return verify_ahead.VerifyAhead(
            lengths={1: 10, 2: 20}, ks={1: 2, 2: 1}, tables={1: [4], 2: [5, 6]},
            value_start={1: 0, 2: 2}, row_start={1: 0, 2: 3},
            values=torch.tensor([11, 12, 21]), tokens=torch.tensor([11, 99, 7, 21, 8]))

    def step(seqs, ks, news=None):
        return ([ScheduledSequence(s, 1 if news is None else news[i], 4)
                 for i, s in enumerate(seqs)], [[0] * k for k in ks])

    a, b = seq(1, 10, [4]), seq(2, 20, [5, 6])
    scheduled, proposals = step([a, b], [2, 1])
    assert verify_ahead.take(ahead(), scheduled, proposals, True) == [11, 99, 7, 21, 8]
    assert proposals == [[11, 12], [21]]
    scheduled, proposals = step([b], [1])  # seq 1 finished in between: its rows are skipped
    assert verify_ahead.take(ahead(), scheduled, proposals, True) == [21, 8]
    assert verify_ahead.take(ahead(), *step([a, b], [2, 1]), False) is None  # other proposals
    assert verify_ahead.take(ahead(), *step([a, b], [1, 1]), True) is None  # another plan
    assert verify_ahead.take(ahead(), *step([a, b], [2, 1], news=[1, 2]), True) is None
    assert verify_ahead.take(ahead(), *step([a, seq(2, 21, [5, 6])], [2, 1]), True) is None
    assert verify_ahead.take(ahead(), *step([a, seq(2, 20, [5, 9])], [2, 1]), True) is None
    assert verify_ahead.take(ahead(), *step([a, b, seq(3, 5, [7])], [2, 1, 0]), True) is None
