"""SpeculativeConfig: vLLM v0's flat speculative arguments and v1's ``speculative_config`` dict,
validated into one frozen object."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from specserve.model.layers.quantization import get_quantization_method

NGRAM_MODEL_NAME = "[ngram]"
SUFFIX_MODEL_NAME = "[suffix]"
ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")
SUFFIX_LOOKUP_MAX = 4  # n-gram length of the aligned lookup beside '[suffix]', unless given
METHODS = ("draft_model", "ngram", "suffix", "mlp_speculator", "medusa", "eagle")
# Suffix decoding options: the same name as an LLM keyword, a v1 dict key and a field (vLLM's).
SUFFIX_OPTIONS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                  "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
# v1 dict keys -> our field names
_V1_ALIASES = {"model": "model", "num_speculative_tokens": "num_speculative_tokens",
               "method": "method", "prompt_lookup_max": "ngram_prompt_lookup_max",
               "prompt_lookup_min": "ngram_prompt_lookup_min",
               "prompt_lookup_aligned": "ngram_prompt_lookup_aligned",
               "draft_tensor_parallel_size": "draft_tensor_parallel_size",
               "max_model_len": "max_model_len",
               "disable_by_batch_size": "disable_by_batch_size",
               "acceptance_method": "acceptance_method",
               "quantization": "quantization",
               **{name: name for name in SUFFIX_OPTIONS}}


def _fail(message: str) -> None:
    raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    # '[ngram]' prefers the occurrence the answer is copying (ngram.AlignedNgramIndex); off:
    # vLLM's rule, the most recent occurrence. '[suffix]': that aligned lookup proposes beside
    # the suffix trees, each step the source lately right more often (hybrid.py); off: vLLM's
    # suffix decoding alone
    ngram_prompt_lookup_aligned: bool = False
    draft_tensor_parallel_size: int = 1
    max_model_len: int | None = None
    disable_by_batch_size: int | None = None
    acceptance_method: str = "rejection_sampler"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    disable_logprobs: bool = True
    adaptive: bool = True  # adapt k per sequence and per batch (see spec_decode/adaptive.py)
    quantization: str | None = None  # of the draft model (speculative_model_quantization)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            _fail(f"num_speculative_tokens={k!r} must be an int >= 1.")
        if self.method not in METHODS:
            _fail(f"speculative method {self.method!r} is not one of {list(METHODS)}.")
        if not isinstance(self.ngram_prompt_lookup_aligned, bool):
            _fail(f"ngram_prompt_lookup_aligned={self.ngram_prompt_lookup_aligned!r} must be "
                  "True or False.")
        if self.ngram_prompt_lookup_aligned and self.method not in ("ngram", "suffix"):
            _fail("ngram_prompt_lookup_aligned applies to '[ngram]' and '[suffix]' only, not to "
                  f"method {self.method!r}.")
        if self.uses_prompt_lookup:
            hi, lo = self.ngram_prompt_lookup_max, self.ngram_prompt_lookup_min
            if not _is_int(hi) or hi < 1:
                _fail(f"ngram_prompt_lookup_max={hi!r} must be an int >= 1 for '[ngram]' (and "
                      "the aligned lookup beside '[suffix]').")
            if lo is not None and (not _is_int(lo) or not 1 <= lo <= hi):
                _fail(f"ngram_prompt_lookup_min={lo!r} must be an int in [1, "
                      f"ngram_prompt_lookup_max={hi}].")
        if self.method == "draft_model" and not self.model:
            _fail("a draft model path is required for method 'draft_model'.")
        if self.draft_tensor_parallel_size != 1:
            _fail(f"speculative_draft_tensor_parallel_size={self.draft_tensor_parallel_size!r}: "
                  "only 1 is supported until tensor parallelism lands.")
        for name in ("max_model_len", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                _fail(f"speculative {name}={value!r} must be a positive int or None.")
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            _fail(f"spec_decoding_acceptance_method={self.acceptance_method!r} must be one of "
                  f"{list(ACCEPTANCE_METHODS)}.")
        if not 0.0 <= self.posterior_threshold <= 1.0:
            _fail(f"typical_acceptance_sampler_posterior_threshold={self.posterior_threshold!r}"
                  " must be in [0, 1].")
        if not 0.0 <= self.posterior_alpha <= 1.0:
            _fail(f"typical_acceptance_sampler_posterior_alpha={self.posterior_alpha!r} must be "
                  "in [0, 1].")
        self._check_suffix_options()
        if self.quantization is not None:
            if self.method != "draft_model":
                _fail(f"speculative_model_quantization={self.quantization!r} applies to a draft "
                      f"model; method {self.method!r} has none.")
            get_quantization_method(self.quantization)

    @property
    def uses_prompt_lookup(self) -> bool:
        """'[ngram]', or '[suffix]' with the aligned lookup beside it (hybrid.py)."""
        return self.method == "ngram" or (self.method == "suffix"
                                          and self.ngram_prompt_lookup_aligned is True)

    def _check_suffix_options(self) -> None:
        depth, cached = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not _is_int(depth) or depth < 1:
            _fail(f"suffix_decoding_max_tree_depth={depth!r} must be an int >= 1.")
        if not _is_int(cached) or cached < 0:
            _fail(f"suffix_decoding_max_cached_requests={cached!r} must be an int >= 0 "
                  "(0 turns the cache of earlier requests' outputs off).")
        if not _is_number(factor) or factor < 0:
            _fail(f"suffix_decoding_max_spec_factor={factor!r} must be a number >= 0.")
        if not _is_number(prob) or not 0.0 <= prob <= 1.0:
            _fail(f"suffix_decoding_min_token_prob={prob!r} must be a number in [0, 1].")

    @classmethod
    def from_args(
        cls,
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
    ) -> SpeculativeConfig | None:
        """None when no speculation was asked for; otherwise a validated config."""
        values: dict[str, Any] = {
            "model": speculative_model,
            "num_speculative_tokens": num_speculative_tokens,
            "ngram_prompt_lookup_max": ngram_prompt_lookup_max,
            "ngram_prompt_lookup_min": ngram_prompt_lookup_min,
            "ngram_prompt_lookup_aligned": ngram_prompt_lookup_aligned,
            "draft_tensor_parallel_size": speculative_draft_tensor_parallel_size or 1,
            "max_model_len": speculative_max_model_len,
            "disable_by_batch_size": speculative_disable_by_batch_size,
            "acceptance_method": spec_decoding_acceptance_method,
            "suffix_decoding_max_tree_depth": suffix_decoding_max_tree_depth,
            "suffix_decoding_max_cached_requests": suffix_decoding_max_cached_requests,
            "suffix_decoding_max_spec_factor": suffix_decoding_max_spec_factor,
            "suffix_decoding_min_token_prob": suffix_decoding_min_token_prob,
            "quantization": speculative_model_quantization,
        }
        if speculative_config is not None:
            if not isinstance(speculative_config, dict):
                _fail(f"speculative_config must be a dict, got {type(speculative_config)}.")
            unknown = set(speculative_config) - set(_V1_ALIASES)
            if unknown:
                _fail(f"speculative_config has unknown keys {sorted(unknown)}; known keys: "
                      f"{sorted(_V1_ALIASES)}.")
            for key, value in speculative_config.items():
                values[_V1_ALIASES[key]] = value
        method = values.pop("method", None)
        if values["model"] is None and method is None:
            if num_speculative_tokens is not None or ngram_prompt_lookup_max is not None:
                _fail("num_speculative_tokens / ngram_prompt_lookup_max were given without "
                      "speculative_model; set speculative_model (a draft path or '[ngram]').")
            return None
        if method is None:
            method = {NGRAM_MODEL_NAME: "ngram", SUFFIX_MODEL_NAME: "suffix"}.get(
                values["model"], "draft_model")
        if values["num_speculative_tokens"] is None and method == "suffix":
            # vLLM's rule: suffix decoding sizes each proposal itself; k is only a cap.
            values["num_speculative_tokens"] = values["suffix_decoding_max_tree_depth"]
        if values["num_speculative_tokens"] is None:
            _fail("num_speculative_tokens is required when speculative decoding is enabled.")
        if typical_acceptance_sampler_posterior_threshold is not None:
            values["posterior_threshold"] = typical_acceptance_sampler_posterior_threshold
        if typical_acceptance_sampler_posterior_alpha is not None:
            values["posterior_alpha"] = typical_acceptance_sampler_posterior_alpha
        if disable_logprobs_during_spec_decoding is not None:
            values["disable_logprobs"] = disable_logprobs_during_spec_decoding
        if not isinstance(speculative_adaptive, bool):
            _fail(f"speculative_adaptive={speculative_adaptive!r} must be True or False.")
        values["adaptive"] = speculative_adaptive
        if method == "ngram" or (method == "suffix"
                                 and values["ngram_prompt_lookup_aligned"] is True):
            if method == "suffix" and values["ngram_prompt_lookup_max"] is None:
                # the aligned lookup beside the suffix trees (hybrid.py): "[ngram]"'s usual n <= 4
                values["ngram_prompt_lookup_max"] = SUFFIX_LOOKUP_MAX
            if values["ngram_prompt_lookup_min"] is None:
                values["ngram_prompt_lookup_min"] = 1
        known = {f.name for f in fields(cls)}
        return cls(method=method, **{k: v for k, v in values.items() if k in known})
