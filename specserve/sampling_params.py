"""Per-request sampling parameters with vLLM's names, defaults and semantics.

Validation happens once, at construction, so that a bad request fails at the API boundary with a
`ValueError` naming the field, the value given and what is allowed, instead of surfacing later
as a shape error or a NaN in the middle of a batched step.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass
from typing import Any

# Temperatures below this are treated as greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5
# Most top logprobs a request may ask for per position (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Penalty ranges follow OpenAI / vLLM.
MAX_ABS_PENALTY = 2.0
# torch.Generator.manual_seed accepts seeds in this range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


class SamplingType(enum.IntEnum):
    """How a row picks its token; RANDOM_SEED rows own a generator (batch-independent)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as `top_k` is almost surely a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fail(name: str, value: Any, allowed: str, fix: str = "") -> ValueError:
    msg = f"{name} must be {allowed}, got {value!r}."
    return ValueError(f"{msg} {fix}" if fix else msg)


def _as_float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise _fail(name, value, "a number", f"Pass a float, e.g. {name}=1.0.")
    out = float(value)
    if not math.isfinite(out):
        raise _fail(name, value, "a finite number")
    return out


def _as_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise _fail(name, value, "an int", f"Pass a whole number, e.g. {name}=1.")
    return int(value)


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, value, "a bool (True or False)")
    return value


def _as_token_ids(name: str, value: Any, *, allow_empty: bool = True) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise _fail(name, value, "a list of token ids (ints >= 0)")
    ids = list(value)
    if not allow_empty and not ids:
        raise _fail(name, value, "a non-empty list of token ids", f"Pass None to disable {name}.")
    for tok in ids:
        if not _is_int(tok) or tok < 0:
            raise _fail(name, value, "a list of token ids (ints >= 0)", f"Bad entry: {tok!r}.")
    return [int(t) for t in ids]


@dataclass
class SamplingParams:
    """Sampling parameters for one request; see vLLM's `SamplingParams` for field meanings.

    Notes on semantics that are easy to get wrong:
    - `temperature < SAMPLING_EPS` means greedy; top_p/top_k/min_p are then reset to their
      disabled values (as vLLM does) so that greedy rows never pay for filtering.
    - `top_k` of 0 or -1 disables top-k (vLLM quietly accepts -1; the value is kept as given).
    - `best_of` is accepted only when None or equal to `n` (no best-of-n ranking here).
    - `max_tokens=None` generates until the context window ends.
    - `logit_bias` maps token id -> additive bias on the raw logits (applied before penalties).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self._normalize_types()
        self._verify_ranges()
        self._verify_stops()
        if self.temperature < SAMPLING_EPS:
            self._normalize_greedy()

    # ------------------------------------------------------------------ validation

    def _normalize_types(self) -> None:
        """Coerce numeric fields to exact Python types; wrong types become ValueError."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _as_int(name, value))
        for name in ("include_stop_str_in_output", "ignore_eos", "detokenize",
                     "skip_special_tokens", "spaces_between_special_tokens"):
            setattr(self, name, _as_bool(name, getattr(self, name)))
        self.stop_token_ids = (
            [] if self.stop_token_ids is None
            else _as_token_ids("stop_token_ids", self.stop_token_ids)
        )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_token_ids(
                "allowed_token_ids", self.allowed_token_ids, allow_empty=False)
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)

    @staticmethod
    def _normalize_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise _fail("logit_bias", bias, "a dict mapping token id (int) to bias (float)")
        out: dict[int, float] = {}
        for tok, val in bias.items():
            if not _is_int(tok) or tok < 0:
                raise _fail("logit_bias", bias, "keyed by token ids (ints >= 0)",
                            f"Bad key: {tok!r}.")
            if not _is_real(val) or not math.isfinite(val):
                raise _fail("logit_bias", bias, "valued by finite floats",
                            f"Bad value for token {tok}: {val!r}. Use -100 to ban a token.")
            out[int(tok)] = float(val)
        return out

    def _verify_ranges(self) -> None:
        if self.n < 1:
            raise _fail("n", self.n, "at least 1")
        if self.best_of is not None and self.best_of != self.n:
            if self.best_of > self.n:
                raise ValueError(
                    f"best_of > n is not supported: got best_of={self.best_of}, n={self.n}. "
                    "Leave best_of=None (or set it equal to n)."
                )
            raise _fail("best_of", self.best_of, f"None or equal to n={self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise _fail(name, value, f"in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}]")
        if self.repetition_penalty <= 0.0:
            raise _fail("repetition_penalty", self.repetition_penalty, "> 0",
                        "Use 1.0 to disable it.")
        if self.temperature < 0.0:
            raise _fail("temperature", self.temperature, ">= 0", "Use 0 for greedy decoding.")
        if not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", self.top_p, "in (0, 1]", "Use 1.0 to disable it.")
        if self.top_k < -1:
            raise _fail("top_k", self.top_k, "0 or -1 (disabled) or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", self.min_p, "in [0, 1]", "Use 0.0 to disable it.")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise _fail("seed", self.seed, f"in [{MIN_SEED}, {MAX_SEED}]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _fail("max_tokens", self.max_tokens, "at least 1 or None",
                        "None generates until the context window ends.")
        if self.min_tokens < 0:
            raise _fail("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", self.min_tokens,
                        f"<= max_tokens={self.max_tokens}", "Lower min_tokens or raise max_tokens.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise _fail(name, value, f"None or in [0, {MAX_LOGPROBS}]")

    def _verify_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise _fail("stop", self.stop, "a string, a list of strings, or None")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise _fail("stop", self.stop, "non-empty strings", f"Bad entry: {s!r}.")
        if stop and not self.detokenize:
            raise ValueError(
                f"stop strings need detokenize=True, got stop={stop!r} with detokenize=False. "
                "Set detokenize=True or use stop_token_ids instead."
            )
        self.stop = stop

    def _normalize_greedy(self) -> None:
        """Greedy ignores filtering; reset it so greedy rows never trigger filter work."""
        if self.n > 1:
            raise _fail("n", self.n, "1 when using greedy sampling (temperature=0)",
                        "Set temperature > 0 to draw several samples.")
        self.top_p = 1.0
        self.top_k = 0
        self.min_p = 0.0

    # ------------------------------------------------------------------ helpers

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY, RANDOM (shared generator) or RANDOM_SEED (own generator)."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def uses_penalties(self) -> bool:
        """True when output/prompt token counts are needed to build this request's rows."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def stop_token_id_set(self, eos_token_id: int | None) -> set[int]:
        """Token ids that finish the request: stop_token_ids plus EOS unless ignore_eos.

        Also the ids to block while fewer than `min_tokens` tokens have been generated.
        """
        ids = set(self.stop_token_ids or ())
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return ids

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids that index logits; the engine calls this when a request arrives."""
        if self.allowed_token_ids is not None:
            bad = [t for t in self.allowed_token_ids if t >= vocab_size]
            if bad:
                raise _fail("allowed_token_ids", bad, f"token ids < vocab size {vocab_size}")
        if self.logit_bias is not None:
            bad = [t for t in self.logit_bias if t >= vocab_size]
            if bad:
                raise _fail("logit_bias", bad, f"keyed by token ids < vocab size {vocab_size}")

    def clone(self) -> SamplingParams:
        """Deep copy, so per-request mutation (e.g. added stop ids) never leaks between requests."""
        return copy.deepcopy(self)
