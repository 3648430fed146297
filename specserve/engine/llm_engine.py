"""The engine: add_request / step / abort over the scheduler, model runner and sampler.

One ``step()`` schedules a batch, runs ONE forward pass, samples, commits tokens, checks stops
and returns the outputs of every request that advanced. The offline ``LLM`` loops over it; the
server drives the same loop from a background task.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from specserve.config import EngineArgs, resolve_device, resolve_dtype
from specserve.engine.block_manager import BlockManager
from specserve.engine.detokenizer import Detokenizer, DetokenizerState
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.scheduler import ScheduledSequence, Scheduler
from specserve.engine.sequence import Sequence, SequenceStatus
from specserve.model.loader import (
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)
from specserve.model.registry import build_model
from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.sample.logits_processing import SamplingTensors, process_logits
from specserve.sample.sampler import compute_logprobs, sample
from specserve.sampling_params import SamplingParams, SamplingType
from specserve.worker.model_runner import ModelRunner, SequenceRun

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    detok: dict[int, DetokenizerState] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        self.args = args
        self.device = resolve_device(args.device)
        self.source = resolve_model(args.model)
        self.hf_config = load_hf_config(self.source)
        self.dtype = resolve_dtype(args.dtype, getattr(self.hf_config, "dtype", None),
                                   self.device)
        self.tokenizer = load_tokenizer(self.source, args.tokenizer, args.trust_remote_code)
        model = build_model(self.hf_config, iter_weights(self.source), self.dtype, self.device)
        self.vocab_size = model.vocab_size
        self.max_model_len = self._derive_max_model_len(args.max_model_len)
        block_size = args.cache.block_size
        self.runner = ModelRunner(model, self.device, self.dtype, block_size)
        sched = args.scheduler
        max_tokens = sched.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                         sched.max_num_seqs)
        if not sched.enable_chunked_prefill:
            max_tokens = max(max_tokens, self.max_model_len)
        num_blocks = self.runner.init_kv_cache(
            args.cache, max_useful_tokens=sched.max_num_seqs * self.max_model_len + block_size
        )
        if num_blocks * block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * block_size} tokens, fewer than max_model_len="
                f"{self.max_model_len}: one full-length sequence would not fit. Lower "
                "max_model_len or give the cache more memory (kv_cache_memory_bytes, "
                "gpu_memory_utilization, num_gpu_blocks_override).")
        self.block_manager = BlockManager(num_blocks, block_size,
                                          args.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, sched.max_num_seqs, max_tokens)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.detokenizer,
                                                self._eos_token_ids(), self.max_model_len)
        self.generator = torch.Generator(self.device).manual_seed(args.seed)
        self.requests: dict[str, Request] = {}
        self._seq_counter = itertools.count()
        logger.info("engine ready in %.2fs: %s, %s on %s, max_model_len=%d",
                    time.perf_counter() - t0, self.source.name, self.dtype, self.device,
                    self.max_model_len)

    # ---- set-up helpers --------------------------------------------------------------------
    def _derive_max_model_len(self, requested: int | None) -> int:
        cfg = self.hf_config
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(
            cfg, "max_sequence_length", None) or 2048
        if requested is None:
            return int(limit)
        if requested > limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's context length "
                             f"({limit}); use max_model_len <= {limit}.")
        return requested

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        cfg_eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(cfg_eos, int):
            ids.add(cfg_eos)
        elif isinstance(cfg_eos, (list, tuple)):
            ids.update(int(i) for i in cfg_eos)
        return ids

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate fully before touching any state: a bad request never disturbs others."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params)}.")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        params.verify_vocab(self.vocab_size)
        text, token_ids = self._tokenize(prompt, prompt_token_ids)
        self._check_prompt(token_ids)
        now = arrival_time if arrival_time is not None else time.time()
        seqs = []
        for index in range(params.n):
            generator = None
            if params.sampling_type is SamplingType.RANDOM_SEED:
                generator = torch.Generator(self.device).manual_seed(params.seed + index)
            seqs.append(Sequence(next(self._seq_counter), request_id, index, list(token_ids),
                                 params, now, generator))
        req = Request(request_id, text, list(token_ids), params, seqs,
                      RequestMetrics(arrival_time=now))
        for seq in seqs:
            req.detok[seq.seq_id] = self.detokenizer.start(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def _tokenize(self, prompt, prompt_token_ids) -> tuple[str | None, list[int]]:
        if prompt_token_ids is None and isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
                raise ValueError("prompt token ids must be a list of ints.")
            return prompt, list(prompt_token_ids)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}.")
        return prompt, self.tokenizer.encode(prompt)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token.")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size}).")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(token_ids)} tokens long, but the context "
                             f"length is {self.max_model_len}: it must be shorter, to leave room "
                             "for at least one generated token.")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(token_ids) + 1 > capacity:
            raise ValueError(f"the prompt is {len(token_ids)} tokens long, but the KV cache "
                             f"holds only {capacity} tokens; raise kv_cache_memory_bytes.")

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            # Cannot happen while capacity >= max_model_len (checked at start-up); fail loudly
            # rather than spin if that invariant is ever broken.
            assert not self.scheduler.waiting or self.scheduler.running, "scheduler stalled"
            return []
        now = time.time()
        runs, sample_rows, prompt_rows = self._build_runs(sched.scheduled)
        logits = self.runner.execute(runs)  # [R, vocab]
        sampled = [s for s in sched.scheduled if s.samples]
        tokens, logprobs = self._sample(sampled, logits[sample_rows])
        touched: dict[str, Request] = {}
        for s in sched.scheduled:
            req = self.requests[s.seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.time_in_queue = now - req.metrics.arrival_time
            s.seq.num_computed_tokens += s.num_new_tokens
            rows = prompt_rows.get(s.seq.seq_id)
            if rows is not None:
                self.output_processor.add_prompt_logprobs(s.seq, s, logits[rows])
            touched[req.request_id] = req
        for i, s in enumerate(sampled):
            req = touched[s.seq.request_id]
            token_logprobs = None if logprobs is None else logprobs[i]
            self.output_processor.commit_token(s.seq, req.detok[s.seq.seq_id],
                                               int(tokens[i]), token_logprobs)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.time()
        for s in sched.scheduled:
            if s.seq.is_finished:
                self.scheduler.finish(s.seq)
            else:
                self.block_manager.register_computed_blocks(s.seq)
        return [self._make_output(req) for req in touched.values()]

    def _build_runs(self, scheduled: list[ScheduledSequence]):
        runs: list[SequenceRun] = []
        sample_rows: list[int] = []
        prompt_rows: dict[int, list[int]] = {}
        row = 0
        for s in scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            offsets = self.output_processor.prompt_logprob_offsets(seq, start, n)
            if offsets:
                prompt_rows[seq.seq_id] = list(range(row, row + len(offsets)))
            if s.samples and (not offsets or offsets[-1] != n - 1):
                offsets = offsets + [n - 1]
            if s.samples:
                sample_rows.append(row + len(offsets) - 1)
            row += len(offsets)
            runs.append(SequenceRun(seq.token_ids[start : start + n], start, seq.block_table,
                                    offsets))
        return runs, sample_rows, prompt_rows

    def _sample(self, sampled: list[ScheduledSequence], raw_logits: torch.Tensor):
        if not sampled:
            return [], None
        seqs = [s.seq for s in sampled]
        blocked = [self.output_processor.blocked_token_ids(seq) for seq in seqs]
        tensors = SamplingTensors.from_rows(
            [seq.params for seq in seqs], [seq.output_token_ids for seq in seqs],
            [seq.prompt_token_ids for seq in seqs], self.vocab_size, raw_logits.device,
            torch.float32, blocked_token_ids=blocked,
        )
        final = process_logits(raw_logits, tensors)  # [R, vocab]
        tokens = sample(final, tensors, [seq.generator for seq in seqs], self.generator)
        logprobs = None
        if any(seq.params.logprobs is not None for seq in seqs):
            logprobs = compute_logprobs(raw_logits)  # [R, vocab]
        return tokens.tolist(), logprobs

    def _make_output(self, req: Request) -> RequestOutput:
        outputs = []
        for seq in req.seqs:
            want_logprobs = req.params.logprobs is not None
            outputs.append(CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                logprobs=seq.output_logprobs if want_logprobs else None,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        finished = req.finished
        if finished:
            req.metrics.finished_time = time.time()
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.seqs[0].prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=req.metrics,
        )
