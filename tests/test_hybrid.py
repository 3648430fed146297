""""[suffix]" with the aligned prompt lookup beside it (ngram_prompt_lookup_aligned=True,
spec_decode/hybrid.py): which candidate a sequence proposes, how both sources keep learning,
the configuration, and the engine's output (plain decoding's, greedy and seeded)."""

from __future__ import annotations

import pytest
from helpers import tiny_llm

from specserve import LLM, SamplingParams
from specserve.engine.sequence import Sequence, SequenceStatus
from specserve.spec_decode.evidence import LOOKUP, aligned_evidence, evidence_class
from specserve.spec_decode.hybrid import PRIOR_RATE, HybridProposer
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.proposer import DraftProposals, Proposer
from specserve.spec_decode.spec_config import SpeculativeConfig
from specserve.spec_decode.suffix import SuffixProposer

FROM_LOOKUP, FROM_SUFFIX = 0, 1  # HybridProposer.sources / hybrid.SOURCES


class Fixed(Proposer):
    """A source whose next proposal for every sequence the test sets."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.evidence = 0
        self.freed: list[int] = []

    def propose(self, seqs, max_tokens, on_device=False):
        out = [self.tokens[:k] for k in max_tokens]
        return DraftProposals(out, None, match_lengths=[self.evidence if t else 0 for t in out])

    def free(self, seq):
        self.freed.append(seq.seq_id)


def _seq(seq_id: int = 0, tokens=(1, 2, 3)) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(max_tokens=64), 0.0)


def _hybrid() -> tuple[HybridProposer, Fixed, Fixed]:
    suffix, lookup = Fixed(), Fixed()
    return HybridProposer(suffix, lookup), suffix, lookup


def test_chooses_the_source_lately_right_and_scores_both():
    hybrid, suffix, lookup = _hybrid()
    seq = _seq()
    suffix.tokens, suffix.evidence = [7, 8, 9], 3
    lookup.tokens, lookup.evidence = [5, 6], aligned_evidence(2)
    # no data yet: both at the prior, the longer candidate wins
    assert hybrid.propose([seq], [4]).token_ids == [[7, 8, 9]]
    for _ in range(6):  # the text keeps taking the lookup's first token, never suffix's
        seq.token_ids.append(5)
        out = hybrid.propose([seq], [4])
    # the lookup was never chosen, yet its rate rose: every candidate is scored
    lookup_rate = hybrid.rates.rate(FROM_LOOKUP, evidence_class(aligned_evidence(2)))
    suffix_rate = hybrid.rates.rate(FROM_SUFFIX, evidence_class(3))
    assert lookup_rate > 0.75 > PRIOR_RATE > 0.25 > suffix_rate
    assert out.token_ids == [[5, 6]] and out.match_lengths == [aligned_evidence(2)]


def test_rates_are_kept_per_evidence_class():
    hybrid, suffix, lookup = _hybrid()
    seq = _seq()
    suffix.tokens, suffix.evidence = [7, 8], 2
    lookup.tokens, lookup.evidence = [5], 1
    for _ in range(6):
        hybrid.propose([seq], [4])
        seq.token_ids.append(7)  # suffix's 2-token matches are right, the lookup's 1s wrong
    hybrid.propose([seq], [4])
    # the lookup's 1-token record says nothing of its 4-token matches: both new classes sit at
    # the prior, and the longer candidate wins
    suffix.evidence, lookup.tokens, lookup.evidence = 5, [5, 6, 7], 4
    assert hybrid.propose([seq], [4]).token_ids == [[5, 6, 7]]
    seq.token_ids.append(7)
    suffix.evidence, lookup.evidence = 2, 1
    assert hybrid.propose([seq], [4]).token_ids == [[7, 8]]


def test_a_lone_candidate_is_proposed_and_none_means_none():
    hybrid, suffix, lookup = _hybrid()
    seq = _seq()
    lookup.tokens, lookup.evidence = [4, 4], 2
    out = hybrid.propose([seq], [3])
    # a most-recent-occurrence lookup match keeps classes apart from suffix's match lengths
    assert out.token_ids == [[4, 4]] and out.match_lengths == [2 | LOOKUP]
    lookup.tokens = []
    out = hybrid.propose([seq], [3])
    assert out.token_ids == [[]] and out.match_lengths == [0]
    lookup.tokens = [4]
    assert hybrid.propose([seq], [0]).token_ids == [[]]  # k = 0: nothing


def test_unadvanced_sequence_keeps_its_pending_candidates_and_free_drops_them():
    hybrid, suffix, lookup = _hybrid()
    seq = _seq()
    suffix.tokens, suffix.evidence = [7], 1
    hybrid.propose([seq], [2])
    hybrid.propose([seq], [2])  # not advanced (e.g. preempted): nothing scored yet
    assert hybrid.rates.made[FROM_SUFFIX][evidence_class(1)] == 0.0
    seq.token_ids.append(7)
    hybrid.propose([seq], [2])
    assert hybrid.rates.made[FROM_SUFFIX][evidence_class(1)] == 1.0
    seq.status = SequenceStatus.FINISHED_STOPPED
    hybrid.free(seq)
    assert not hybrid._pending and suffix.freed == [0] and lookup.freed == [0]


def test_real_sources_propose_what_they_find():
    """With the real proposers: the lookup follows the copied occurrence (its aligned
    evidence), suffix the request's most frequent continuation."""
    suffix = SuffixProposer(max_tree_depth=8, max_cached_requests=0, max_spec_factor=2.0,
                            min_token_prob=0.1)
    hybrid = HybridProposer(suffix, NgramProposer(3, 1, aligned=True))
    prompt = [11, 1, 2, 3, 4, 5, 6, 7, 8, 30, 9, 3, 10, 7, 12, 11]
    seq = Sequence(0, "r", 0, prompt, SamplingParams(max_tokens=8), 0.0)
    seq.token_ids += [1, 20, 3]
    lookup_only = NgramProposer(3, 1, aligned=True).propose([seq], [5])
    suffix_only = SuffixProposer(8, 0, 2.0, 0.1).propose([seq], [5])
    out = hybrid.propose([seq], [5])
    assert out.token_ids[0] in (lookup_only.token_ids[0], suffix_only.token_ids[0])
    assert len(hybrid._pending[0].candidates) == 2


# ---------------------------------------------------------------------------------------------
# configuration


def test_config_builds_the_hybrid_only_when_asked():
    spec = SpeculativeConfig.from_args(speculative_model="[suffix]",
                                       ngram_prompt_lookup_aligned=True)
    assert spec.method == "suffix" and spec.num_speculative_tokens == 24
    assert (spec.ngram_prompt_lookup_max, spec.ngram_prompt_lookup_min) == (4, 1)
    spec = SpeculativeConfig.from_args(speculative_config={
        "method": "suffix", "prompt_lookup_aligned": True, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2, "num_speculative_tokens": 6})
    assert (spec.ngram_prompt_lookup_max, spec.ngram_prompt_lookup_min) == (3, 2)
    plain_suffix = SpeculativeConfig.from_args(speculative_model="[suffix]")
    assert not plain_suffix.ngram_prompt_lookup_aligned
    assert plain_suffix.ngram_prompt_lookup_max is None


@pytest.mark.parametrize("kwargs, match", [
    ({"ngram_prompt_lookup_max": 0}, "ngram_prompt_lookup_max"),
    ({"ngram_prompt_lookup_max": 2, "ngram_prompt_lookup_min": 3}, "ngram_prompt_lookup_min"),
    ({"ngram_prompt_lookup_aligned": "yes"}, "must be True or False"),
])
def test_bad_hybrid_options(kwargs, match):
    kwargs = {"ngram_prompt_lookup_aligned": True, **kwargs}
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_args(speculative_model="[suffix]", **kwargs)


def test_llm_keywords_reach_the_sources(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", speculative_model="[suffix]",
              ngram_prompt_lookup_aligned=True, ngram_prompt_lookup_max=3,
              suffix_decoding_max_tree_depth=10)
    proposer = llm.llm_engine.speculation.proposer
    assert isinstance(proposer, HybridProposer)
    lookup, suffix = proposer.sources
    assert isinstance(lookup, NgramProposer) and lookup.aligned and lookup.n_max == 3
    assert isinstance(suffix, SuffixProposer) and suffix.max_depth == 10
    plain = LLM(model=str(tiny_llama), device="cpu", speculative_model="[suffix]")
    assert isinstance(plain.llm_engine.speculation.proposer, SuffixProposer)


# ---------------------------------------------------------------------------------------------
# the engine


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_plain_and_accepts(tiny_llama, test_prompts, adaptive):
    params = _greedy(40)
    repetitive = [" ".join([p] * 3) for p in test_prompts[:6]]
    plain = _tokens(tiny_llm(tiny_llama).generate(repetitive, params, use_tqdm=False))
    llm = tiny_llm(tiny_llama, speculative_model="[suffix]", ngram_prompt_lookup_aligned=True,
                   num_speculative_tokens=8, speculative_adaptive=adaptive)
    for _ in range(2):  # the second time with earlier outputs in suffix's cache
        assert _tokens(llm.generate(repetitive, params, use_tqdm=False)) == plain
    spec = llm.get_metrics()["spec_decode"]
    assert spec["num_accepted_tokens"] > 0
    proposer = llm.llm_engine.speculation.proposer
    assert not proposer._pending  # finished requests leave nothing behind
    made = [sum(row) for row in proposer.rates.made]
    assert made[FROM_LOOKUP] > 0 and made[FROM_SUFFIX] > 0  # both sources were scored


def test_sampled_requests_are_reproducible(tiny_llama, test_prompts):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    runs = []
    for _ in range(2):  # fresh engines: same proposals, so the same seeded draws
        llm = tiny_llm(tiny_llama, speculative_model="[suffix]",
                       ngram_prompt_lookup_aligned=True, num_speculative_tokens=5)
        runs.append(llm.generate(test_prompts[9], params, use_tqdm=False)[0].outputs[0])
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 24
    many = SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([test_prompts[3]] * 2, many, use_tqdm=False)
    assert all(len(c.token_ids) == 20 for o in outs for c in o.outputs)
