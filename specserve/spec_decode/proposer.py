"""The Proposer interface: every speculation method (draft model, n-gram, suffix, heads) is one.

The engine asks for up to ``k`` tokens per sequence, verifies them in one target pass, and then
tells the proposer how many were accepted so that any state it keeps (a draft model's KV cache,
an n-gram index) follows the committed sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.engine.sequence import Sequence


@dataclass
class DraftProposals:
    token_ids: list[list[int]]  # per sequence, 0..k proposed tokens
    # [S, K, V] float32 proposal distributions after the request's sampling transforms, or
    # None when proposals are point masses (q(x) = 1): n-gram lookup, suffix trees.
    probs: torch.Tensor | None = None
    # Tokens a draft model fed beyond the usual two per sequence (last proposal + bonus): its
    # prompt prefill, or catching up on steps it sat out. A one-time cost, not what a step
    # with these proposals costs from then on.
    num_catch_up_tokens: int = 0
    # [S, K] int64: the proposals still on the device (row i's first len(token_ids[i])
    # entries), when the caller allowed it; token_ids then hold placeholders of the right
    # lengths until the verification step reads them back together with its own result.
    device_tokens: torch.Tensor | None = None
    # Per sequence, how much context the proposal's evidence matched (draft-free methods: the
    # n-gram length, or the suffix-tree match length; 0 with no proposal), or None. The
    # adaptive policy learns acceptance per evidence class: on HumanEval edits with SmolLM2 a
    # first proposal after a 1-token match was accepted 20 % of the time, after a 4-token
    # match 87 %, and runs after long matches went on far longer (adaptive.py).
    match_lengths: list[int] | None = None

    @property
    def num_tokens(self) -> list[int]:
        return [len(t) for t in self.token_ids]


class Proposer(ABC):
    """Proposes speculative tokens; keeps any per-sequence state in sync with commits."""

    #: True when the proposals come with distributions q (needed for sampled requests).
    has_probs: bool = False

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_tokens: list[int],
                on_device: bool = False) -> DraftProposals:
        """Up to max_tokens[i] tokens to follow seqs[i].token_ids (fewer, or none, is fine).
        on_device: the proposals may stay on the device (DraftProposals.device_tokens)."""

    def catch_up_tokens(self, seqs: list[Sequence]) -> int:
        """Tokens a proposal for every one of seqs would first have to feed beyond the usual
        two per sequence (DraftProposals.num_catch_up_tokens): what turning speculation on
        costs right now. Stateless proposers feed nothing."""
        return 0

    def on_verified(self, seq: Sequence, num_tokens_before: int, num_proposed: int,
                    num_accepted: int) -> None:
        """Called after seq committed num_accepted of num_proposed >= 1 proposals (+1 token);
        not for sequences that proposed nothing in the step."""
        return None  # stateless proposers need nothing

    def free(self, seq: Sequence) -> None:
        """The sequence finished, was aborted or was preempted: drop its state."""
        return None

    @property
    def launches_ahead(self) -> bool:
        """Whether launch_ahead does anything (the driver skips preparing it otherwise)."""
        return False

    def launch_ahead(self, seqs: list[Sequence], ks: list[int], emitted: list[list[int]],
                     verified: list[tuple[int, int]]) -> None:
        """Right after a step's verification, before its commits: start the next step's
        proposals for seqs (up to ks[i] each, after the tokens emitted[i] are committed;
        verified[i] = (proposed, accepted) of this step's verification) so that the device
        drafts them while the host commits this step and prepares the next; propose() then
        takes them if they fit what it is asked for. Proposers whose proposals cost no
        device work do nothing."""
        return None

    def drop_ahead(self) -> None:
        """Forget proposals launched ahead that propose() did not take (undoing any state
        the launch advanced)."""
        return None

    def launched_tokens(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The proposals launch_ahead started for seqs, still on the device ([len(seqs), K],
        row i for seqs[i], K the launch's longest k), or None unless every one of them was
        launched: what the engine feeds into the next step's verification pass when it
        launches that one ahead too (engine/verify_ahead.py)."""
        return None

    @property
    def took_ahead(self) -> bool:
        """Whether the last propose() returned the proposals launched ahead (so they are the
        very tokens launched_tokens gave)."""
        return False
