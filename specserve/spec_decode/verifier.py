"""Turn the target's logits over ``[last token] + proposals`` into committed tokens.

The target has already scored every sequence's run in ONE forward pass (the model runner's
multi-query layout); this module applies each request's sampling transforms per row (a row's
penalty history includes the proposals in front of it, and min_tokens blocking counts them) and
runs the rejection sampler. Sequences without proposals get one row and come out as ordinary
samples, so the engine has a single sampling path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.engine.sequence import Sequence
from specserve.sample.logits_processing import SamplingTensors, process_logits
from specserve.sample.sampler import probs_from_final_logits
from specserve.sampling_params import SamplingParams, SamplingType
from specserve.spec_decode.rejection_sampler import PAD_TOKEN, rejection_sample
from specserve.worker.transfer import to_device


@dataclass
class VerifyResult:
    emitted: list[list[int]]  # per sequence: accepted proposals then one sampled token
    num_accepted: list[int]


class Verifier:
    def __init__(self, vocab_size: int, default_generator: torch.Generator,
                 blocked_token_ids: Callable[[Sequence, int], list[int]],
                 acceptance_method: str = "rejection_sampler",
                 posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> None:
        self.vocab_size = vocab_size
        self.default_generator = default_generator
        self.blocked_token_ids = blocked_token_ids
        self.acceptance_method = acceptance_method
        self.posterior_threshold = posterior_threshold
        self.posterior_alpha = posterior_alpha

    def argmax_suffices(self, seqs: list[Sequence]) -> bool:
        """True when every sequence is greedy and nothing transforms its logits (no penalties,
        logit_bias, allowed_token_ids or min_tokens blocking): then each row's verdict needs
        only the argmax of its raw logits, and accept_greedy gives what verify would."""
        return all(is_plain_greedy(s.params) and not self.blocked_token_ids(s, 0) for s in seqs)

    @staticmethod
    def accept_greedy(proposals: list[list[int]], row_tokens: list[int]) -> VerifyResult:
        """Greedy acceptance from the argmax of each row (len(proposals[i]) + 1 consecutive
        rows per sequence): accept while the proposal equals the argmax, then emit the argmax."""
        emitted, num_accepted, row = [], [], 0
        for props in proposals:
            argmax = row_tokens[row : row + len(props) + 1]
            n = 0
            while n < len(props) and props[n] == argmax[n]:
                n += 1
            emitted.append(argmax[: n + 1])  # == accepted proposals + the argmax after them
            num_accepted.append(n)
            row += len(props) + 1
        assert row == len(row_tokens), (row, len(row_tokens))
        return VerifyResult(emitted, num_accepted)

    def verify(self, seqs: list[Sequence], proposals: list[list[int]],
               draft_probs: torch.Tensor | None, raw_logits: torch.Tensor) -> VerifyResult:
        """raw_logits: [R, V] float32, len(proposals[i]) + 1 consecutive rows per sequence."""
        device = raw_logits.device
        counts = [len(p) for p in proposals]
        row_params, row_outputs, row_prompts, row_blocked = [], [], [], []
        for seq, props in zip(seqs, proposals, strict=True):
            for j in range(len(props) + 1):
                row_params.append(seq.params)
                row_outputs.append(seq.output_token_ids + props[:j])
                row_prompts.append(seq.prompt_token_ids)
                row_blocked.append(self.blocked_token_ids(seq, j))
        tensors = SamplingTensors.from_rows(row_params, row_outputs, row_prompts, self.vocab_size,
                                            device, torch.float32, blocked_token_ids=row_blocked)
        final = process_logits(raw_logits, tensors)  # [R, V]

        num_seqs, k = len(seqs), max(counts, default=0)
        # Scatter rows into a padded [S, K+1] layout.
        seq_index = to_device([i for i, c in enumerate(counts) for _ in range(c + 1)],
                              torch.long, device)
        pos_index = to_device([j for c in counts for j in range(c + 1)], torch.long, device)
        argmax = torch.zeros(num_seqs, k + 1, dtype=torch.long, device=device)
        argmax[seq_index, pos_index] = final.argmax(dim=-1)
        draft_ids = torch.full((num_seqs, max(k, 0)), PAD_TOKEN, dtype=torch.long)
        for i, props in enumerate(proposals):
            draft_ids[i, : len(props)] = torch.tensor(props, dtype=torch.long)
        draft_ids = to_device(draft_ids, torch.long, device)
        greedy = to_device([s.params.sampling_type is SamplingType.GREEDY for s in seqs],
                           torch.bool, device)
        if tensors.all_greedy:
            target_probs = None
        else:
            target_probs = torch.zeros(num_seqs, k + 1, self.vocab_size, device=device)
            target_probs[seq_index, pos_index] = probs_from_final_logits(final)
        if draft_probs is not None and draft_probs.shape[1] != k:
            draft_probs = draft_probs[:, :k]
        result = rejection_sample(
            target_probs, argmax, draft_ids, draft_probs, counts, greedy,
            [s.generator for s in seqs], self.default_generator,
            acceptance=self.acceptance_method, posterior_threshold=self.posterior_threshold,
            posterior_alpha=self.posterior_alpha, random_rows=[
                s.params.sampling_type is not SamplingType.GREEDY for s in seqs],
        )
        # The step's one device->host sync: tokens and counts travel together.
        packed = torch.cat([result.output_token_ids, result.num_emitted[:, None]], dim=1)
        rows = packed.tolist()  # [S, K+2]
        emitted_counts = [row[-1] for row in rows]
        emitted = [row[:n] for row, n in zip(rows, emitted_counts, strict=True)]
        return VerifyResult(emitted, [n - 1 for n in emitted_counts])


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with no logits transform that a request's parameters carry (min_tokens blocking
    depends on the step: callers check it)."""
    return (params.sampling_type is SamplingType.GREEDY and not params.uses_penalties
            and not params.logit_bias and params.allowed_token_ids is None)
