"""Incremental detokenization and stop checks for one sequence.

Text grows by decoding a small window of trailing tokens (a few tokens of left context keep
SentencePiece's leading spaces right) and is held back while the window ends in an incomplete
UTF-8 character, so streamed deltas concatenate exactly to the final text.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from specserve.engine.sequence import Sequence, SequenceStatus

INCOMPLETE_CHAR = "\ufffd"
CONTEXT_TOKENS = 5


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # Two window decodes per emitted token: through transformers' decode() they cost
        # ~15 us each (argument conversion and checks around the Rust call), ~1 ms per
        # batch-32 step and more in speculative steps that emit several tokens per sequence.
        # A fast tokenizer that applies no clean-up decodes exactly as its Rust backend does,
        # so the window goes straight there.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._decode = backend.decode
        else:
            self._decode = tokenizer.decode

    def start(self, seq: Sequence) -> DetokenizerState:
        n = seq.num_prompt_tokens
        return DetokenizerState(prefix_offset=max(n - CONTEXT_TOKENS, 0), read_offset=n)

    def decode_new_text(self, seq: Sequence, state: DetokenizerState, upto: int,
                        final: bool = False) -> str:
        """Text of tokens [state.read_offset, upto) of seq.token_ids, if complete (or final)."""
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self._decode(ids[state.prefix_offset : state.read_offset],
                              skip_special_tokens=skip)
        full = self._decode(ids[state.prefix_offset : upto], skip_special_tokens=skip)
        if not final and (len(full) <= len(prefix) or full.endswith(INCOMPLETE_CHAR)):
            return ""  # wait for the rest of a multi-byte character
        state.prefix_offset, state.read_offset = state.read_offset, upto
        return full[len(prefix) :]


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last new_len characters of text."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def apply_token_stop(seq: Sequence, token_id: int, eos_ids: set[int]) -> bool:
    """Stop on EOS or a stop_token_id (past min_tokens). Returns True when seq stopped."""
    p = seq.params
    if seq.num_output_tokens < p.min_tokens:
        return False
    if token_id in p.stop_token_ids:
        seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token_id
        return True
    if not p.ignore_eos and token_id in eos_ids:
        seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, None
        return True
    return False
