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
from specserve.engine import verify_ahead
from specserve.engine.block_manager import BlockManager
from specserve.engine.detokenizer import Detokenizer, DetokenizerState
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.scheduler import ScheduledSequence, Scheduler
from specserve.engine.sequence import Sequence, SequenceStatus
from specserve.model.layers.quantization import get_quantization_method
from specserve.model.loader import load_hf_config, load_tokenizer, resolve_model
from specserve.model.registry import model_class_for
from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.sample.sampler import compute_logprobs
from specserve.sampling_params import SamplingParams, SamplingType
from specserve.spec_decode.driver import SpeculationDriver
from specserve.spec_decode.factory import check_implemented, create_proposer, load_draft_runner
from specserve.spec_decode.verifier import Verifier, VerifyResult
from specserve.worker.cuda_graphs import DEFAULT_MAX_GRAPH_BATCH
from specserve.worker.kv_cache import bytes_per_block, num_blocks_for_budget, plan_gpu_memory
from specserve.worker.loading import float32_matmul_precision, load_model
from specserve.worker.model_runner import ModelRunner, SequenceRun, select_rows
from specserve.worker.transfer import PendingRead, index_tensor

logger = logging.getLogger(__name__)
# Draft forwards served by CUDA graphs: up to this many tokens per sequence. A proposal step
# feeds 1-2 (the last accepted proposal and the bonus token); a batch that sat out one to
# three steps feeds 2-4, and eagerly a batch-32 1B draft forward costs 6.3 ms against 1.5 ms
# replayed (H200).
DRAFT_GRAPH_QUERY_LEN = 4

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
        if args.speculative is not None:
            check_implemented(args.speculative)  # fail before any weights load
            if args.scheduler.num_scheduler_steps > 1:
                raise ValueError(
                    f"num_scheduler_steps={args.scheduler.num_scheduler_steps} cannot be "
                    "combined with speculative decoding (a speculative step already emits "
                    "several tokens); use num_scheduler_steps=1 or drop the speculative "
                    "arguments.")
        self.device = resolve_device(args.device)
        self.source = resolve_model(args.model)
        self.hf_config = load_hf_config(self.source)
        model_class_for(self.hf_config)  # unsupported architectures fail before the tokenizer
        self.dtype = resolve_dtype(args.dtype, getattr(self.hf_config, "dtype", None),
                                   self.device)
        self.tokenizer = load_tokenizer(self.source, args.tokenizer, args.trust_remote_code)
        if args.quantization is not None:  # a CPU-only method on CUDA fails before loading
            get_quantization_method(args.quantization).check_device(self.device)
        with float32_matmul_precision(args.float32_matmul_precision):
            target = load_model(args.model, self.dtype, self.device, self.source,
                                self.hf_config, quantization=args.quantization)
        self.vocab_size = target.model.vocab_size
        self.max_model_len = self._derive_max_model_len(args.max_model_len,
                                                        target.max_position_embeddings)
        block_size = args.cache.block_size
        self.runner = ModelRunner(target.model, self.device, self.dtype, block_size)
        self.generator = torch.Generator(self.device).manual_seed(args.seed)
        spec = args.speculative
        draft_runner, spec_max_model_len = None, self.max_model_len
        if spec is not None:
            with float32_matmul_precision(args.float32_matmul_precision):
                draft_runner, spec_max_model_len = load_draft_runner(
                    spec, target, self.dtype, self.device, block_size, self.max_model_len)
        sched = args.scheduler
        max_tokens = sched.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                         sched.max_num_seqs)
        if not sched.enable_chunked_prefill:
            max_tokens = max(max_tokens, self.max_model_len)
        num_blocks = self._size_kv_cache(draft_runner, max_tokens)
        self.block_manager = BlockManager(num_blocks, block_size,
                                          args.cache.enable_prefix_caching)
        k = spec.num_speculative_tokens if spec is not None else 0
        self.num_scheduler_steps = sched.num_scheduler_steps
        # Multi-step decoding reserves its later steps' KV slots as lookahead, as speculation
        # reserves its proposals' slots (unused ones are rolled back after the step); they
        # are not tokens of one forward, so they take no token budget.
        lookahead = max(k, self.num_scheduler_steps - 1)
        self.lookahead_slots = lookahead
        self.scheduler = Scheduler(self.block_manager, sched.max_num_seqs, max_tokens,
                                   num_lookahead_slots=lookahead,
                                   max_model_len=self.max_model_len,
                                   budget_lookahead=spec is not None)
        self.runner.warm_up_kernels(self.max_model_len)  # no-ops off CUDA
        if draft_runner is not None:
            draft_runner.warm_up_kernels(spec_max_model_len)
        if not args.enforce_eager:  # no-ops off CUDA; graphs are captured per bucket on first use
            graph_batch = min(sched.max_num_seqs, DEFAULT_MAX_GRAPH_BATCH)
            self.runner.enable_cuda_graphs(graph_batch, k + 1, self.max_model_len)
            if draft_runner is not None:  # proposal steps: 1 token, or a short catch-up
                draft_runner.enable_cuda_graphs(graph_batch, DRAFT_GRAPH_QUERY_LEN,
                                                spec_max_model_len)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.detokenizer,
                                                self._eos_token_ids(), self.max_model_len)
        blocked = self.output_processor.blocked_token_ids
        self.speculation: SpeculationDriver | None = None
        if spec is not None:
            proposer = create_proposer(spec, draft_runner, num_blocks, block_size,
                                       args.cache.enable_prefix_caching, self.vocab_size,
                                       self.generator, blocked, spec_max_model_len)
            self.speculation = SpeculationDriver(spec, proposer, self.max_model_len,
                                                 spec_max_model_len)
        self.verifier = Verifier(
            self.vocab_size, self.generator, blocked,
            acceptance_method=spec.acceptance_method if spec else "rejection_sampler",
            posterior_threshold=spec.posterior_threshold if spec else 0.09,
            posterior_alpha=spec.posterior_alpha if spec else 0.3)
        # The next verification launched at the end of a step (engine/verify_ahead.py): on
        # CUDA, where the GPU runs it while the host commits; on a CPU it would only move work.
        self._verify_ahead: verify_ahead.VerifyAhead | None = None
        self.verify_ahead_enabled = self.device.type == "cuda"
        # ... and for plain greedy decoding (without speculation, or a draft model's closed
        # batch whose next step decodes plainly): the next one-token pass launched at the end
        # of a step. On CUDA: on the H200 it made batch-32 plain decoding 1.20x faster and
        # batch 1 1.02x (BENCHMARKS.md, session 22).
        self.decode_ahead_enabled = self.device.type == "cuda"
        # ... where the plan needs nothing this step's read says (no speculation, or settled
        # on plain decoding), queued before that read and fed with its tokens on the device.
        # Its first form, whose read waited for the pass queued after it, was 0.82x at batch 32
        # and 0.97x at batch 1 on the H200 (BENCHMARKS.md, session 23); the read now waits on an
        # event recorded before that pass (transfer.PendingRead), and `bench_gpu_spec.py
        # --decode-ahead-ab` measured it 1.071x (batch 1) and 1.052x (batch 32) against
        # launching after the read, every round above 1 (H100, session 27). So it is on.
        self.decode_ahead_unread = True
        self.requests: dict[str, Request] = {}
        self._seq_counter = itertools.count()
        logger.info("engine ready in %.2fs: %s, %s on %s, max_model_len=%d",
                    time.perf_counter() - t0, self.source.name, self.dtype, self.device,
                    self.max_model_len)

    # ---- set-up helpers --------------------------------------------------------------------
    def _size_kv_cache(self, draft_runner: ModelRunner | None, max_num_tokens: int) -> int:
        """Target and draft get the same number of blocks, paid from one memory budget; on
        CUDA that budget is what gpu_memory_utilization leaves after the weights and the
        profiled peak of the largest step (max_num_tokens prefill tokens, or a verify step of
        max_num_seqs x (k + 1) logit rows)."""
        cache, block_size = self.args.cache, self.args.cache.block_size
        runners = [self.runner] + ([draft_runner] if draft_runner is not None else [])
        per_block = sum(bytes_per_block(r.model.kv_geometry(), block_size, self.dtype)
                        for r in runners)
        max_num_seqs = self.args.scheduler.max_num_seqs
        max_useful = (max_num_seqs * self.max_model_len) // block_size + 1
        plan = None
        if (self.device.type == "cuda" and cache.num_gpu_blocks_override is None
                and cache.kv_cache_memory_bytes is None):
            spec = self.args.speculative
            k = spec.num_speculative_tokens if spec is not None else 0
            plan = plan_gpu_memory(runners, cache.gpu_memory_utilization, max_num_tokens,
                                   max_num_seqs, k + 1, self.max_model_len)
        num_blocks = num_blocks_for_budget(cache, per_block, self.device, max_useful, plan)
        if num_blocks * block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * block_size} tokens, fewer than max_model_len="
                f"{self.max_model_len}: one full-length sequence would not fit. Lower "
                "max_model_len or give the cache more memory (kv_cache_memory_bytes, "
                "gpu_memory_utilization, num_gpu_blocks_override).")
        for runner in runners:
            runner.init_kv_cache(num_blocks)
        return num_blocks

    @staticmethod
    def _derive_max_model_len(requested: int | None, limit: int) -> int:
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
            self._free_proposer_state(seq)
            self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_metrics(self) -> dict[str, object]:
        """Engine counters for dashboards (the server exposes these on /metrics)."""
        bm = self.block_manager
        metrics: dict[str, object] = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queried_blocks": bm.stats.queried_blocks,
            "prefix_cache_hit_blocks": bm.stats.hit_blocks,
        }
        if self.speculation is not None:
            metrics["spec_decode"] = self.speculation.stats()
        return metrics

    @property
    def verify_ahead_enabled(self) -> bool:
        """Whether a closed greedy batch of a draft model launches each step's verification at
        the end of the step before (engine/verify_ahead.py; on by default on CUDA)."""
        return self._verify_ahead_enabled

    @verify_ahead_enabled.setter
    def verify_ahead_enabled(self, enabled: bool) -> None:
        self._verify_ahead_enabled = enabled
        if self.speculation is not None:
            self.speculation.plans_ahead = enabled

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_step = time.perf_counter()
        ahead, self._verify_ahead = self._verify_ahead, None
        if self.speculation is not None:  # (never with multi-step decoding: checked above)
            self.scheduler.num_lookahead_slots = (
                self.lookahead_slots if self.speculation.wants_lookahead() else 0)
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self._free_proposer_state(seq)
        if sched.is_empty:
            # Cannot happen while capacity >= max_model_len (checked at start-up); fail loudly
            # rather than spin if that invariant is ever broken.
            assert not self.scheduler.waiting or self.scheduler.running, "scheduler stalled"
            return []
        now = time.time()
        sampled = [s for s in sched.scheduled if s.samples]
        proposals: list[list[int]] = [[] for _ in sampled]
        draft_probs = pending = None
        seqs = [s.seq for s in sampled]
        argmax_rows = self._argmax_suffices(seqs, {})  # greedy rows, if no prompt logprobs
        if self.speculation is not None:
            # A greedy verification (argmax rows, no logprobs of any kind) can take a draft
            # model's proposals straight from the device.
            on_device = (all(s.seq.params.prompt_logprobs is None for s in sched.scheduled)
                         and argmax_rows)
            proposals, draft_probs, pending = self.speculation.propose(
                sched.scheduled, sampled, on_device, closed=self.scheduler.is_closed())
        runs, sample_rows, prompt_rows = self._build_runs(sched.scheduled, proposals)
        logits = logprobs = None
        num_steps = self._multi_step_window(sched.scheduled, prompt_rows)
        if num_steps > 1:
            # Greedy multi-step window: each sequence's tokens of num_steps forwards, committed
            # below like an accepted run (a stop inside the window truncates there).
            emitted = self.runner.execute_argmax_steps(runs, num_steps)
            verified = VerifyResult(emitted, [0] * len(emitted))
        elif pending is not None:
            # Proposals still on the device: fed into the verification pass there, read back
            # with its argmax tokens (the step's one sync); the placeholders get their values.
            # That pass may have been launched at the end of the last step (verify_ahead).
            row_tokens = None if ahead is None else verify_ahead.take(
                ahead, sched.scheduled, proposals, self.speculation.took_launched)
            verified = (self._verify_on_device(sched.scheduled, runs, proposals, pending)
                        if row_tokens is None
                        else self.verifier.accept_greedy(proposals, row_tokens))
        elif argmax_rows and not prompt_rows:
            # Greedy fast path: the target pass returns each row's argmax token, not logits
            # (ONE pass still scores everything; its token read is the step's one sync). That
            # pass may have been launched in the last step (decode_ahead_enabled).
            if ahead is not None and not verify_ahead.serves(ahead, sched.scheduled,
                                                             proposals, True):
                ahead = None
            early = self._plain_plan_unread(sched.scheduled, sampled, proposals)
            if early:
                # the next pass is queued before this one's tokens are read, fed with them on
                # the device, so the GPU never waits for this step's host work
                # (a graph's output is overwritten by the next replay of its bucket: both uses
                # of these tokens, the read's copy and the next pass's feed, are queued first)
                unread = (self.runner.execute_argmax_device(runs) if ahead is None
                          else verify_ahead.last_tokens(ahead, sched.scheduled))  # [n]
                tokens_read = PendingRead(unread)  # (its wait skips the pass queued next)
                self._verify_ahead = verify_ahead.launch(
                    self.runner, self.block_manager, sampled, [[0]] * len(sampled), early,
                    None, last_on_device=unread)
                row_tokens = tokens_read.tolist()
            else:
                row_tokens = (self.runner.execute_argmax(runs) if ahead is None
                              else verify_ahead.read(ahead, sched.scheduled, proposals))
            verified = self.verifier.accept_greedy(proposals, row_tokens)
            plan = None if early else self._plain_plan_ahead(sched.scheduled, sampled,
                                                             proposals, verified)
            if plan:
                self._verify_ahead = verify_ahead.launch(
                    self.runner, self.block_manager, sampled, verified.emitted, plan, None)
        else:
            logits = self.runner.execute(runs)  # [R, vocab]: ONE target pass scores everything
            sample_logits = select_rows(logits, sample_rows)  # [sum(k_i + 1), vocab], no sync
            verified = self.verifier.verify(seqs, proposals, draft_probs,
                                            sample_logits)  # reads tokens: the step's one sync
            if any(s.params.logprobs is not None for s in seqs):
                logprobs = compute_logprobs(sample_logits)  # [sum(k_i + 1), vocab]
        if pending is not None:
            # the next step's draft proposals start on the device now, while this step's
            # tokens are committed (SpeculationDriver.launch_ahead), and in a closed batch of
            # decodes its verification too (verify_ahead)
            closed = (self.verify_ahead_enabled and not self.scheduler.waiting
                      and len(sampled) == len(sched.scheduled))
            launched = self.speculation.launch_ahead(sampled, proposals, verified, closed)
            # (a next step planned plain gets its pass launched only with decode_ahead_enabled)
            if launched is not None and (launched[1] is not None or self.decode_ahead_enabled):
                self._verify_ahead = verify_ahead.launch(
                    self.runner, self.block_manager, sampled, verified.emitted, *launched)
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
        row = plain_rows = 0
        for i, s in enumerate(sampled):
            req = touched[s.seq.request_id]
            self._commit(req, s.seq, proposals[i], verified.emitted[i],
                         verified.num_accepted[i], None if logprobs is None else logprobs[row:])
            row += len(proposals[i]) + 1
            plain_rows += not proposals[i]
        if self.speculation is not None and plain_rows:
            self.speculation.on_plain_rows(plain_rows)
        for s in sched.scheduled:
            if s.seq.is_finished:
                self._free_proposer_state(s.seq)
                self.scheduler.finish(s.seq)
            else:
                keep = s.seq.num_tokens  # unused lookahead slots go back
                if self._verify_ahead is not None:  # ... but not those the next pass uses
                    keep = max(keep, self._verify_ahead.keep_slots(s.seq.seq_id))
                self.block_manager.rollback(s.seq, keep)
                self.block_manager.register_computed_blocks(s.seq)
        outputs = [self._make_output(req) for req in touched.values()]
        if self.speculation is not None:
            # The whole step, host work included (scheduling, proposing, committing and
            # detokenizing every emitted token): what speculation has to beat is plain decoding's
            # tokens per second of wall time, not just the cost of the target pass.
            self.speculation.observe_step(time.perf_counter() - t_step)
            self.speculation.metrics.maybe_log()
        return outputs

    def _plain_batch_decodes_ahead(self, scheduled: list[ScheduledSequence],
                                   sampled: list[ScheduledSequence],
                                   proposals: list[list[int]]) -> bool:
        """Whether this step's next plain passes may be launched ahead at all: on
        (decode_ahead_enabled), no multi-step windows, a closed batch (nobody waiting) of
        one-token decodes, every one sampled, none verifying proposals."""
        return (self.decode_ahead_enabled and self.num_scheduler_steps <= 1
                and not any(proposals) and not self.scheduler.waiting
                and len(sampled) == len(scheduled)
                and all(s.num_new_tokens == 1 for s in scheduled))

    def _plain_plan_unread(self, scheduled: list[ScheduledSequence],
                           sampled: list[ScheduledSequence],
                           proposals: list[list[int]]) -> dict[int, int] | None:
        """The sequences whose next one-token pass this plain greedy step launches before it
        reads its own tokens (as {seq_id: 0}), or None: _plain_plan_ahead's closed batch
        without speculation or settled on plain decoding, where the plan needs nothing the
        read says (each sequence emits exactly one token; one that stops on it is simply not
        read next step)."""
        if not (self.decode_ahead_unread and self._plain_batch_decodes_ahead(
                scheduled, sampled, proposals)):
            return None
        if self.speculation is not None and not self.speculation.settled_on_plain(sampled):
            return None
        return self._every_sequence_going_on(sampled) or None

    def _every_sequence_going_on(self, sampled: list[ScheduledSequence]) -> dict[int, int]:
        """{seq_id: 0} for each sequence of a plain step that may still generate once the
        one token it emits is committed: the plan of a plain pass launched ahead."""
        return {s.seq.seq_id: 0 for s in sampled
                if s.seq.tokens_left(self.max_model_len, 1) > 0}

    def _plain_plan_ahead(self, scheduled: list[ScheduledSequence],
                          sampled: list[ScheduledSequence], proposals: list[list[int]],
                          verified: VerifyResult) -> dict[int, int] | None:
        """The sequences whose next one-token pass this plain greedy step launches now
        (decode_ahead_enabled), as {seq_id: 0}, or None: in a closed batch (no multi-step
        windows, nobody waiting, every sequence a one-token decode), without speculation or
        in a draft model's batch settled on plain decoding (whose next step proposes nothing:
        SpeculationDriver.settled_on_plain) every sequence that goes on; in a draft model's
        batch that has not settled, those of a next step planned now that decodes plainly
        again (SpeculationDriver.plan_after_plain). Not after a step that verified
        proposals here (draft-free ones: they are found when a step runs)."""
        if not self._plain_batch_decodes_ahead(scheduled, sampled, proposals):
            return None
        if self.speculation is None or self.speculation.settled_on_plain(sampled):
            return self._every_sequence_going_on(sampled)  # (no proposals: one token each)
        return self.speculation.plan_after_plain(sampled, verified)

    def _commit(self, req: Request, seq: Sequence, proposals: list[int], emitted: list[int],
                num_accepted: int, logprobs: torch.Tensor | None) -> None:
        """Commit the verified tokens one by one; a stop inside the run truncates there."""
        num_tokens_before = seq.num_tokens
        num_committed = 0
        for j, token in enumerate(emitted):
            self.output_processor.commit_token(seq, req.detok[seq.seq_id], token,
                                               None if logprobs is None else logprobs[j])
            num_committed += 1
            if seq.is_finished:
                break
        # The verify pass wrote K/V for [last token] + proposals; the accepted ones are valid.
        seq.num_computed_tokens = seq.num_tokens - 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        if self.speculation is not None and proposals:  # without: on_plain_rows, per step
            self.speculation.on_committed(seq, req.metrics, num_tokens_before, len(proposals),
                                          num_accepted, num_committed)

    def _multi_step_window(self, scheduled: list[ScheduledSequence],
                           prompt_rows: dict[int, list[int]]) -> int:
        """How many greedy decode forwards this step runs back to back (1: a normal step).

        A window needs: num_scheduler_steps > 1, every scheduled sequence a plain greedy
        decode (one new token, logits untouched, no logprobs: its next input is the argmax,
        known on the device) with KV slots reserved ahead, and nobody waiting (a window would
        delay their admission). It is as long as the shortest reservation, and no longer than
        the most tokens any sequence may still emit."""
        if self.num_scheduler_steps <= 1 or self.scheduler.waiting or not scheduled:
            return 1
        if any(not s.samples or s.num_new_tokens != 1 for s in scheduled):
            return 1
        seqs = [s.seq for s in scheduled]
        if not self._argmax_suffices(seqs, prompt_rows):
            return 1
        window = 1 + min(s.num_lookahead for s in scheduled)
        budgets = [s.params.max_tokens - s.num_output_tokens for s in seqs
                   if s.params.max_tokens is not None]
        if len(budgets) == len(seqs):
            window = min(window, max(budgets))
        return max(1, min(window, self.num_scheduler_steps))

    def _verify_on_device(self, scheduled: list[ScheduledSequence], runs: list[SequenceRun],
                          proposals: list[list[int]], pending: torch.Tensor) -> VerifyResult:
        """Greedy verification of proposals that are still on the device (pending [S, K]):
        they are written into the pass's input tokens there, then read back together with
        the pass's argmax tokens in one read, and proposals' placeholders are filled in."""
        rows: list[int] = []  # packed input rows of the proposals
        src: list[int] = []  # their flat index in pending
        offset, i = 0, 0
        width = pending.shape[1]
        for s, run in zip(scheduled, runs, strict=True):
            if s.samples:
                first = offset + s.num_new_tokens
                rows.extend(range(first, first + len(proposals[i])))
                src.extend(range(i * width, i * width + len(proposals[i])))
                i += 1
            offset += len(run.token_ids)
        device = pending.device
        values = pending.flatten()[index_tensor(src, device)]  # [P]
        tokens = self.runner.execute_argmax_device(
            runs, fed=(index_tensor(rows, device), values))  # [R]
        read = torch.cat([values, tokens]).tolist()  # the step's one read
        values_host, row_tokens = read[: len(src)], read[len(src):]
        j = 0
        for props in proposals:
            props[:] = values_host[j : j + len(props)]
            j += len(props)
        return self.verifier.accept_greedy(proposals, row_tokens)

    def _argmax_suffices(self, seqs: list[Sequence], prompt_rows: dict[int, list[int]]) -> bool:
        """No logits are needed this step: no prompt logprobs, no sampled logprobs, and every
        sampled row greedy with untouched logits (the verifier's condition)."""
        return (not prompt_rows and all(s.params.logprobs is None for s in seqs)
                and self.verifier.argmax_suffices(seqs))

    def _free_proposer_state(self, seq: Sequence) -> None:
        if self.speculation is not None:
            self.speculation.free(seq)

    def _build_runs(self, scheduled: list[ScheduledSequence], proposals: list[list[int]]):
        """One run per sequence; sampled sequences get logits for [last] + proposals."""
        runs: list[SequenceRun] = []
        sample_rows: list[int] = []
        prompt_rows: dict[int, list[int]] = {}
        row = 0
        sampled_index = 0
        for s in scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            tokens = seq.token_ids[start : start + n]
            offsets = self.output_processor.prompt_logprob_offsets(seq, start, n)
            if offsets:
                prompt_rows[seq.seq_id] = list(range(row, row + len(offsets)))
            if s.samples:
                props = proposals[sampled_index]
                sampled_index += 1
                sample_rows.extend(range(row + len(offsets), row + len(offsets) + len(props) + 1))
                tokens = tokens + props
                offsets = offsets + list(range(n - 1, n + len(props)))
            row += len(offsets)
            runs.append(SequenceRun(tokens, start, seq.block_table, offsets))
        return runs, sample_rows, prompt_rows

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
