"""The speculative side of an engine step: who proposes how much, and bookkeeping afterwards.

The engine stays method-agnostic: it asks for proposals, scores them in its one target pass,
lets the verifier pick the tokens, commits them, and reports back here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.scheduler import ScheduledSequence
from specserve.engine.sequence import Sequence
from specserve.outputs import RequestMetrics
from specserve.sampling_params import SamplingType
from specserve.spec_decode.adaptive import AdaptiveSpeculation
from specserve.spec_decode.metrics import SpecDecodeMetrics
from specserve.spec_decode.proposer import Proposer
from specserve.spec_decode.spec_config import SpeculativeConfig
from specserve.spec_decode.verifier import VerifyResult
from specserve.worker.transfer import scatter_rows

CATCH_UP_MEASURED = 4  # a draft catch-up of more tokens per sequence is not a typical step
# A closed draft-free batch of at least IDLE_MIN_BATCH sequences that chose no proposal in
# IDLE_AFTER steps in a row looks for proposals only every IDLE_LOOK_EVERY steps until it
# chooses some again or a sequence joins (SpeculationDriver._skips_looking).
IDLE_MIN_BATCH = 8
IDLE_AFTER = 8
IDLE_LOOK_EVERY = 4
FRESH_SHARE = 0.25  # a draft-free step with more first decodes teaches no cost (_decodes_only)


@dataclass
class _Step:
    batch_size: int  # decoding sequences
    num_proposals: int
    pure: bool  # only decode/verify runs, no prompt chunks (nor a long draft catch-up)
    cap: int | None = None  # a draft model's batch cap on k this step (batch_cap.py)
    catch_up: int = 0  # a long draft catch-up's tokens, in a step of decodes only


@dataclass
class _Plan:
    """The next step's proposals, planned as soon as this step's verification was read
    (SpeculationDriver.launch_ahead with plans_ahead): what the proposals and the next
    verification launched ahead were made for."""

    # seq_id -> (its length once this step is committed, k), for every sequence that may
    # still generate then (one that reaches max_tokens or the context's end is not in it)
    ks: dict[int, tuple[int, int]]
    cap: int | None  # the batch cap the plan ran (batch_cap.py)
    settled: bool  # the plan settled the closed batch on plain decoding

    def k_by_seq(self) -> dict[int, int]:
        """seq_id -> planned k: what the pass launched ahead for this plan verifies."""
        return {seq_id: k for seq_id, (_, k) in self.ks.items()}


def _decodes_only(batch_size: int, scheduled: list[ScheduledSequence],
                  draft_free: bool) -> bool:
    """The step runs only the batch's one-token decodes (no prompt chunks), and with a
    draft-free proposer less than FRESH_SHARE of them are a sequence's first: its time is a
    decode/verify step's (_Step.pure).

    Why the first decodes: a sequence's first decode step also pays its one-time costs (a
    draft-free proposer indexes its prompt, the CPU attention backend gathers its context),
    16-32 ms at batch 1 on the CPU against 7-8 ms for a steady verification of 5 proposals
    (gguf_a8 SmolLM2, suffix decoding). Priced as speculation's cost, that one sample kept a
    request from speculating for CONFIRM_STEPS steps, most of a copying answer's ~25. In a
    batch that admits requests all the time a sequence or two is always fresh, and the
    minimum over a cost's samples absorbs that. (A draft model's first decode step is its
    catch-up on the prompts, which its cap costs price on their own: batch_cap.py.)"""
    if batch_size != len(scheduled) or any(s.num_new_tokens != 1 for s in scheduled):
        return False
    if not draft_free:
        return True
    fresh = sum(s.seq.num_output_tokens == 1 for s in scheduled)
    return fresh < FRESH_SHARE * batch_size


class SpeculationDriver:
    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 spec_max_model_len: int) -> None:
        self.spec = spec
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.spec_max_model_len = spec_max_model_len
        self.metrics = SpecDecodeMetrics(spec.num_speculative_tokens)
        self.adaptive = (AdaptiveSpeculation(spec.num_speculative_tokens)
                         if spec.adaptive else None)
        # seq_id -> (start, declined proposal, its match length)
        self._shadows: dict[int, tuple[int, list[int], int]] = {}
        self._match_lengths: dict[int, int] = {}  # seq_id -> match length of its proposal
        self._step: _Step | None = None  # shape of the step being run (for its timing)
        self._last_was_spec = False
        # newest seq_id of a closed draft-model batch that settled on plain decoding
        # (AdaptiveSpeculation.settled_plain): planning is skipped while no newer one joins
        self._settled_newest: int | None = None
        # draft-free: steps in a row a closed batch chose no proposal, and its newest seq_id
        self._idle_steps = 0
        self._idle_newest = -1
        # this step's proposals were drafted on the device: (their longest k, who proposed),
        # what launch_ahead starts for the next step
        self._launch: tuple[int, set[int]] | None = None
        # Plan the next step when this one's verification is read (launch_ahead), so that
        # the engine can launch the next verification pass ahead as well
        # (engine/verify_ahead.py); that plan, and the sequences whose outcomes it recorded.
        self.plans_ahead = False
        self._next_plan: _Plan | None = None
        self._recorded_early: set[int] = set()

    # ---- before the target pass ------------------------------------------------------------
    def _limit(self, s: ScheduledSequence, batch_size: int, extra: int = 0) -> int:
        """Hard cap on proposals for one decoding sequence (0: plain decode this step); with
        extra, for its next step once extra more tokens are committed (plan_ahead).

        A sequence of T tokens verifies positions T-1 .. T+k-1 and may gain k+1 tokens, so
        k <= max_model_len - T - 1 keeps every computed position below max_model_len - 1 and
        the sequence ends exactly at the limit. Proposals also stop at the speculative limit:
        T + k <= speculative_max_model_len (a draft computes positions up to T + k - 2)."""
        seq, spec = s.seq, self.spec
        if spec.disable_by_batch_size is not None and batch_size >= spec.disable_by_batch_size:
            return 0
        num_tokens = seq.num_tokens + extra
        k = s.num_lookahead
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - extra - 1)
        k = min(k, self.max_model_len - num_tokens - 1)
        if k > 0 and num_tokens + k > self.spec_max_model_len:
            k = self.spec_max_model_len - num_tokens  # truncate at the speculative limit
            if k <= 0:
                self.metrics.total.num_past_spec_max_len += 1
        return max(k, 0)

    def _remaining(self, seq: Sequence, extra: int = 0) -> int:
        """Tokens a sequence may still generate (once extra more are committed)."""
        return seq.tokens_left(self.max_model_len, extra)

    def propose(self, scheduled: list[ScheduledSequence], sampled: list[ScheduledSequence],
                on_device: bool = False, closed: bool = False
                ) -> tuple[list[list[int]], torch.Tensor | None, torch.Tensor | None]:
        """Proposals per sampled sequence ([] for none), their distributions ([S, K, V]) and,
        when on_device allowed it (the step verifies greedily), the proposals still on the
        device ([S, K]: the lists then hold placeholders of the right lengths). closed: no
        request waits for a slot (Scheduler.is_closed; see AdaptiveSpeculation._choose)."""
        self._launch = None
        try:
            return self._propose(scheduled, sampled, on_device, closed)
        finally:
            # proposals launched at the end of the last step that this step did not take
            # (it planned other lengths, or none at all): undone
            self.proposer.drop_ahead()

    def _propose(self, scheduled: list[ScheduledSequence], sampled: list[ScheduledSequence],
                 on_device: bool, closed: bool
                 ) -> tuple[list[list[int]], torch.Tensor | None, torch.Tensor | None]:
        proposals: list[list[int]] = [[] for _ in sampled]
        self._step = None
        plan, self._next_plan = self._next_plan, None
        if self._settled_newest is not None:
            if closed and self.settled_on_plain(sampled):
                # A draft model's closed batch settled on plain decoding (see below): no
                # planning, nor any other per-sequence work, and no KV slots reserved for
                # proposals (wants_lookahead). At batch 32 on the H200 the planning's host
                # time made these plain steps ~1 ms (15 %) slower than the plain engine's,
                # and the limits and lists built before it 0.1-0.15 ms (2 %). The policy's
                # clock still advances, so cap measurements still expire and a later batch
                # tries caps again (else an engine that settled at acceptance 0.5 never
                # learned that a later batch accepted 0.9: measured, every later run plain).
                self._step = _Step(len(sampled), 0, _decodes_only(len(sampled), scheduled,
                                                                   not self.proposer.has_probs))
                self.adaptive.costs.step += 1
                return proposals, None, None
            self._settled_newest = None  # a sequence joined (or the batch opened): plan again
        decoding = [(i, s) for i, s in enumerate(sampled) if s.num_lookahead > 0]
        if self.adaptive is not None and decoding:
            # Timings of pure decode/verify steps teach the cost model; prompt chunks
            # would blur them (B: decoding sequences, all of them sampling this step).
            self._step = _Step(len(decoding), 0, _decodes_only(len(decoding), scheduled,
                                                               not self.proposer.has_probs))
        seqs = [s.seq for _, s in decoding]
        if plan is not None and seqs and all(
                plan.ks.get(seq.seq_id, (-1, 0))[0] == seq.num_tokens for seq in seqs):
            # planned when the last verification was read (launch_ahead): its k for each
            ks = [plan.ks[seq.seq_id][1] for seq in seqs]
            if self._step is not None:
                self._step.cap = plan.cap
            self._settled_newest = max(seq.seq_id for seq in seqs) if plan.settled else None
            if not any(ks):
                return proposals, None, None
            return self._proposals(decoding, seqs, ks, sampled, proposals, on_device)
        if self.adaptive is not None and seqs:
            pinned = [seq.params.sampling_type is not SamplingType.GREEDY for seq in seqs]
            ids = [seq.seq_id for seq in seqs]
            if not self.proposer.has_probs and self._skips_looking(ids, closed, any(pinned)):
                # (before the limits and the declined proposals' scoring, which a step that
                # does not look would compute for nothing: ~0.1 ms at batch 32 on the CPU)
                self.adaptive.costs.step += 1
                return proposals, None, None
        ks = [self._limit(s, len(scheduled)) for _, s in decoding]
        if self._shadows:
            for seq in seqs:
                self._resolve_shadow(seq)
        if not any(ks):
            return proposals, None, None
        if self.adaptive is not None:
            if not self.proposer.has_probs:
                # Draft-free proposals are cheap: find them first, then keep what pays.
                out = self.proposer.propose(seqs, ks)
                found = [t[:k] for t, k in zip(out.token_ids, ks, strict=True)]
                lengths = out.match_lengths or [0] * len(seqs)
                ks = self.adaptive.plan(ids, [len(t) for t in found], pinned=pinned,
                                        closed=closed, match_lengths=out.match_lengths)
                for (i, _), seq, tokens, k, length in zip(decoding, seqs, found, ks, lengths,
                                                          strict=True):
                    proposals[i] = tokens[:k]
                    if k:
                        self._match_lengths[seq.seq_id] = length
                    elif tokens and seq.seq_id not in self._shadows:
                        # declined: scored later against the tokens that get committed
                        self._shadows[seq.seq_id] = (seq.num_tokens, tokens, length)
                self._step.num_proposals = sum(ks)
                self._idle_steps = 0 if any(ks) else self._idle_steps + 1
                return proposals, None, None
            newest = max(ids)
            lag = self.proposer.catch_up_tokens(seqs) if closed else 0
            if closed and not self._step.pure and lag > CATCH_UP_MEASURED * len(seqs):
                # While a closed batch's prompts are still being prefilled, a draft that is
                # far behind (the prompts it never saw) does not start: it would catch up on
                # the prompts of the sequences decoding so far beside the target's prompt
                # chunks, and on the rest in the next steps. At batch 32 on the H200 that
                # spread the draft's prefill over three steps, ~54 ms, against ~18 ms in one
                # decode step.
                self.adaptive.costs.step += 1
                return proposals, None, None
            ks = self.adaptive.plan(
                ids, ks, pinned=pinned, plan_first=True, closed=closed,
                remaining=[self._remaining(seq) for seq in seqs] if closed else None,
                generated=[seq.num_output_tokens for seq in seqs] if closed else None,
                lag=lag)
            settled = closed and self.adaptive.settled_plain and not any(pinned)
            self._settled_newest = newest if settled else None
            self._step.cap = self.adaptive.last_cap
            if not any(ks):
                return proposals, None, None
        return self._proposals(decoding, seqs, ks, sampled, proposals, on_device)

    def _proposals(self, decoding: list[tuple[int, ScheduledSequence]], seqs: list[Sequence],
                   ks: list[int], sampled: list[ScheduledSequence],
                   proposals: list[list[int]], on_device: bool
                   ) -> tuple[list[list[int]], torch.Tensor | None, torch.Tensor | None]:
        """The proposer's proposals for the decoding sequences at ks, into proposals (one
        list per sampled sequence), with their distributions and device tokens."""
        out = self.proposer.propose(seqs, ks, on_device)
        rows = [i for i, _ in decoding]  # of sampled, increasing
        draft_probs = None if out.probs is None else scatter_rows(out.probs, rows, len(sampled))
        for (i, _), tokens, k in zip(decoding, out.token_ids, ks, strict=True):
            proposals[i] = tokens[:k]  # a proposer never gets to run past the limits above
        pending = (None if out.device_tokens is None
                   else scatter_rows(out.device_tokens, rows, len(sampled)))  # [S, K]
        if pending is not None and self.proposer.launches_ahead:
            self._launch = (max(ks), {seq.seq_id for seq, k in zip(seqs, ks, strict=True) if k})
        if self._step is not None:
            self._step.num_proposals = sum(len(p) for p in proposals)
            if out.num_catch_up_tokens > CATCH_UP_MEASURED * sum(1 for k in ks if k):
                # The draft prefilled or caught up on many tokens: a one-time cost that would
                # make this cap look dear while the sample lives. (Small catch-ups, after a
                # step or two of plain decoding, are measured.) Its extra time prices the
                # catch-up itself instead (AdaptiveSpeculation._cap).
                if self._step.pure:
                    self._step.catch_up = out.num_catch_up_tokens
                self._step.pure = False
        return proposals, draft_probs, pending

    def launch_ahead(self, sampled: list[ScheduledSequence], proposals: list[list[int]],
                     verified: VerifyResult, closed: bool = False
                     ) -> tuple[dict[int, int], torch.Tensor] | None:
        """Right after this step's verification is read, before its commits: if its
        proposals were drafted on the device, have the proposer draft the next step's now, at
        this step's longest k for every sequence that proposed and may go on (within its
        limits once this step's tokens are in), so that the device drafts them while the
        host commits, detokenizes, schedules, plans and prepares the next target pass. On the
        H200 at batch 32 a cap-1 step took 8.2 ms against 5.65 for a plain one when the
        draft's forward (~1.1 ms of GPU time) ran after all of that host work, 7.3 ms
        launched here (BENCHMARKS.md, session 18). A step that plans other lengths, or none,
        drops them (propose).

        With plans_ahead, in a closed batch nobody waits to join (closed): the next step is
        planned here, from this step's outcomes (recorded now instead of at the commit), and
        the proposals are launched at the planned k of each sequence; the next step runs that
        plan if its sequences are still at these lengths. Returns ({seq_id: planned k} for
        every sampled sequence that may still generate once this step is committed, the
        launched proposals [A, K] of those with k > 0, in order) when all of them were
        launched, so that the engine can launch the next verification pass now too; else
        None."""
        launch, self._launch = self._launch, None
        if launch is None or self._settled_newest is not None:
            return None
        if self.plans_ahead and closed:
            return self._launch_planned(sampled, proposals, verified)
        k_max, proposed = launch
        seqs, ks, emitted, counts = [], [], [], []
        for s, props, tokens, accepted in zip(sampled, proposals, verified.emitted,
                                              verified.num_accepted, strict=True):
            seq = s.seq
            if seq.seq_id not in proposed:
                continue
            after = seq.num_tokens + len(tokens)
            k = min(k_max, self._remaining(seq) - len(tokens) - 1,
                    self.spec_max_model_len - after)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
                emitted.append(tokens)
                counts.append((len(props), accepted))
        if seqs:
            self.proposer.launch_ahead(seqs, ks, emitted, counts)
        return None

    def _launch_planned(self, sampled: list[ScheduledSequence], proposals: list[list[int]],
                        verified: VerifyResult) -> tuple[dict[int, int], torch.Tensor] | None:
        """launch_ahead with plans_ahead: plan the next step, launch its proposals."""
        plan = self._plan_ahead(sampled, proposals, verified)
        self._next_plan = plan
        seqs, ks, emitted, counts = [], [], [], []
        for s, props, tokens, accepted in zip(sampled, proposals, verified.emitted,
                                              verified.num_accepted, strict=True):
            k = plan.ks.get(s.seq.seq_id, (0, 0))[1]
            if k > 0:
                seqs.append(s.seq)
                ks.append(k)
                emitted.append(tokens)
                counts.append((len(props), accepted))
        if not seqs:
            # the next step decodes plainly: its pass can be launched now all the same
            return (plan.k_by_seq(), None) if plan.ks else None
        self.proposer.launch_ahead(seqs, ks, emitted, counts)
        launched = self.proposer.launched_tokens(seqs)  # [A, K]
        if launched is None:
            return None
        return plan.k_by_seq(), launched

    def plan_after_plain(self, sampled: list[ScheduledSequence],
                         verified: VerifyResult) -> dict[int, int] | None:
        """After a plain greedy step of a draft model's closed batch (plans_ahead; the engine
        checked the batch is closed and every sequence decoded one token): plan the next step
        now, from this step's tokens, as launch_ahead does after a verification. If that plan
        decodes plainly again, returns {seq_id: 0} for every sequence that goes on, so that the
        engine launches the next plain pass now (verify_ahead.launch without proposals); else
        None (the next step drafts at the planned k when it runs).

        Why: on the H200 at batch 32 a plain step whose pass was launched ahead took ~5.45 ms
        against ~6.2 ms for one that was not (its host work hidden). A draft model's batch
        that had not settled on plain decoding ran its plain steps the slow way, so it both
        lost time in them and priced speculation against that slower plain step: at
        acceptance 0.5 it chose to speculate and ran 0.94x the plain engine (session 22)."""
        if (not self.plans_ahead or self.adaptive is None or not self.proposer.has_probs
                or self._settled_newest is not None):
            return None
        plan = self._plan_ahead(sampled, [[] for _ in sampled], verified)
        self._next_plan = plan
        ks = plan.k_by_seq()
        return ks if ks and not any(ks.values()) else None

    @property
    def took_launched(self) -> bool:
        """Whether this step's proposals are the ones launched at the end of the last step
        (so a verification launched with them is this step's)."""
        return self.proposer.took_ahead

    def _plan_ahead(self, sampled: list[ScheduledSequence], proposals: list[list[int]],
                    verified: VerifyResult) -> _Plan:
        """The next step's k per sampled sequence, planned now as _propose would plan it once
        this step's tokens are committed (a closed batch of plain greedy sequences). This
        step's outcomes are recorded first (on_committed then skips them); its timing is not
        in the cost model yet, so the plan lags the measurements by a step."""
        batch = len(sampled)
        extras = [len(tokens) for tokens in verified.emitted]
        limits = [self._limit(s, batch, e) if s.num_lookahead > 0 else 0
                  for s, e in zip(sampled, extras, strict=True)]
        seqs = [s.seq for s in sampled]
        cap, settled = None, False
        if self.adaptive is None:
            ks = limits
        else:
            for seq, props, accepted in zip(seqs, proposals, verified.num_accepted, strict=True):
                if props:
                    self.adaptive.record(seq.seq_id, len(props), accepted,
                                         self._match_lengths.pop(seq.seq_id, 0))
                    self._recorded_early.add(seq.seq_id)
            ks = self.adaptive.plan(
                [seq.seq_id for seq in seqs], limits, pinned=[False] * batch, plan_first=True,
                closed=True, remaining=[self._remaining(seq, e)
                                        for seq, e in zip(seqs, extras, strict=True)],
                generated=[seq.num_output_tokens + e for seq, e in zip(seqs, extras,
                                                                        strict=True)],
                lag=self.proposer.catch_up_tokens(seqs))
            cap, settled = self.adaptive.last_cap, self.adaptive.settled_plain
        return _Plan({seq.seq_id: (seq.num_tokens + e, k)
                      for seq, e, k in zip(seqs, extras, ks, strict=True)
                      if self._remaining(seq, e) > 0}, cap, settled)

    def _skips_looking(self, ids: list[int], closed: bool, any_pinned: bool) -> bool:
        """Whether a draft-free step skips finding and pricing proposals: a closed batch of at
        least IDLE_MIN_BATCH sequences that chose none in its last IDLE_AFTER steps looks only
        every IDLE_LOOK_EVERY steps, until it chooses some again or a sequence joins. On chat
        prompts at batch 32 on the CPU, "[ngram]" chose proposals in ~3 % of steps, and the
        lookups and the policy's pricing in all the others made its plain steps ~3 % slower
        than the plain engine's (0.6-1 ms of a ~33 ms step). Not with sampled sequences: a
        sampled request's k may not depend on its batch mates. Declined proposals found
        earlier are still scored when the batch looks again (they are compared with the
        tokens committed since)."""
        newest = max(ids)
        if newest > self._idle_newest:
            self._idle_newest, self._idle_steps = newest, 0
        if (not closed or any_pinned or len(ids) < IDLE_MIN_BATCH
                or self._idle_steps < IDLE_AFTER):
            return False
        skip = (self._idle_steps - IDLE_AFTER + 1) % IDLE_LOOK_EVERY != 0
        if skip:
            self._idle_steps += 1  # (a step that looks counts itself once it has planned)
        return skip

    def settled_on_plain(self, sampled: list[ScheduledSequence]) -> bool:
        """Whether these sequences are a draft model's closed batch settled on plain decoding
        (see _propose): while the batch stays closed and no newer sequence joins, the next
        step proposes nothing and plans nothing, so its plain pass may be launched now
        (LLMEngine.decode_ahead_enabled). If the batch opens instead, that step plans again
        and the pass launched ahead is not used (verify_ahead.take)."""
        return (self._settled_newest is not None and bool(sampled)
                and max(s.seq.seq_id for s in sampled) <= self._settled_newest)

    def wants_lookahead(self) -> bool:
        """Whether the scheduler should reserve KV slots for proposals next step: not while a
        closed batch is settled on plain decoding (reserving and rolling them back for every
        sequence is host work a plain step would not do). A joining sequence ends that in its
        prompt step (propose), so its first decode step plans with slots again."""
        return self._settled_newest is None

    def _resolve_shadow(self, seq: Sequence) -> None:
        """Score a declined proposal once the committed tokens decide it: the acceptance a
        verification would have had (for a point mass, P(accept x) = p(x) = P(sampled == x))."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            return
        start, tokens, length = shadow
        committed = seq.token_ids[start : start + len(tokens)]
        matched = 0
        while matched < len(committed) and committed[matched] == tokens[matched]:
            matched += 1
        if matched < len(committed) or matched == len(tokens):  # a mismatch, or all matched
            del self._shadows[seq.seq_id]
            self.adaptive.record(seq.seq_id, len(tokens), matched, length)

    # ---- after it --------------------------------------------------------------------------
    def observe_step(self, seconds: float) -> None:
        """Wall time of the whole engine step (teaches the adaptive cost model): the target
        pass, a draft model's passes, and the host work per sequence and per emitted token."""
        step, self._step = self._step, None
        if self.adaptive is None or step is None:
            return
        costs = self.adaptive.costs
        caps = self.adaptive.caps
        if step.pure:
            costs.observe(step.batch_size, step.num_proposals, seconds,
                          after_spec=self._last_was_spec)
            # (plain_time scans every batch size's samples, ~23 us on the 2-core CPU once 32
            # sizes are measured: only when a cap needs it, not in a settled batch's steps)
            plain = costs.plain_time(step.batch_size) if step.cap else None
            if plain is not None:
                caps.observe(costs.step, step.batch_size, step.cap, seconds, plain)
        elif step.catch_up and step.cap:
            plain = costs.plain_time(step.batch_size)
            # an unmeasured cap (the first catch-up is the draft's first step) counts as a
            # plain step: the catch-up is then priced a little high
            ratio = caps.ratio(costs.step, step.batch_size, step.cap) or 1.0
            if plain is not None:
                caps.observe_catch_up(costs.step, step.catch_up, seconds - ratio * plain)
        if self._last_was_spec:
            costs.observe_switch(step.num_proposals == 0)
        self._last_was_spec = step.num_proposals > 0

    def on_committed(self, seq: Sequence, metrics: RequestMetrics, num_tokens_before: int,
                     num_proposed: int, num_accepted: int, num_committed: int) -> None:
        """A sequence's verified proposals (num_proposed >= 1) were committed."""
        self.proposer.on_verified(seq, num_tokens_before, num_proposed, num_accepted)
        self.metrics.record(num_proposed, num_accepted, num_committed)
        if seq.seq_id in self._recorded_early:  # _plan_ahead recorded it
            self._recorded_early.discard(seq.seq_id)
        elif self.adaptive is not None:
            self.adaptive.record(seq.seq_id, num_proposed, num_accepted,
                                 self._match_lengths.pop(seq.seq_id, 0))
        metrics.num_spec_steps += 1
        metrics.num_draft_tokens += num_proposed
        metrics.num_accepted_tokens += min(num_accepted, num_committed)
        metrics.num_emitted_tokens += num_committed

    def on_plain_rows(self, count: int) -> None:
        """count sequences committed one token this step without proposals. Counted once per
        step, not per sequence: at batch 32 on the H200 the per-sequence calls that did
        nothing else made a settled batch's plain steps ~0.2 ms (3 %) slower than the plain
        engine's (the step log's host time outside the target runner: 0.65-0.69 against
        0.46-0.52 ms)."""
        self.metrics.total.num_non_spec_decode_steps += count

    def free(self, seq: Sequence) -> None:
        self._recorded_early.discard(seq.seq_id)
        self.proposer.free(seq)
        self._shadows.pop(seq.seq_id, None)
        self._match_lengths.pop(seq.seq_id, None)
        if self.adaptive is not None:
            self.adaptive.forget(seq.seq_id)

    def stats(self) -> dict[str, object]:
        stats = self.metrics.total.as_dict()
        stats["num_speculative_tokens"] = self.metrics.k
        return stats
