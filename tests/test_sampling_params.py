"""SamplingParams: vLLM defaults, validation messages, greedy normalisation, helpers."""

from __future__ import annotations

import pytest

from specserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None and p.seed is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logit_bias is None and p.allowed_token_ids is None
    assert p.sampling_type is SamplingType.RANDOM


INVALID = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("n", {"n": True}),
    ("n", {"n": 2, "temperature": 0.0}),  # vLLM: greedy needs n == 1
    ("best_of", {"n": 1, "best_of": 2}),
    ("best_of", {"n": 3, "best_of": 2}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": "high"}),
    ("frequency_penalty", {"frequency_penalty": -2.01}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": float("inf")}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": "0.7"}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": None}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 5.0}),
    ("top_k", {"top_k": False}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.5}),
    ("seed", {"seed": 1.0}),
    ("seed", {"seed": "42"}),
    ("seed", {"seed": 2**70}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop", {"stop": "x", "detokenize": False}),
    ("stop_token_ids", {"stop_token_ids": [1, -2]}),
    ("stop_token_ids", {"stop_token_ids": ["1"]}),
    ("stop_token_ids", {"stop_token_ids": 7}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": 1}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 16.0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}),
    ("prompt_logprobs", {"prompt_logprobs": -3}),
    ("prompt_logprobs", {"prompt_logprobs": 100}),
    ("detokenize", {"detokenize": None}),
    ("skip_special_tokens", {"skip_special_tokens": 0}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("logit_bias", {"logit_bias": {"5": 1.0}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {5: float("-inf")}}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [3, -1]}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=[f"{f}-{k}" for f, k in INVALID])
def test_invalid_field_raises_value_error_naming_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_error_message_says_what_was_given_and_allowed() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(top_p=1.5)
    msg = str(info.value)
    assert "top_p" in msg and "1.5" in msg and "(0, 1]" in msg


def test_best_of_above_n_says_not_supported() -> None:
    with pytest.raises(ValueError, match="best_of > n is not supported"):
        SamplingParams(n=2, best_of=4)
    assert SamplingParams(n=2, best_of=2).best_of == 2


def test_valid_edge_values_accepted() -> None:
    p = SamplingParams(
        temperature=2, top_p=1, top_k=-1, min_p=1, presence_penalty=-2, frequency_penalty=2,
        max_tokens=None, min_tokens=5, logprobs=0, prompt_logprobs=MAX_LOGPROBS, seed=-5,
    )
    assert isinstance(p.temperature, float) and p.temperature == 2.0
    assert isinstance(p.top_p, float)
    assert p.top_k == -1  # kept as given; -1 and 0 both disable top-k
    assert p.max_tokens is None


def test_greedy_normalises_filters() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.3, seed=3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type is SamplingType.GREEDY
    tiny = SamplingParams(temperature=1e-6, top_k=3)
    assert tiny.sampling_type is SamplingType.GREEDY and tiny.top_k == 0
    warm = SamplingParams(temperature=1e-4, top_k=3)
    assert warm.sampling_type is SamplingType.RANDOM and warm.top_k == 3


def test_sampling_type_seeded() -> None:
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.5).sampling_type is SamplingType.RANDOM


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_stop_token_id_set() -> None:
    p = SamplingParams(stop_token_ids=[7])
    assert p.stop_token_id_set(2) == {2, 7}
    assert p.stop_token_id_set(None) == {7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).stop_token_id_set(2) == {7}


def test_verify_vocab() -> None:
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[0, 9]).verify_vocab(10)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[10]).verify_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={12: -1.0}).verify_vocab(10)


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={1: 2.0})
    q = p.clone()
    q.stop.append("y")
    q.stop_token_ids.append(2)
    q.logit_bias[3] = 1.0
    assert p.stop == ["x"] and p.stop_token_ids == [1] and p.logit_bias == {1: 2.0}
    assert q == SamplingParams(stop=["x", "y"], stop_token_ids=[1, 2],
                               logit_bias={1: 2.0, 3: 1.0})


def test_uses_penalties() -> None:
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties
