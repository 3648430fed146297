"""The one place that maps a speculative method to its proposer (and loads a draft model)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence
from specserve.spec_decode.draft_model import DraftModelProposer
from specserve.spec_decode.hybrid import HybridProposer
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.proposer import Proposer
from specserve.spec_decode.spec_config import SpeculativeConfig
from specserve.spec_decode.suffix import SuffixProposer
from specserve.worker.loading import LoadedModel, load_model
from specserve.worker.model_runner import ModelRunner

IMPLEMENTED_METHODS = ("draft_model", "ngram", "suffix")


def check_implemented(spec: SpeculativeConfig) -> None:
    if spec.method not in IMPLEMENTED_METHODS:
        raise NotImplementedError(
            f"speculative method {spec.method!r} is validated but not implemented yet; "
            f"implemented: {list(IMPLEMENTED_METHODS)}.")


def load_draft_runner(spec: SpeculativeConfig, target: LoadedModel, dtype: torch.dtype,
                      device: torch.device, block_size: int,
                      target_max_model_len: int) -> tuple[ModelRunner | None, int]:
    """Load the draft model if the method needs one; return it with the speculative length
    limit (past it sequences decode without speculation)."""
    limit = target_max_model_len
    runner = None
    if spec.method == "draft_model":
        draft = load_model(spec.model, dtype, device, quantization=spec.quantization)
        draft_vocab, target_vocab = draft.model.vocab_size, target.model.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(
                f"the draft model {spec.model!r} has vocab size {draft_vocab} but the target has "
                f"{target_vocab}: speculative decoding needs the same vocabulary.")
        limit = min(limit, draft.max_position_embeddings)
        runner = ModelRunner(draft.model, device, dtype, block_size)
    if spec.max_model_len is not None:
        if spec.max_model_len > limit:
            raise ValueError(
                f"speculative_max_model_len={spec.max_model_len} exceeds what the draft and "
                f"target allow ({limit}); use a value <= {limit}.")
        limit = spec.max_model_len
    return runner, limit


def create_proposer(spec: SpeculativeConfig, draft_runner: ModelRunner | None, num_blocks: int,
                    block_size: int, enable_prefix_caching: bool, vocab_size: int,
                    generator: torch.Generator,
                    blocked_token_ids: Callable[[Sequence, int], list[int]],
                    max_model_len: int | None = None) -> Proposer:
    """max_model_len: the speculative length limit (a draft computes no position past it)."""
    check_implemented(spec)
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_prompt_lookup_max, spec.ngram_prompt_lookup_min,
                             spec.ngram_prompt_lookup_aligned)
    if spec.method == "suffix":
        suffix = SuffixProposer(spec.suffix_decoding_max_tree_depth,
                                spec.suffix_decoding_max_cached_requests,
                                spec.suffix_decoding_max_spec_factor,
                                spec.suffix_decoding_min_token_prob)
        if not spec.ngram_prompt_lookup_aligned:
            return suffix
        lookup = NgramProposer(spec.ngram_prompt_lookup_max, spec.ngram_prompt_lookup_min,
                               aligned=True)
        return HybridProposer(suffix, lookup)
    assert draft_runner is not None
    return DraftModelProposer(
        draft_runner, BlockManager(num_blocks, block_size, enable_prefix_caching), vocab_size,
        generator, blocked_token_ids, max_model_len)
