"""specserve: an LLM inference engine built around lossless speculative decoding.

Public API mirrors vLLM's so that switching is a one-line import change.
"""

from specserve.llm import LLM
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
