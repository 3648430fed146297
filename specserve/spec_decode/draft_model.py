"""Draft-model speculation: a smaller model with the same vocabulary proposes k tokens.

The draft has its own paged KV cache (same block size and block count as the target, allocated
from the same memory budget) and keeps, per target sequence, a shadow sequence that shares the
target's token list but has its own block table and computed-token count. Each step:

1. one draft forward per sequence feeds every token the draft has not seen yet (the whole prompt
   for a new sequence; after a step the last accepted proposal and the bonus/recovered token),
   and samples proposal 1 from the draft's processed distribution;
2. k - 1 more single-token forwards, batched across sequences, sample proposals 2..k (for
   plain greedy batches one multi-step window: the tokens are fed back on the device; when the
   engine verifies greedily they are not even read back: the verification pass takes them
   from the device, and one read returns proposals and verdicts).

After verification the shadow is rolled back to the accepted length; when all k were accepted
the catch-up in the next step's first forward covers the bonus token, so no extra pass is run.

On a GPU the next step's proposals are launched as soon as a step's verification is read
(``launch_ahead``), before its tokens are committed: the draft's forwards then run while the host
commits and detokenizes, schedules, plans and prepares the next target pass, instead of after
all of that. The next step takes them if it proposes for the same sequences at their launched
lengths (fewer tokens each: a prefix; more: the window continues); otherwise they are dropped
and the shadows put back (``drop_ahead``). A sequence that a stop ends in the commit just leaves
its row unused.
"""

from __future__ import annotations

import dataclasses

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence
from specserve.sample.logits_processing import SamplingTensors, process_logits
from specserve.sample.sampler import probs_from_final_logits, sample
from specserve.spec_decode.proposer import DraftProposals, Proposer
from specserve.spec_decode.verifier import is_plain_greedy
from specserve.worker.model_runner import ModelRunner, SequenceRun
from specserve.worker.transfer import index_tensor, scatter_rows


@dataclasses.dataclass
class _Ahead:
    """Proposals launched right after the last step's verification (DraftModelProposer.
    launch_ahead), for the step after it."""

    rows: dict[int, int]  # seq_id -> its row of proposals.device_tokens
    num_tokens: list[int]  # per row: the sequence's length at launch
    saved: dict[int, int]  # seq_id -> its shadow's computed tokens before the launch
    proposals: DraftProposals  # device_tokens [A, K]


class DraftModelProposer(Proposer):
    has_probs = True

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, vocab_size: int,
                 default_generator: torch.Generator,
                 blocked_token_ids, max_model_len: int | None = None) -> None:
        """max_model_len: the speculative length limit (the draft computes no position at or
        past it; None: no limit beyond the proposals' own)."""
        self.runner = runner
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.vocab_size = vocab_size
        self.default_generator = default_generator
        self.blocked_token_ids = blocked_token_ids  # (seq, num_extra_outputs) -> list[int]
        self.shadows: dict[int, Sequence] = {}
        # Greedy proposals 2..k as one multi-step window (ModelRunner.execute_argmax_steps):
        # on CUDA graphs each proposal feeds the next forward on the device and the k - 1
        # tokens are read back once, instead of one host round trip per proposal.
        self.multi_step = True
        # ... and, where the engine verifies greedily, left on the device for verification.
        self.device_proposals = True
        # Launch the next step's proposals right after a step's verification (module
        # docstring). Only where the device runs them while the host works on: on a CPU it
        # would only move the work.
        self.launch_ahead_enabled = runner.device.type == "cuda"
        self._ahead: _Ahead | None = None
        self._took_ahead = False  # the last propose() returned the launched proposals
        # sequences whose verification launch_ahead already applied (on_verified skips them)
        self._verified_early: set[int] = set()

    # ---- shadow sequences ------------------------------------------------------------------
    def _shadow(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            # Shares the target's token list (same object): the draft always sees commits.
            shadow = dataclasses.replace(seq, token_ids=seq.token_ids, block_table=[],
                                         num_computed_tokens=0, num_hashed_blocks=0,
                                         generator=None)
            self.shadows[seq.seq_id] = shadow
        return shadow

    def catch_up_tokens(self, seqs: list[Sequence]) -> int:
        """The draft's lag: tokens of each sequence it has not run yet, beyond the last two
        (the whole prompt for a sequence it never saw)."""
        total = 0
        for seq in seqs:
            shadow = self.shadows.get(seq.seq_id)
            computed = 0 if shadow is None else shadow.num_computed_tokens
            total += max(seq.num_tokens - computed - 2, 0)
        return total

    def free(self, seq: Sequence) -> None:
        self._verified_early.discard(seq.seq_id)
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def _reserve(self, seq: Sequence, k: int) -> bool:
        """Blocks for the catch-up tokens and k - 1 fed proposals; False if out of blocks."""
        shadow = self._shadow(seq)
        bm = self.block_manager
        if not shadow.block_table:
            if not bm.can_admit(shadow, seq.num_tokens + k):
                return False
            bm.allocate_prefix(shadow)
        needed = seq.num_tokens + k - 1
        if not bm.can_grow(shadow, needed):
            return False
        bm.grow(shadow, needed)
        return True

    # ---- proposing -------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], max_tokens: list[int],
                on_device: bool = False) -> DraftProposals:
        # Plain greedy sequences propose the draft's argmax and are verified greedily, which
        # never reads q: no probabilities, and argmax ids instead of logits.
        greedy = all(is_plain_greedy(s.params) for s in seqs)
        on_device = (on_device and self.device_proposals and greedy
                     and not any(self.blocked_token_ids(s, 0) for s in seqs))
        self._took_ahead = False
        if self._ahead is not None:
            taken = self._take_ahead(seqs, max_tokens) if on_device else None
            self.drop_ahead()
            if taken is not None:
                self._took_ahead = True
                return taken
        # A greedy batch may draft proposals 2..k of every sequence in one window of the
        # longest k (shorter ones are cut afterwards): each gets KV slots for that k.
        window_k = max(max_tokens, default=0) if (self.multi_step or on_device) and greedy else 0
        reserve = [window_k if (window_k >= 3 or on_device) and self._fits(seq, window_k)
                   else k for seq, k in zip(seqs, max_tokens, strict=True)]
        ks = [k if k > 0 and self._reserve(seq, r) else 0
              for seq, k, r in zip(seqs, max_tokens, reserve, strict=True)]
        k_max = max(ks, default=0)
        proposals: list[list[int]] = [[] for _ in seqs]
        probs = None
        if k_max == 0:
            return DraftProposals(proposals, probs)
        if on_device and _reserved_for(ks, reserve, k_max):
            return self._propose_on_device(seqs, ks, k_max)
        device = self.runner.device
        if not greedy:
            probs = torch.zeros(len(seqs), k_max, self.vocab_size, dtype=torch.float32,
                                device=device)
        catch_up = 0
        for step in range(k_max):
            active = [i for i, k in enumerate(ks) if k > step]
            runs = []
            for i in active:
                shadow = self.shadows[seqs[i].seq_id]
                if step == 0:
                    start = shadow.num_computed_tokens
                    tokens = seqs[i].token_ids[start:]
                    catch_up += max(len(tokens) - 2, 0)
                else:
                    start = seqs[i].num_tokens + step - 1
                    tokens = [proposals[i][-1]]
                runs.append(SequenceRun(tokens, start, shadow.block_table, [len(tokens) - 1]))
            step_probs, tokens = self._step_tokens(
                [seqs[i] for i in active], [proposals[i] for i in active], runs, greedy)
            for row, i in enumerate(active):
                proposals[i].append(tokens[row])
                if probs is not None:
                    probs[i, step] = step_probs[row]
                shadow = self.shadows[seqs[i].seq_id]
                shadow.num_computed_tokens = seqs[i].num_tokens + step
            if step == 0 and step_probs is None and self._window_fits(ks, reserve, k_max):
                self._propose_window(seqs, active, proposals, k_max - 1)
                for i in active:
                    del proposals[i][ks[i]:]  # a shorter k rode along in the window
                break
        return DraftProposals(proposals, probs, catch_up)

    def _propose_on_device(self, seqs: list[Sequence], ks: list[int],
                           k_max: int) -> DraftProposals:
        """Plain greedy, nothing blocked, KV slots for k_max everywhere: the catch-up forward
        gives proposal 1, a window of k_max - 1 steps fed on the device gives the rest, and
        nothing is read back: the verification pass takes them from the device and reads them
        with its own result (one device->host read per speculative step instead of three)."""
        active = [i for i, k in enumerate(ks) if k]
        runs, catch_up = [], 0
        for i in active:
            shadow = self.shadows[seqs[i].seq_id]
            tokens = seqs[i].token_ids[shadow.num_computed_tokens:]
            catch_up += max(len(tokens) - 2, 0)
            runs.append(SequenceRun(tokens, shadow.num_computed_tokens, shadow.block_table,
                                    [len(tokens) - 1]))
        first = self.runner.execute_argmax_device(runs)  # [A] proposal 1
        steps = [first[None]]
        if k_max > 1:
            window = [SequenceRun([0], seqs[i].num_tokens, self.shadows[seqs[i].seq_id]
                                  .block_table, [0]) for i in active]
            steps.append(self.runner.execute_argmax_steps_device(window, k_max - 1, first))
        tokens = self._device_tokens(seqs, active, torch.cat(steps).T)  # [A, k_max]
        for i in active:
            self.shadows[seqs[i].seq_id].num_computed_tokens = seqs[i].num_tokens + k_max - 1
        placeholders = [[0] * k for k in ks]
        return DraftProposals(placeholders, None, catch_up,
                              scatter_rows(tokens, active, len(seqs)))  # [S, k_max]

    # ---- proposals launched a step ahead ---------------------------------------------------
    @property
    def launches_ahead(self) -> bool:
        return self.launch_ahead_enabled and self.device_proposals

    def launch_ahead(self, seqs: list[Sequence], ks: list[int], emitted: list[list[int]],
                     verified: list[tuple[int, int]]) -> None:
        """Draft the next step's proposals now, on the device, for propose() to take (module
        docstring): ks[i] >= 1 for seqs[i] once the tokens emitted[i] that this step verified
        are committed; verified[i] = (proposed, accepted) of that verification, applied here
        (on_verified then skips the sequence). Only plain greedy sequences with nothing
        blocked, each with KV slots for the longest k, as in _propose_on_device, which this
        runs on the sequences with emitted[i] appended for the while."""
        self.drop_ahead()
        if (not self.launches_ahead or not seqs
                or not all(is_plain_greedy(s.params) for s in seqs)
                or any(self.blocked_token_ids(s, len(t)) for s, t in zip(seqs, emitted,
                                                                        strict=True))
                or any(s.seq_id not in self.shadows for s in seqs)):
            return
        for seq, (proposed, accepted) in zip(seqs, verified, strict=True):
            self._apply_verification(seq, seq.num_tokens, proposed, accepted)
            self._verified_early.add(seq.seq_id)
        for seq, tokens in zip(seqs, emitted, strict=True):
            seq.token_ids.extend(tokens)  # (the shadow shares the list)
        try:
            k_max = max(ks)
            saved = {s.seq_id: self.shadows[s.seq_id].num_computed_tokens for s in seqs}
            if not all(self._fits(s, k_max) and self._reserve(s, k_max) for s in seqs):
                self._restore(saved)
                return
            self._ahead = _Ahead({s.seq_id: i for i, s in enumerate(seqs)},
                                 [s.num_tokens for s in seqs], saved,
                                 self._propose_on_device(seqs, list(ks), k_max))
        finally:
            for seq, tokens in zip(seqs, emitted, strict=True):
                del seq.token_ids[len(seq.token_ids) - len(tokens):]  # the commit adds them

    def launched_tokens(self, seqs: list[Sequence]) -> torch.Tensor | None:
        ahead = self._ahead
        if ahead is None or not seqs:
            return None
        rows = [ahead.rows.get(s.seq_id) for s in seqs]
        if any(r is None for r in rows):
            return None
        tokens = ahead.proposals.device_tokens  # [A, K]
        if rows == list(range(tokens.shape[0])):
            return tokens
        return tokens[index_tensor(rows, tokens.device)]  # [len(seqs), K]

    @property
    def took_ahead(self) -> bool:
        return self._took_ahead

    def drop_ahead(self) -> None:
        """Forget proposals launched ahead that propose() did not take: their sequences'
        shadows go back to what they had computed before the launch (their KV past that is
        rewritten before it is ever read)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._restore(ahead.saved)

    def _restore(self, saved: dict[int, int]) -> None:
        for seq_id, computed in saved.items():
            shadow = self.shadows.get(seq_id)  # gone if its sequence was freed
            if shadow is not None:
                shadow.num_computed_tokens = computed
                self.block_manager.rollback(shadow, computed)

    def _take_ahead(self, seqs: list[Sequence], max_tokens: list[int]) -> DraftProposals | None:
        """The launched proposals as this step's, if every proposing sequence was launched at
        its current length; else None. Every launched row holds the launch's longest k
        (shorter ones rode along in its window, as in _propose_on_device): a shorter k now
        is a prefix of them, a longer one continues the window (_extend). Launched sequences
        that do not propose now get their shadows back; the others keep theirs (on_verified
        rolls them back as usual)."""
        ahead = self._ahead
        rows, active = [], []
        for i, (seq, k) in enumerate(zip(seqs, max_tokens, strict=True)):
            if k <= 0:
                continue
            row = ahead.rows.get(seq.seq_id)
            if row is None or seq.num_tokens != ahead.num_tokens[row]:
                return None
            rows.append(row)
            active.append(i)
        if not rows:
            return None
        tokens = ahead.proposals.device_tokens  # [A, K]
        k_max = max(max_tokens)
        longer = k_max > tokens.shape[1]
        if longer and not all(self._fits(seqs[i], k_max) and self._reserve(seqs[i], k_max)
                              for i in active):
            return None
        proposing = {seqs[i].seq_id for i in active}
        ahead.saved = {s: c for s, c in ahead.saved.items() if s not in proposing}
        if rows != list(range(tokens.shape[0])):
            tokens = tokens[index_tensor(rows, tokens.device)]  # [len(rows), K]
        if longer:
            tokens = self._extend([seqs[i] for i in active], tokens, k_max)  # [.., k_max]
        return DraftProposals([[0] * max(k, 0) for k in max_tokens], None,
                              ahead.proposals.num_catch_up_tokens,
                              scatter_rows(tokens, active, len(seqs)))  # [S, K]

    def _extend(self, seqs: list[Sequence], tokens: torch.Tensor, k_max: int) -> torch.Tensor:
        """Launched proposals tokens [A, k] continued to k_max per sequence, on the device:
        the draft has fed each sequence's last committed token and proposals 1..k-1, so a
        window of k_max - k steps fed proposal k onwards drafts the rest, as the window of a
        fresh proposal would (at batch 32 on the H200 the cap rose in 4-8 % of speculative
        steps; dropping the launch there re-ran the draft's first forward as well)."""
        k = tokens.shape[1]
        window = [SequenceRun([0], seq.num_tokens + k - 1, self.shadows[seq.seq_id].block_table,
                              [0]) for seq in seqs]
        more = self.runner.execute_argmax_steps_device(window, k_max - k, tokens[:, -1])
        for seq in seqs:
            self.shadows[seq.seq_id].num_computed_tokens = seq.num_tokens + k_max - 1
        more = self._device_tokens(seqs, list(range(len(seqs))), more.T, first_position=k)
        return torch.cat([tokens, more], dim=1)  # [A, k_max]

    def _device_tokens(self, seqs: list[Sequence], active: list[int], tokens: torch.Tensor,
                       first_position: int = 0) -> torch.Tensor:
        """The proposals [A, K] drafted on the device, proposals first_position + 1 .. of
        each (a hook for the benchmark replay)."""
        return tokens

    def _fits(self, seq: Sequence, k: int) -> bool:
        """k proposals stay within the speculative limit (the driver's rule for its own k:
        num_tokens + k <= the limit; the draft computes positions up to num_tokens + k - 2)."""
        return self.max_model_len is None or seq.num_tokens + k <= self.max_model_len

    def _window_fits(self, ks: list[int], reserved: list[int], k_max: int) -> bool:
        """Proposals 2..k can run as one window: the first step took the argmax path (every
        row plain greedy, nothing blocked; blocking only lifts as tokens are added, so no later
        step is blocked either), at least two more proposals are wanted, and every proposing
        sequence has KV slots for k_max proposals (a sequence wanting fewer rides along: the
        window costs the same for the batch, and its extra tokens are cut)."""
        return self.multi_step and k_max >= 3 and _reserved_for(ks, reserved, k_max)

    def _propose_window(self, seqs: list[Sequence], active: list[int],
                        proposals: list[list[int]], num_steps: int) -> None:
        runs = [SequenceRun([proposals[i][-1]], seqs[i].num_tokens,
                            self.shadows[seqs[i].seq_id].block_table, [0]) for i in active]
        window = self.runner.execute_argmax_steps(runs, num_steps)  # [A][num_steps]
        for i, tokens in zip(active, window, strict=True):
            proposals[i].extend(tokens)
            self.shadows[seqs[i].seq_id].num_computed_tokens = seqs[i].num_tokens + num_steps

    def _step_tokens(self, seqs: list[Sequence], drafted: list[list[int]],
                     runs: list[SequenceRun], greedy: bool):
        """One draft forward over the runs: (probs [A, V] or None, one token per run). Plain
        greedy rows with nothing blocked read back argmax ids alone (no logits, no q)."""
        if greedy and not any(self.blocked_token_ids(s, len(d))
                              for s, d in zip(seqs, drafted, strict=True)):
            return None, self.runner.execute_argmax(runs)
        return self._sample(seqs, drafted, self.runner.execute(runs))  # logits [A, V]

    def _sample(self, seqs: list[Sequence], drafted: list[list[int]], logits: torch.Tensor):
        """Draw each proposal from the draft's distribution under the request's transforms."""
        tensors = SamplingTensors.from_rows(
            [s.params for s in seqs],
            [s.output_token_ids + d for s, d in zip(seqs, drafted, strict=True)],
            [s.prompt_token_ids for s in seqs], self.vocab_size, logits.device, torch.float32,
            blocked_token_ids=[self.blocked_token_ids(s, len(d))
                               for s, d in zip(seqs, drafted, strict=True)],
        )
        final = process_logits(logits, tensors)  # [A, V]
        tokens = sample(final, tensors, [s.generator for s in seqs], self.default_generator)
        probs = probs_from_final_logits(final)  # [A, V]
        # Greedy rows propose argmax: a point mass, which is what their verification assumes.
        return probs, tokens.tolist()

    def on_verified(self, seq: Sequence, num_tokens_before: int, num_proposed: int,
                    num_accepted: int) -> None:
        if seq.seq_id in self._verified_early:  # launch_ahead applied it
            self._verified_early.discard(seq.seq_id)
            return
        self._apply_verification(seq, num_tokens_before, num_proposed, num_accepted)

    def _apply_verification(self, seq: Sequence, num_tokens_before: int, num_proposed: int,
                            num_accepted: int) -> None:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None or num_proposed == 0:
            return
        # Fed to the draft: last committed token + proposals 1..k-1 -> valid KV for the
        # accepted ones among them.
        valid = num_tokens_before + min(num_accepted, num_proposed - 1)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, valid)
        self.block_manager.rollback(shadow, shadow.num_computed_tokens)
        self.block_manager.register_computed_blocks(shadow)


def _reserved_for(ks: list[int], reserved: list[int], k_max: int) -> bool:
    """Every proposing sequence has KV slots for k_max proposals (a window of k_max fits)."""
    return all(k == 0 or r >= k_max for k, r in zip(ks, reserved, strict=True))
