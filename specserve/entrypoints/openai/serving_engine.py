"""What the completion and chat endpoints share: model names, sampling parameters, context
checks, submitting requests to the async engine, usage and speculative stats.

Bad input is turned into ``APIError(400)`` here, before anything reaches the engine, with the
field name as ``param`` so that clients can point at the mistake.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from specserve.engine.async_engine import AsyncLLMEngine, RequestHandle
from specserve.entrypoints.openai.errors import APIError
from specserve.entrypoints.openai.protocol import (
    ChatMessage,
    SamplingRequest,
    SpecDecodeStats,
    UsageInfo,
)
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

# SamplingParams' messages start with the field name ("top_p must be in (0, 1], got 2.0.").
_FIELD_AT_START = re.compile(r"^([a-z_]+) ")


@dataclass(frozen=True)
class ServingConfig:
    served_model_names: tuple[str, ...]
    model_path: str
    chat_template: str | None = None  # overrides the tokenizer's
    response_role: str = "assistant"


def param_of(message: str) -> str | None:
    match = _FIELD_AT_START.match(message)
    if match and match.group(1) in SamplingParams.__dataclass_fields__:
        return match.group(1)
    return None


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, config: ServingConfig) -> None:
        self.engine = engine
        self.config = config

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The served name to echo back; 404 for a model this server does not serve."""
        if model is None or model in self.config.served_model_names:
            return model or self.model_name
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{list(self.config.served_model_names)} (see /v1/models).",
                       param="model", code="model_not_found")

    # ---- sampling parameters ------------------------------------------------------------------
    def sampling_params(self, req: SamplingRequest, *, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        best_of: int | None = None) -> SamplingParams:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true.",
                           param="stream_options")
        kwargs: dict[str, Any] = {
            "n": req.n, "best_of": best_of, "max_tokens": max_tokens, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs, "seed": req.seed, "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "logit_bias": self._logit_bias(req.logit_bias),
        }
        optional = {
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "min_p": req.min_p, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty, "ignore_eos": req.ignore_eos,
            "min_tokens": req.min_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        try:
            params = SamplingParams(**kwargs)
            params.verify_vocab(self.engine.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param_of(str(exc))) from None
        bad_stop = [t for t in params.stop_token_ids if t >= self.engine.vocab_size]
        if bad_stop:
            raise APIError(400, f"stop_token_ids {bad_stop[:5]} are outside the vocabulary "
                           f"[0, {self.engine.vocab_size}).", param="stop_token_ids")
        return params

    @staticmethod
    def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
        if bias is None:
            return None
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                out[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids (integers written as "
                               f"strings), got {key!r}.", param="logit_bias") from None
        return out

    # ---- prompts ----------------------------------------------------------------------------
    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        """Token-id prompts must lie in the vocabulary (400), checked before anything reads
        them: echo decodes the prompt before the engine sees it, and a huge id there was an
        OverflowError (500)."""
        vocab = self.engine.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {vocab}).", param=param)

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None,
                      param: str = "prompt") -> None:
        """vLLM's rule: prompt + max_tokens must fit the context (400 saying the lengths)."""
        limit = self.engine.max_model_len
        what = "prompt" if param == "prompt" else f"prompt (from the {param})"
        if num_prompt_tokens >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                           f"the {what} is {num_prompt_tokens} tokens long: it must be shorter, "
                           "to leave room for at least one generated token.", param=param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                           f"({num_prompt_tokens} in the {what}, {max_tokens} for the "
                           "completion). Reduce the length of the prompt or max_tokens.",
                           param="max_tokens")

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        """The chat template applied to the messages (on the engine thread: tokenizer state)."""
        conversation = [{"role": "system" if m.role == "developer" else m.role,
                         "content": m.content if isinstance(m.content, str)
                         else "".join(part.text for part in m.content)} for m in messages]
        template = self.config.chat_template

        def render() -> str:
            tok = self.engine.tokenizer
            if template is None and not getattr(tok, "chat_template", None):
                raise APIError(400, "this model's tokenizer has no chat template; start the "
                               "server with --chat-template FILE, or use /v1/completions.")
            return tok.apply_chat_template(conversation, tokenize=False, chat_template=template,
                                           add_generation_prompt=add_generation_prompt)

        try:
            return await self.engine.run_sync(render)
        except APIError:
            raise
        except Exception as exc:  # jinja errors (e.g. roles must alternate) are bad input
            raise APIError(400, f"the chat template could not render these messages: {exc}",
                           param="messages") from None

    # ---- running ----------------------------------------------------------------------------
    async def submit(self, prefix: str, prompts: list[list[int]], params: SamplingParams,
                     texts: list[str | None] | None = None) -> list[RequestHandle]:
        """Admit all prompts at once (or none: 429) and wait until the engine holds them."""
        self.engine.check_capacity(params.n * len(prompts))
        handles: list[RequestHandle] = []
        try:
            for i, ids in enumerate(prompts):
                text = texts[i] if texts is not None else None
                handles.append(self.engine.submit(f"{prefix}-{i}", ids, params.clone(), text))
            for handle in handles:
                await handle.wait_added()
        except ValueError as exc:
            close_all(handles)
            raise APIError(400, str(exc), param=param_of(str(exc)) or "prompt") from None
        except BaseException:
            close_all(handles)
            raise
        return handles

    def check_n_fits(self, num_seqs: int) -> None:
        """A request larger than the whole queue would wait forever: 400, not 429."""
        cap = self.engine.capacity
        if cap is not None and num_seqs > cap:
            raise APIError(400, f"this request asks for {num_seqs} sequences (n x prompts), "
                           f"but the server admits at most {cap} at once; lower n or send "
                           "fewer prompts per request.", param="n")

    @staticmethod
    async def final_outputs(handle: RequestHandle) -> RequestOutput:
        last = None
        async for out in handle:
            last = out
            if out.finished:
                break
        assert last is not None and last.finished
        return last

    # ---- accounting -------------------------------------------------------------------------
    @staticmethod
    def usage(outputs: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids or ()) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)

    def spec_stats(self, outputs: list[RequestOutput]) -> SpecDecodeStats | None:
        if not self.engine.speculative:
            return None
        metrics = [o.metrics for o in outputs if o.metrics is not None]
        stats = SpecDecodeStats(
            num_draft_tokens=sum(m.num_draft_tokens for m in metrics),
            num_accepted_tokens=sum(m.num_accepted_tokens for m in metrics),
            num_emitted_tokens=sum(m.num_emitted_tokens for m in metrics),
            num_spec_steps=sum(m.num_spec_steps for m in metrics))
        if stats.num_draft_tokens:
            stats.acceptance_rate = stats.num_accepted_tokens / stats.num_draft_tokens
        return stats


def close_all(handles: list[RequestHandle]) -> None:
    for handle in handles:
        handle.close()
