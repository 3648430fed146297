"""What `LLM.generate` and the engine return, shaped like vLLM's outputs.

Kept as plain dataclasses so that callers written against vLLM (`out.outputs[0].text`,
`out.outputs[0].logprobs[i][tok].logprob`) work unchanged, plus speculative-decoding counters
on `RequestMetrics` so per-request acceptance can be reported without a side channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Logprob:
    """Log probability of one token at one position.

    `rank` is 1-based among the whole vocabulary (1 = most likely); `decoded_token` is filled by
    the detokenizer when detokenize=True.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position; the first is None (nothing predicts the first prompt token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    `finish_reason` is "stop" (EOS, stop string or stop token), "length" (max_tokens or context
    end) or "abort"; `stop_reason` is the stop string or stop token id that matched, None for EOS.
    """

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={list(self.token_ids)}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


@dataclass
class RequestMetrics:
    """Timings (seconds, `time.time()` clock) and speculative counters of one request.

    Speculative counters are cumulative over the request's life:
    - num_draft_tokens: tokens proposed to the verifier,
    - num_accepted_tokens: proposals the rejection sampler accepted,
    - num_emitted_tokens: tokens committed by speculative steps (accepted + recovered/bonus),
    - num_spec_steps: verifier steps this request took part in.
    """

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_spec_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed; None before anything was proposed."""
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_tokens_per_step(self) -> float | None:
        """Tokens committed per verifier step (1.0 means speculation bought nothing)."""
        if self.num_spec_steps == 0:
            return None
        return self.num_emitted_tokens / self.num_spec_steps


@dataclass
class RequestOutput:
    """The state of one request as streamed or returned: prompt plus its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics})"
        )


def agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common (the index of the first position
    where they differ, or the shorter length if one is a prefix of the other).

    Used to compare two greedy continuations of the same prompt (e.g. specserve vs transformers,
    or one engine path vs another): the first divergence is where their numerics parted ways."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
