"""Incremental detokenization: the streamed pieces concatenate to exactly what the tokenizer's
decode() gives for the whole output, whether the windows go straight to the Rust backend (fast
tokenizer, no clean-up) or through transformers (clean-up on)."""

from __future__ import annotations

from transformers import AutoTokenizer

from specserve import SamplingParams
from specserve.engine.detokenizer import Detokenizer, DetokenizerState

TEXT = "déjà vu 🙂 — naïve code: def f(x):\n    return x  # 中文 ok\n" * 3


class _Seq:
    """What decode_new_text reads of a sequence."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.params = SamplingParams()


def _stream(detok: Detokenizer, ids: list[int], prompt_len: int) -> str:
    seq = _Seq(ids, prompt_len)
    state: DetokenizerState = detok.start(seq)
    text = "".join(detok.decode_new_text(seq, state, upto) for upto in range(prompt_len + 1,
                                                                           len(ids)))
    return text + detok.decode_new_text(seq, state, len(ids), final=True)


def test_streamed_text_equals_decode(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok.encode(TEXT)
    fast = Detokenizer(tok)
    assert fast._decode == tok.backend_tokenizer.decode  # no clean-up: the Rust backend
    assert _stream(fast, ids, 4) == tok.decode(ids[4:])
    tok.clean_up_tokenization_spaces = True
    slow = Detokenizer(tok)
    assert slow._decode == tok.decode  # clean-up on: transformers' decode
    assert _stream(slow, ids, 4) == tok.decode(ids[4:])
