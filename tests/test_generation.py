"""End-to-end generation on tiny random checkpoints: exactness, batching, preemption, caching."""

from __future__ import annotations

import pytest
from helpers import hf_greedy, hf_model, tiny_llm, tokenizer

from specserve import SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_llm(tiny_llama):
    return tiny_llm(tiny_llama)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_opt", "tiny_qwen2", "tiny_llama3_rope"])
def test_greedy_batch_equals_transformers_generate(fixture, request, test_prompts):
    path = request.getfixturevalue(fixture)
    prompts = test_prompts[:8]
    outs = tiny_llm(path).generate(prompts, GREEDY, use_tqdm=False)
    hf = hf_model(path)
    tok = tokenizer(path)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, NEW_TOKENS), prompt


def test_batch_invariance(llama_llm, test_prompts):
    alone = [llama_llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
             for p in test_prompts[:4]]
    batch = llama_llm.generate(test_prompts[:16], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch[:4]] == alone


def test_preemption_keeps_outputs_identical(tiny_llama, test_prompts):
    reference = tiny_llm(tiny_llama).generate(test_prompts, GREEDY, use_tqdm=False)
    # 24 blocks of 16 tokens cannot hold 16 sequences of up to ~150 tokens: forces preemption.
    small = tiny_llm(tiny_llama, num_gpu_blocks_override=24, max_model_len=256)
    outs = small.generate(test_prompts, GREEDY, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in reference]
    assert small.llm_engine.block_manager.num_free_blocks == 24  # everything returned


def test_prefix_caching_reuses_blocks(tiny_llama, test_prompts):
    llm = tiny_llm(tiny_llama)
    shared = " ".join(test_prompts[:6])  # a long shared prefix, several blocks
    first = llm.generate(shared + " first question", GREEDY, use_tqdm=False)[0]
    stats = llm.llm_engine.block_manager.stats
    hits_before = stats.hit_blocks
    second = llm.generate(shared + " second question", GREEDY, use_tqdm=False)[0]
    num_shared_blocks = len(tokenizer(tiny_llama).encode(shared)) // 16
    assert stats.hit_blocks - hits_before >= num_shared_blocks - 1 >= 3
    no_cache = tiny_llm(tiny_llama, enable_prefix_caching=False)
    assert no_cache.generate(shared + " second question", GREEDY,
                             use_tqdm=False)[0].outputs[0].token_ids == second.outputs[0].token_ids
    assert first.outputs[0].token_ids  # sanity


def test_seeded_sampling_reproducible_and_batch_independent(llama_llm, test_prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    a = llama_llm.generate(test_prompts[0], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llama_llm.generate(test_prompts[0], params, use_tqdm=False)[0].outputs[0].token_ids
    mates = [SamplingParams(temperature=1.0, max_tokens=24)] * 5
    batch = llama_llm.generate(test_prompts[1:6] + [test_prompts[0]], mates + [params],
                               use_tqdm=False)
    assert a == b == batch[-1].outputs[0].token_ids


def test_n_returns_distinct_completions(llama_llm, test_prompts):
    out = llama_llm.generate(test_prompts[0], SamplingParams(n=4, temperature=1.0, max_tokens=16,
                                                             seed=7), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4


def test_stop_conditions(llama_llm, test_prompts):
    base = llama_llm.generate(test_prompts[2], GREEDY, use_tqdm=False)[0].outputs[0]
    ids, text = base.token_ids, base.text
    # stop token id: generation ends at its first occurrence, token kept, text excluded.
    stop_id = ids[5]
    first = ids.index(stop_id)
    out = llama_llm.generate(test_prompts[2], SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # stop string: text truncated before it (or kept with include_stop_str_in_output).
    stop = text[10:13]
    cut = text.index(stop)
    out = llama_llm.generate(test_prompts[2], SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop]),
        use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.stop_reason == stop
    out = llama_llm.generate(test_prompts[2], SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[: cut + len(stop)]
    # max_tokens: finish_reason length.
    out = llama_llm.generate(test_prompts[2], SamplingParams(temperature=0, max_tokens=3,
                                                             ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ids[:3] and out.outputs[0].finish_reason == "length"


def test_min_tokens_blocks_eos(llama_llm, test_prompts):
    base = llama_llm.generate(test_prompts[3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[1]
    out = llama_llm.generate(test_prompts[3], SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[stop_id], min_tokens=8,
        ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8
    assert stop_id not in out.token_ids[:7]


def test_logprobs_match_transformers(tiny_llama, llama_llm, test_prompts):
    import torch
    out = llama_llm.generate(test_prompts[1], SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        use_tqdm=False)[0]
    hf = hf_model(tiny_llama)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, n):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
    for i, entry in enumerate(out.outputs[0].logprobs):
        token = out.outputs[0].token_ids[i]
        assert abs(entry[token].logprob - ref[n + i - 1, token].item()) < 1e-4
        assert entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
    total = sum(e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids,
                                              strict=True))
    assert abs(out.outputs[0].cumulative_logprob - total) < 1e-5


def test_chat_and_token_id_prompts(llama_llm, tiny_llama):
    tok = tokenizer(tiny_llama)
    msgs = [{"role": "user", "content": "hello there"}]
    chat = llama_llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat.prompt == rendered
    by_ids = llama_llm.generate({"prompt_token_ids": tok.encode(rendered)}, GREEDY,
                                use_tqdm=False)[0]
    assert by_ids.outputs[0].token_ids == chat.outputs[0].token_ids


def test_chunked_prefill_small_token_budget(tiny_llama, test_prompts):
    """Prompts longer than the per-step token budget are prefilled in chunks, mixed with
    decodes of other sequences, with identical results."""
    reference = tiny_llm(tiny_llama).generate(test_prompts, GREEDY, use_tqdm=False)
    chunked = tiny_llm(tiny_llama, max_num_batched_tokens=24, max_num_seqs=4)
    outs = chunked.generate(test_prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
