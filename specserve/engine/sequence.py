"""Per-sequence state: tokens, how many have KV in the cache, status and output bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specserve.outputs import Logprob
from specserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
             SequenceStatus.FINISHED_ABORTED}
_FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop",
                   SequenceStatus.FINISHED_LENGTH: "length",
                   SequenceStatus.FINISHED_ABORTED: "abort"}


@dataclass
class Sequence:
    """One completion being generated (a request with n > 1 owns n of these)."""

    seq_id: int
    request_id: str
    index: int  # position among the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_cached_prefix_tokens: int = 0  # prompt tokens served by the prefix cache
    num_hashed_blocks: int = 0  # leading blocks already published to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    # Output-side bookkeeping.
    text: str = ""
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def tokens_left(self, max_model_len: int, extra: int = 0) -> int:
        """Tokens this sequence may still generate once extra more are committed: up to its
        max_tokens, or the context's end."""
        left = max_model_len - self.num_tokens - extra
        if self.params.max_tokens is not None:
            left = min(left, self.params.max_tokens - self.num_output_tokens - extra)
        return max(left, 0)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the KV is dropped; tokens stay and are prefilled again."""
        self.num_computed_tokens = 0
        self.num_cached_prefix_tokens = 0
        self.block_table = []
        self.num_hashed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
