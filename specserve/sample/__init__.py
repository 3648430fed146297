"""Per-row logits processing and token sampling shared by decoding and speculative verification."""

from specserve.sample.logits_processing import SamplingTensors, apply_penalties, process_logits
from specserve.sample.sampler import (
    compute_logprobs,
    exponential_noise,
    gather_logprobs,
    probs_from_final_logits,
    sample,
)

__all__ = [
    "SamplingTensors",
    "apply_penalties",
    "compute_logprobs",
    "exponential_noise",
    "gather_logprobs",
    "probs_from_final_logits",
    "process_logits",
    "sample",
]
