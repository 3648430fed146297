"""The adaptive speculation policy (unit tests with a synthetic cost model)."""

from __future__ import annotations

from specserve.spec_decode.adaptive import PROBE_INTERVAL, AdaptiveSpeculation


def _policy(t0: float, t1: float, draft: float = 0.0, k: int = 5) -> AdaptiveSpeculation:
    policy = AdaptiveSpeculation(k)
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        policy.costs.observe(n, t0 + t1 * n)
    policy.costs.draft_cost_per_token = draft
    return policy


def _train(policy: AdaptiveSpeculation, seq_id: int, rate: float, steps: int = 20) -> None:
    for _ in range(steps):
        policy.record(seq_id, 5, round(5 * rate))


def test_k_grows_with_acceptance_and_shrinks_without():
    policy = _policy(t0=0.040, t1=0.0005)  # verification nearly free: a CPU/GPU at batch 1
    _train(policy, 1, 1.0)
    assert policy.plan([1], [5], other_tokens=1) == [5]
    _train(policy, 1, 0.0)
    assert policy.plan([1], [5], other_tokens=1) == [0]
    _train(policy, 1, 0.8)
    high = policy.plan([1], [5], other_tokens=1)[0]
    _train(policy, 1, 0.4)
    low = policy.plan([1], [5], other_tokens=1)[0]
    assert high > low >= 0


def test_backs_off_when_verification_is_not_free():
    """At a large batch each extra token costs as much as it can bring: stop speculating."""
    batch = list(range(32))
    cheap = _policy(t0=0.040, t1=0.00005)
    costly = _policy(t0=0.010, t1=0.004)  # compute-bound: time grows with every token
    for policy in (cheap, costly):
        for seq_id in batch:
            _train(policy, seq_id, 0.6)
    assert sum(cheap.plan(batch, [5] * 32, other_tokens=32)) > 32
    assert sum(costly.plan(batch, [5] * 32, other_tokens=32)) == 0


def test_prefers_sequences_that_accept():
    policy = _policy(t0=0.010, t1=0.0004)
    _train(policy, 1, 1.0)
    _train(policy, 2, 0.2)
    ks = policy.plan([1, 2], [5, 5], other_tokens=2)
    assert ks[0] > ks[1]


def test_limits_pinning_and_probes():
    policy = _policy(t0=0.040, t1=0.0005)
    _train(policy, 1, 1.0)
    assert policy.plan([1], [2], other_tokens=1) == [2]  # never above the hard limit
    # A pinned (seeded) sequence's k depends only on its own history, not on the batch.
    _train(policy, 7, 0.8)
    alone = policy.plan([7], [5], other_tokens=1, pinned=[True])
    crowded = policy.plan(list(range(7, 40)), [5] * 33, other_tokens=500, pinned=[True] + [False] * 32)
    assert alone[0] == crowded[0] > 0
    # A sequence that stopped speculating gets a probe proposal now and then.
    _train(policy, 3, 0.0)
    plans = [policy.plan([3], [5], other_tokens=1)[0] for _ in range(PROBE_INTERVAL)]
    assert plans[:-1] == [0] * (PROBE_INTERVAL - 1) and plans[-1] == 1
