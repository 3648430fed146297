"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Requests are strict (``"10"`` is not an int, ``"yes"`` is not a bool) and reject unknown fields,
as OpenAI's API does: a typo such as ``max_token`` must fail loudly instead of being ignored.
Value ranges are left to ``SamplingParams`` so that one place owns each rule and the server
reports the same text as the Python API. Field names follow OpenAI, plus vLLM's extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Most completions one request may ask for (n); the engine's queue bound applies as well.
MAX_N = 128


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _is_none(value: object) -> bool:
    return value is None


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- errors ------------------------------------------------------------------------------------
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


# ---- requests ----------------------------------------------------------------------------------
class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM; accepted, usage comes at the end


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None


class ResponseFormat(RequestModel):
    type: Literal["text"]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = True  # vLLM extension


class TokenizeRequest(RequestModel):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool | None = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------------
class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SpecDecodeStats(ResponseModel):
    """Extension: this request's speculative decoding counters (vLLM definitions)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_spec_steps: int = 0
    acceptance_rate: float | None = None


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    spec_decode_stats: SpecDecodeStats | None = Field(None, exclude_if=_is_none)


class ChatLogprobTop(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    spec_decode_stats: SpecDecodeStats | None = Field(None, exclude_if=_is_none)


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    spec_decode_stats: SpecDecodeStats | None = Field(None, exclude_if=_is_none)


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str
