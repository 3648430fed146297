"""The server under load (localhost only, bounded in count and time): 64 concurrent streams all
correct, a burst past the queue limit answered 429 (not a crash), 16 clients that disconnect
mid-stream give their KV blocks back, and SIGTERM drains in-flight streams before exiting 0.

The server speculates with "[ngram]", so continuous batching and speculation are exercised
together; greedy output must still equal ``LLM.generate`` without speculation.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time

import openai
import pytest
from helpers import tiny_llm
from server_utils import ServerProcess, assert_openai_error, tiny_server_args

from specserve import SamplingParams

pytestmark = pytest.mark.timeout(240)

MAX_NUM_SEQS = 16
MAX_WAITING_SEQS = 48  # capacity = 64 sequences: exactly the concurrent-streams test
NUM_STREAMS = 64
NUM_BURST = 128
NUM_DISCONNECT = 16
MAX_TOKENS = 16
BURST_MAX_TOKENS = 48  # each wave outlasts the burst's arrival, so the queue really fills
CLIENT_TIMEOUT_S = 120.0
MAX_MODEL_LEN = 256  # TINY_SERVER_FLAGS


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(tiny_server_args(
        tiny_llama, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-seqs",
        str(MAX_WAITING_SEQS), "--speculative-model", "[ngram]", "--num-speculative-tokens",
        "3", "--ngram-prompt-lookup-max", "3", "--shutdown-timeout", "20"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return tiny_llm(tiny_llama, max_model_len=256, num_gpu_blocks_override=256)


def greedy_texts(llm, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


async def model_name(client: openai.AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


def wait_idle(server: ServerProcess, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = (m["specserve:kv_cache_usage_perc"] == 0.0
                and m["specserve:num_requests_running"] == 0
                and m["specserve:num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_64_concurrent_streams_complete_correctly(server, reference, test_prompts):
    expected = greedy_texts(reference, test_prompts, MAX_TOKENS)

    async def one(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=model, prompt=test_prompts[i % len(test_prompts)],
            max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = [], None
        async for chunk in stream:
            text.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return "".join(text), usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        client = server.async_client()
        model = await model_name(client)
        tasks = [one(client, model, i) for i in range(NUM_STREAMS)]
        return await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_TIMEOUT_S)

    results = asyncio.run(main())
    for i, (text, completion_tokens) in enumerate(results):
        assert text == expected[i % len(expected)], i
        assert completion_tokens == MAX_TOKENS
    assert wait_idle(server)["specserve:kv_cache_usage_perc"] == 0.0


def test_burst_beyond_queue_limit_gets_429(server, reference, test_prompts):
    expected = greedy_texts(reference, test_prompts, BURST_MAX_TOKENS)

    async def one(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[int, object]:
        try:
            resp = await client.completions.create(
                model=model, prompt=test_prompts[i % len(test_prompts)],
                max_tokens=BURST_MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
            return 200, resp.choices[0].text
        except openai.APIStatusError as exc:
            return exc.status_code, exc.body

    async def main() -> list[tuple[int, object]]:
        client = server.async_client()
        model = await model_name(client)
        tasks = [one(client, model, i) for i in range(NUM_BURST)]
        return await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_TIMEOUT_S)

    results = asyncio.run(main())
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= NUM_BURST // 4
    assert statuses.count(200) >= MAX_NUM_SEQS
    for i, (status, body) in enumerate(results):
        if status == 200:
            assert body == expected[i % len(expected)]
        else:
            assert body["code"] == "queue_full" and "capacity" in body["message"]
    assert server.request("GET", "/health")[0] == 200
    metrics = wait_idle(server)
    assert metrics["specserve:request_rejected_total"] == statuses.count(429)
    status, raw = server.request("POST", "/v1/completions", {"prompt": "x", "n": 65,
                                                             "temperature": 1})
    assert_openai_error(status, raw, 400)  # larger than the whole queue: never admissible


async def _open_stream(port: int, prompt: str) -> asyncio.StreamWriter:
    """A raw streaming request that runs to the end of the context (max_tokens null); returns
    once the first token chunk has arrived."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": prompt, "max_tokens": None, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    status = await reader.readline()
    assert status.startswith(b"HTTP/1.1 200"), (status, await reader.read(2000))
    while True:
        line = await reader.readline()
        assert line, "connection closed before the first chunk"
        if line.startswith(b"data: {"):
            return writer


async def _send_unstreamed(port: int, prompt: str) -> asyncio.StreamWriter:
    """A raw non-streamed request to the end of the context; returns without reading."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": prompt, "max_tokens": None, "ignore_eos": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    return writer


def test_disconnected_streams_free_their_kv_blocks(server, test_prompts):
    idle = wait_idle(server)
    assert idle["specserve:kv_cache_usage_perc"] == 0.0
    successes = idle["specserve:request_success_total"]

    async def main() -> dict[str, float]:
        writers = await asyncio.wait_for(asyncio.gather(*[
            _open_stream(server.port, test_prompts[i])
            for i in range(NUM_DISCONNECT)]), CLIENT_TIMEOUT_S)
        waiting = [await _send_unstreamed(server.port, test_prompts[i]) for i in range(4)]
        deadline = time.monotonic() + 10.0
        while True:  # until the unstreamed ones are in the engine too
            busy = await asyncio.to_thread(server.metrics)
            in_engine = (busy["specserve:num_requests_running"]
                         + busy["specserve:num_requests_waiting"])
            if in_engine >= NUM_DISCONNECT + 4 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        for w in writers + waiting:
            w.close()
        return busy

    busy = asyncio.run(main())
    assert busy["specserve:kv_cache_usage_perc"] > 0.0
    in_engine = busy["specserve:num_requests_running"] + busy["specserve:num_requests_waiting"]
    assert in_engine == NUM_DISCONNECT + 4
    after = wait_idle(server, timeout_s=15.0)
    assert after["specserve:kv_cache_usage_perc"] == 0.0
    assert after["specserve:num_requests_running"] == 0
    assert after["specserve:request_success_total"] == successes  # aborted, not finished
    assert after["specserve:generation_tokens_total"] - idle[
        "specserve:generation_tokens_total"] < NUM_DISCONNECT * MAX_MODEL_LEN // 2


def test_sigterm_drains_in_flight_stream_then_exits_0(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    body = json.dumps({"prompt": "Hello", "max_tokens": 48, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body=body,
                  headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [resp.readline()]
    server.proc.send_signal(signal.SIGTERM)
    while not events[-1].startswith(b"data: [DONE]"):
        line = resp.readline()
        assert line, "stream cut before [DONE]"
        events.append(line)
    chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    conn.close()
    assert server.proc.wait(30) == 0
