"""Commit sampled tokens to sequences: logprobs, incremental text, and every stop condition.

Kept apart from the engine loop so that speculative decoding, which commits several tokens per
step, reuses exactly the same per-token rules (a stop inside an accepted run truncates there).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from specserve.engine.detokenizer import (
    Detokenizer,
    DetokenizerState,
    apply_token_stop,
    find_stop_string,
)
from specserve.engine.scheduler import ScheduledSequence
from specserve.engine.sequence import Sequence, SequenceStatus
from specserve.outputs import Logprob
from specserve.sample.sampler import compute_logprobs, gather_logprobs


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, detokenizer: Detokenizer,
                 eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    # ---- sampling constraints ------------------------------------------------------------
    def blocked_token_ids(self, seq: Sequence, num_ahead: int = 0) -> list[int]:
        """EOS and stop ids are forbidden until min_tokens tokens exist (vLLM semantics).

        num_ahead counts tokens in front of the scored position that are not committed yet
        (speculative proposals)."""
        p = seq.params
        if seq.num_output_tokens + num_ahead >= p.min_tokens:
            return []
        blocked = list(p.stop_token_ids)
        if not p.ignore_eos:
            blocked.extend(self.eos_token_ids)
        return blocked

    # ---- logprobs --------------------------------------------------------------------------
    def _logprob_entries(self, logprobs: torch.Tensor, token_ids: list[int],
                         num_top: int) -> list[dict[int, Logprob]]:
        """One {token: Logprob} dict per row: the chosen token first, then the top num_top."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
        tok_lp, tok_rank, top_ids, top_lp = gather_logprobs(logprobs, ids, num_top)
        tok_lp, tok_rank = tok_lp.tolist(), tok_rank.tolist()
        top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
        entries = []
        for r, token in enumerate(token_ids):
            entry = {token: Logprob(tok_lp[r], tok_rank[r], self._token_text(token))}
            for rank, (tid, lp) in enumerate(zip(top_ids[r], top_lp[r], strict=True), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self._token_text(tid))
            entries.append(entry)
        return entries

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def prompt_logprob_offsets(self, seq: Sequence, start: int, n: int) -> list[int]:
        """Offsets in this chunk whose logits score the next prompt token (not yet scored)."""
        if seq.params.prompt_logprobs is None:
            return []
        done = len(seq.prompt_logprobs) if seq.prompt_logprobs is not None else 1
        first = max(start, done - 1)
        last = min(start + n, seq.num_prompt_tokens - 1)  # position p scores token p+1
        return [p - start for p in range(first, last)]

    def add_prompt_logprobs(self, seq: Sequence, s: ScheduledSequence,
                            raw_logits: torch.Tensor) -> None:
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]  # the first prompt token has no logprob
        start = s.seq.num_computed_tokens - s.num_new_tokens
        offsets = self.prompt_logprob_offsets(seq, start, s.num_new_tokens)
        targets = [seq.prompt_token_ids[start + o + 1] for o in offsets]
        logprobs = compute_logprobs(raw_logits[: len(offsets)])
        seq.prompt_logprobs.extend(
            self._logprob_entries(logprobs, targets, seq.params.prompt_logprobs))

    # ---- committing tokens ---------------------------------------------------------------
    def commit_token(self, seq: Sequence, detok: DetokenizerState, token_id: int,
                     logprobs: torch.Tensor | None) -> None:
        """Append one sampled token and apply stop rules, in vLLM's order: token stops,
        then text (stop strings), then length limits."""
        seq.append_token(token_id)
        if logprobs is not None and seq.params.logprobs is not None:
            entry = self._logprob_entries(logprobs[None], [token_id], seq.params.logprobs)[0]
            seq.output_logprobs.append(entry)
            seq.cumulative_logprob += entry[token_id].logprob
        stopped_on_token = apply_token_stop(seq, token_id, self.eos_token_ids)
        if stopped_on_token and not seq.params.include_stop_str_in_output:
            # Flush text held back before the stop token, then drop the stop token's own text.
            self._extend_text(seq, detok, upto=seq.num_tokens - 1, final=True)
            detok.read_offset = detok.prefix_offset = seq.num_tokens
        else:
            self._extend_text(seq, detok)
        if seq.is_finished:
            return
        p = seq.params
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            self._extend_text(seq, detok, final=True)
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED_LENGTH

    def _extend_text(self, seq: Sequence, detok: DetokenizerState, upto: int | None = None,
                     final: bool = False) -> None:
        if not seq.params.detokenize:
            return
        upto = seq.num_tokens if upto is None else upto
        if upto <= detok.read_offset:
            return
        delta = self.detokenizer.decode_new_text(seq, detok, upto, final=final)
        if not delta:
            return
        seq.text += delta
        if seq.params.stop and seq.num_output_tokens >= seq.params.min_tokens:
            hit = find_stop_string(seq.text, len(delta), seq.params.stop)
            if hit is not None:
                idx, stop = hit
                keep = idx + len(stop) if seq.params.include_stop_str_in_output else idx
                seq.text = seq.text[:keep]
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
