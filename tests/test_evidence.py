"""Acceptance by evidence class (spec_decode/evidence.py) and its use by the adaptive policy."""

from __future__ import annotations

import pytest

from specserve.spec_decode.adaptive import AdaptiveSpeculation
from specserve.spec_decode.evidence import (
    DECAY,
    EXACT_CLASSES,
    LENGTH_CLASSES,
    LOOKUP,
    NUM_CLASSES,
    PRIOR_WEIGHT,
    EvidenceAcceptance,
    aligned_evidence,
    evidence_class,
)

PLAIN_SECONDS = 0.010


def test_classes_are_exact_for_short_matches_and_buckets_after():
    assert [evidence_class(m) for m in range(0, EXACT_CLASSES + 1)] == list(
        range(EXACT_CLASSES + 1))
    longer = [evidence_class(m) for m in range(EXACT_CLASSES + 1, 200)]
    assert longer == sorted(longer) and longer[0] == EXACT_CLASSES + 1  # monotone buckets
    assert max(longer) == LENGTH_CLASSES - 1 and evidence_class(24) < evidence_class(64)


def test_aligned_proposals_have_classes_of_their_own():
    """The same match lengths chosen by the copy alignment map one to one onto a second range
    of classes, so their acceptance is learned apart from the most recent occurrence's."""
    plain = [evidence_class(m) for m in range(1, 200)]
    aligned = [evidence_class(aligned_evidence(m)) for m in range(1, 200)]
    assert aligned == [c + LENGTH_CLASSES for c in plain]
    # ... and a lookup's most recent occurrences beside suffix trees (hybrid.py) a third
    lookup = [evidence_class(m | LOOKUP) for m in range(1, 200)]
    assert lookup == [c + 2 * LENGTH_CLASSES for c in plain]
    assert max(lookup) == NUM_CLASSES - 1
    ev = EvidenceAcceptance()
    for _ in range(20):
        ev.record(aligned_evidence(1), 2, 2)
        ev.record(1, 2, 0)
    assert ev.gains(aligned_evidence(1), [0.5, 0.5], 2)[1] > 0.8
    assert ev.gains(1, [0.5, 0.5], 2)[0] < 0.1


def test_without_data_a_class_gives_the_sequences_own_averages():
    ev = EvidenceAcceptance()
    assert ev.gains(3, [0.5, 0.8], 3) == pytest.approx([0.5, 0.4, 0.32])


def test_rates_are_counted_per_depth_and_blend_with_the_prior():
    """Proposals of 3 tokens after a 4-token match: 6 with all accepted, 2 with none. Depth 1
    was reached 8 times (6 accepted), depths 2 and 3 six times (all accepted); each rate adds
    PRIOR_WEIGHT pseudo-trials of the prior, and counts decay by DECAY per proposal."""
    ev = EvidenceAcceptance()
    for accepted in (3, 0, 3, 3, 0, 3, 3, 3):
        ev.record(4, 3, accepted)
    weights = [DECAY ** (7 - i) for i in range(8)]  # the newest counts fully
    reached1 = sum(weights)
    accepted1 = sum(w for w, a in zip(weights, (3, 0, 3, 3, 0, 3, 3, 3), strict=True) if a)
    p1 = (accepted1 + PRIOR_WEIGHT * 0.1) / (reached1 + PRIOR_WEIGHT)
    p2 = (accepted1 + PRIOR_WEIGHT * 0.2) / (accepted1 + PRIOR_WEIGHT)
    assert ev.gains(4, [0.1, 0.2], 3) == pytest.approx([p1, p1 * p2, p1 * p2 * p2])
    # other classes learned nothing, and matchless proposals are not counted
    assert ev.gains(5, [0.1, 0.2], 2) == pytest.approx([0.1, 0.02])
    ev.record(0, 3, 3)
    assert ev.reached[0].sum() == 0


def _policy_with_classes() -> AdaptiveSpeculation:
    """A draft-free policy at batch 2 whose steps cost 1 + 0.05 per proposal, having seen
    1-token matches accepted 10 % of the time and 8-token matches run on to 5 tokens."""
    policy = AdaptiveSpeculation(8)
    policy.costs.observe(2, 0, PLAIN_SECONDS, after_spec=False)
    for p in (1, 2, 4, 8, 12, 16):
        policy.costs.observe(2, p, PLAIN_SECONDS * (1 + 0.05 * p), after_spec=False)
    for i in range(50):
        policy.record(100, 5, 1 if i % 10 == 0 else 0, match_length=1)
        policy.record(101, 5, 5, match_length=8)
    return policy


def test_the_policy_proposes_by_evidence_not_by_the_sequences_history():
    """Two sequences with the same history (the engine's prior) propose very differently when
    one's proposal matched 8 tokens of context and the other's 1: the whole run after the
    long match, nothing after the short one."""
    policy = _policy_with_classes()
    assert policy.plan([1, 2], [8, 8], match_lengths=[8, 1]) == [8, 0]
    # without evidence both would be priced alike
    plain = policy.plan([3, 4], [8, 8])
    assert plain[0] == plain[1]


def test_sampled_sequences_never_use_the_engine_wide_classes():
    """A pinned (sampled) sequence's k depends on its own history alone, whatever the classes
    say (its output must not depend on other requests)."""
    policy = _policy_with_classes()
    fresh = AdaptiveSpeculation(8)
    assert (policy.plan([7], [8], pinned=[True], match_lengths=[8])
            == fresh.plan([7], [8], pinned=[True]))
