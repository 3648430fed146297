"""Prometheus metrics for /metrics, named like vLLM's under the ``specserve:`` prefix.

Two sources: latency histograms and token/request counters are observed on the event loop as
outputs arrive (``observe_output``, the async engine's observer hook); engine state (running and
waiting sequences, KV cache usage, speculative counters) is read from ``LLMEngine.get_metrics``
at scrape time through a custom collector, so the numbers are exact and cost nothing between
scrapes. Each app gets its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from specserve.engine.async_engine import AsyncLLMEngine, RequestHandle
from specserve.outputs import RequestOutput

PREFIX = "specserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0)
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineCollector(Collector):
    """Gauges and counters from the latest engine snapshot (refreshed before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: dict[str, object] = {}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        g.add_metric([self.model_name], float(value))
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric([self.model_name], float(value))
        return c

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if not s:
            return
        yield self._gauge("num_requests_running", "Sequences in the running batch.",
                          s["num_running"])
        yield self._gauge("num_requests_waiting", "Sequences waiting to be scheduled.",
                          s["num_waiting"])
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                          s["kv_cache_usage"])
        yield self._counter("num_preemptions", "Sequences preempted (recomputed later).",
                            s["num_preemptions"])
        yield self._counter("prefix_cache_queries", "Prompt blocks looked up in the prefix "
                            "cache.", s["prefix_cache_queried_blocks"])
        yield self._counter("prefix_cache_hits", "Prompt blocks served by the prefix cache.",
                            s["prefix_cache_hit_blocks"])
        spec = s.get("spec_decode")
        if isinstance(spec, dict):
            yield from self._spec_metrics(spec)

    def _spec_metrics(self, spec: dict) -> Iterator[Metric]:
        yield self._counter("spec_decode_num_drafts", "Sequence-steps that verified proposals.",
                            spec["num_spec_steps"])
        yield self._counter("spec_decode_num_draft_tokens", "Proposed (draft) tokens.",
                            spec["num_draft_tokens"])
        yield self._counter("spec_decode_num_accepted_tokens", "Accepted draft tokens.",
                            spec["num_accepted_tokens"])
        yield self._counter("spec_decode_num_emitted_tokens", "Tokens emitted by speculative "
                            "steps (accepted + recovered/bonus).", spec["num_emitted_tokens"])
        yield self._gauge("spec_decode_draft_acceptance_rate", "Accepted / proposed tokens.",
                          spec["draft_acceptance_rate"])
        yield self._gauge("spec_decode_efficiency", "System efficiency: emitted tokens / "
                          "(steps x (k + 1)).", spec["system_efficiency"])
        yield self._gauge("spec_decode_mean_acceptance_length", "Tokens emitted per "
                          "speculative step.", spec["mean_acceptance_length"])
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by position.",
                                      labels=["model_name", "position"])
        rate = GaugeMetricFamily(PREFIX + "spec_decode_per_position_acceptance_rate",
                                 "Acceptance rate of the draft token at each position.",
                                 labels=["model_name", "position"])
        rates = spec["per_position_acceptance_rate"]
        accepted = spec.get("accepted_per_position")  # present once the engine exports it
        for pos, r in enumerate(rates):
            rate.add_metric([self.model_name, str(pos)], float(r))
            if accepted is not None:
                per_pos.add_metric([self.model_name, str(pos)], float(accepted[pos]))
        yield rate
        if accepted is not None:
            yield per_pos


class ServerMetrics:
    """The registry behind /metrics plus the observer the async engine calls per output."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens "
                             "(a step that emits several tokens counts each).", labels,
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         labels, registry=self.registry)
        self.success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter(PREFIX + "request_rejected", "Requests refused because the "
                                "queue was full (429).", labels, registry=self.registry)
        self.collector = EngineCollector(model_name)
        self.registry.register(self.collector)
        self.model_name = model_name

    def observe_output(self, handle: RequestHandle, out: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new = num_tokens - handle.num_tokens_seen
        name = self.model_name
        if new > 0:
            if handle.last_token_time is None:
                self.ttft.labels(name).observe(now - handle.arrival_time)
                self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids or ()))
            else:
                gap = (now - handle.last_token_time) / new
                for _ in range(new):
                    self.itl.labels(name).observe(gap)
            self.generation_tokens.labels(name).inc(new)
            handle.num_tokens_seen = num_tokens
            handle.last_token_time = now
        if out.finished:
            self.e2e.labels(name).observe(now - handle.arrival_time)
            for c in out.outputs:
                self.success.labels(name, c.finish_reason or "unknown").inc()

    async def render(self) -> bytes:
        """Prometheus text, with engine state read now (on the engine thread)."""
        self.collector.snapshot = await self.engine.get_metrics()
        return generate_latest(self.registry)
