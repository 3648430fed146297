"""The adaptive speculation policy: unit tests with synthetic step costs, and the driver's
shadow scoring of declined draft-free proposals."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from specserve.sampling_params import SamplingParams
from specserve.spec_decode import adaptive
from specserve.spec_decode.adaptive import (
    BORROW_STEPS,
    CLOSED_EXPLORE_TOKENS,
    EXPLORE_MIN,
    MIN_CONTINUATION_TRIALS,
    PLAIN_EXPIRY,
    PROBE_INTERVAL,
    SEQ_MIN_GAIN,
    AdaptiveSpeculation,
    StepCosts,
    _cost_table,
    row_value,
)
from specserve.spec_decode.batch_cap import (
    CAP_EXPIRY,
    FRUITFUL_TOKENS,
    LEARNING_SEQUENCES,
    MAX_UNLEARNED_BATCHES,
    TRIES_PER_CAP,
    CapCosts,
    LearningBackoff,
    batch_bucket,
    makespan_stretch,
)
from specserve.spec_decode.driver import SpeculationDriver
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.spec_config import SpeculativeConfig

PLAIN_SECONDS = 0.040
# t(k + 1 query tokens) / t(1) at batch 1, as measured on the 2-core CPU with SmolLM2 (fp32):
# MKL's small-M kernels make 4+ query rows much dearer than 1-3.
CPU_RATIOS = {1: 1.10, 2: 1.22, 3: 2.10, 4: 2.25, 5: 2.30}


def _policy(ratio, batches=(1,), k: int = 5) -> AdaptiveSpeculation:
    """A policy whose cost model has measured t(B, p) = PLAIN_SECONDS * ratio(B, p)."""
    policy = AdaptiveSpeculation(k)
    policy.cost_curve = (ratio, batches)
    _measure(policy)
    return policy


def _measure(policy: AdaptiveSpeculation) -> None:
    ratio, batches = policy.cost_curve
    for b in batches:
        for p in range(0, b * policy.max_k + 1):
            for _ in range(3):
                policy.costs.observe(b, p, PLAIN_SECONDS * ratio(b, p), after_spec=False)


def _plans(policy: AdaptiveSpeculation, steps: int, *args, **kwargs) -> list[list[int]]:
    """plan() for many steps while the engine keeps measuring (samples expire otherwise)."""
    plans = []
    for step in range(steps):
        if step % 50 == 0:
            _measure(policy)
        plans.append(policy.plan(*args, **kwargs))
    return plans


def _train(policy: AdaptiveSpeculation, seq_id: int, rate: float, steps: int = 40) -> None:
    """Verifications of 5 proposals in which each proposal (after an accepted one) is accepted
    a fraction `rate` of the time, deterministically (error diffusion instead of coin flips)."""
    credit = 0.5
    for _ in range(steps):
        accepted = 0
        while accepted < 5:
            credit += rate
            if credit < 1.0:
                break
            credit -= 1.0
            accepted += 1
        policy.record(seq_id, 5, accepted)


def test_k_grows_with_acceptance_and_shrinks_without():
    policy = _policy(lambda b, p: 1.0 + 0.01 * p)  # verification nearly free: a GPU
    _train(policy, 1, 1.0)
    assert policy.plan([1], [5]) == [5]
    _train(policy, 1, 0.0)
    assert policy.plan([1], [5]) == [0]
    _train(policy, 1, 0.8)
    high = policy.plan([1], [5])[0]
    _train(policy, 1, 0.2)
    low = policy.plan([1], [5])[0]
    assert high > low >= 0


def test_follows_the_measured_cost_curve():
    """On the CPU curve, 2 proposals are the sweet spot at high acceptance (3 cost a jump),
    1 at low acceptance, none without acceptance; all 5 only when everything is accepted."""
    policy = _policy(lambda b, p: CPU_RATIOS.get(p, 1.0))
    for rate, expected in ((1.0, 5), (0.9, 2), (0.2, 1), (0.0, 0)):
        _train(policy, 1, rate)
        assert policy.plan([1], [5]) == [expected], rate


def test_backs_off_when_verification_is_not_free():
    """At a large batch each extra token costs about as much as it can bring: stop."""
    batch = list(range(32))
    cheap = _policy(lambda b, p: 1.0 + 0.001 * p, batches=(32,))
    costly = _policy(lambda b, p: 1.0 + p / 32, batches=(32,))  # compute-bound
    for policy in (cheap, costly):
        for seq_id in batch:
            _train(policy, seq_id, 0.6)
    assert sum(cheap.plan(batch, [5] * 32)) > 32
    assert sum(costly.plan(batch, [5] * 32)) == 0


def test_a_slow_sample_at_a_small_count_does_not_outweigh_a_cheaper_larger_count(monkeypatch):
    """Verifying fewer proposals never costs more: 2 proposals measured once at 1.34 plain steps
    (a slow moment) while 5 cost 1.27 are taken at 1.27, so a sequence whose lookup found 2
    tokens still speculates; without the rule it would decode plainly until the sample
    expired (measured on the CPU with gguf_a8: runs that speculated on a third of their
    steps)."""
    def slow_two(policy):
        policy.costs.observe(1, 0, PLAIN_SECONDS, after_spec=False)
        policy.costs.observe(1, 1, PLAIN_SECONDS * 1.30, after_spec=False)
        policy.costs.observe(1, 2, PLAIN_SECONDS * 1.34, after_spec=False)
        policy.costs.observe(1, 5, PLAIN_SECONDS * 1.27, after_spec=False)
        policy.acceptance[1] = [0.25, 0.3]
        policy.continuation_trials[1] = MIN_CONTINUATION_TRIALS
        return policy

    monotone = slow_two(AdaptiveSpeculation(5))
    assert monotone.costs.ratio_curve(1) == [(0.0, 1.0), (1, 1.27), (2, 1.27), (5, 1.27)]
    assert monotone.plan([1], [2]) == [2]  # 1.325 tokens for 1.27 steps
    monkeypatch.setattr(adaptive, "MONOTONE_COSTS", False)
    assert slow_two(AdaptiveSpeculation(5)).plan([1], [2]) == [0]  # ... for 1.34


def test_a_count_measured_once_is_measured_again(monkeypatch):
    """One slow sample does not price a count for the whole sample lifetime: the engine's first
    verification (28.7 ms against 7.5 steady for 6 rows on the CPU) priced 5 proposals at 6
    plain steps, and "[ngram]" decoded plainly for two whole requests. A lone sample is
    believed for CONFIRM_STEPS steps, then the count is tried again; a second dear sample
    confirms it."""
    def first_verify_was_slow(policy):
        policy.costs.observe(1, 0, PLAIN_SECONDS, after_spec=False)
        policy.costs.observe(1, 5, PLAIN_SECONDS * 6.0, after_spec=False)
        policy.acceptance[1] = [0.9, 0.9]
        policy.continuation_trials[1] = MIN_CONTINUATION_TRIALS
        return policy

    policy = first_verify_was_slow(AdaptiveSpeculation(5))
    assert policy.plan([1], [5]) == [0]  # 4.7 tokens for 6 steps
    policy.costs.step += adaptive.CONFIRM_STEPS
    assert policy.plan([1], [5]) == [5]  # measured once, long ago: tried again
    policy.costs.observe(1, 5, PLAIN_SECONDS * 6.0, after_spec=False)  # ... really dear
    policy.costs.step += adaptive.CONFIRM_STEPS
    assert policy.plan([1], [5]) == [0]  # two samples: believed until they expire

    monkeypatch.setattr(adaptive, "CONFIRM_STEPS", adaptive.RATIO_EXPIRY)
    policy = first_verify_was_slow(AdaptiveSpeculation(5))
    policy.costs.step += 17
    assert policy.plan([1], [5]) == [0]  # without the rule: plain for RATIO_EXPIRY steps


def test_cost_ratios_are_taken_against_a_typical_plain_step(monkeypatch):
    """A speculative step's time is one draw of the machine's noise: divided by the fastest of
    several plain steps it reads dear by that noise's spread, and the policy never tries again
    what it believes dear. Against the median plain step it does not (plain steps 1.0, 1.5,
    1.5; one proposal measured at 1.6: 1.07 plain steps, not 1.6)."""
    def noisy(policy):
        for seconds in (1.0, 1.5, 1.5):
            policy.costs.observe(1, 0, PLAIN_SECONDS * seconds, after_spec=False)
        policy.costs.observe(1, 1, PLAIN_SECONDS * 1.6, after_spec=False)
        policy.acceptance[1] = [0.12, 0.12]
        policy.continuation_trials[1] = MIN_CONTINUATION_TRIALS
        return policy

    typical = noisy(AdaptiveSpeculation(5))
    assert typical.costs.ratio_curve(1)[1][1] == pytest.approx(1.6 / 1.5)
    assert typical.plan([1], [1]) == [1]  # 1.12 tokens for 1.07 steps
    monkeypatch.setattr(adaptive, "TYPICAL_REFERENCE", False)
    assert noisy(AdaptiveSpeculation(5)).plan([1], [1]) == [0]  # ... for 1.6


def test_switch_penalty_is_charged():
    """A plain step right after a speculative one that costs extra (a rebuilt decode cache)
    makes marginal speculation not worth it."""
    policy = _policy(lambda b, p: 1.0 + 0.05 * p)
    _train(policy, 1, 0.2)
    assert policy.plan([1], [1]) == [1]  # 1.2 tokens for 1.05 steps
    for _ in range(3):
        policy.costs.observe(1, 0, PLAIN_SECONDS * 1.3, after_spec=True)
    assert policy.plan([1], [1]) == [0]  # ... but not for 1.05 + 0.3


def test_explores_with_an_optimistic_cost_bound():
    """Past the largest measured p the cost is taken as the last measured ratio (a lower
    bound), so a larger p is tried whenever it could pay, and then it is measured. The bet is
    bounded: at most EXPLORE_FACTOR times the largest measured p (at least EXPLORE_MIN), so
    a batch of 32 reaches 128 proposals in a few doubling steps, and backs off if they do
    not pay."""
    batch = list(range(32))
    policy = AdaptiveSpeculation(4)
    assert policy.plan(batch, [4] * 32) == [0] * 32  # plain decoding not measured yet
    policy.costs.observe(32, 0, PLAIN_SECONDS, after_spec=False)
    for seq_id in batch:
        _train(policy, seq_id, 0.9)
    tried = []
    for _ in range(8):
        ks = policy.plan(batch, [4] * 32)
        tried.append(sum(ks))
        # cheap proposals: a fixed 30 % plus a little per proposal
        policy.costs.observe(32, sum(ks), PLAIN_SECONDS * (1.3 + 0.001 * sum(ks)),
                             after_spec=False)
    assert tried[:5] == [EXPLORE_MIN, 2 * EXPLORE_MIN, 4 * EXPLORE_MIN, 8 * EXPLORE_MIN, 128]
    assert tried[-1] == 128
    # A fixed 30 % and 128 proposals at 2.85 plain steps: they pay at 0.9 acceptance (131
    # tokens for 2.85 plain steps), not at 0.3 (46 tokens).
    policy = AdaptiveSpeculation(4)
    policy.costs.observe(32, 0, PLAIN_SECONDS, after_spec=False)
    policy.costs.observe(32, 1, PLAIN_SECONDS * 1.3, after_spec=False)
    policy.costs.observe(32, 128, PLAIN_SECONDS * 2.85, after_spec=False)
    for seq_id in batch:
        _train(policy, seq_id, 0.9)
    assert policy.plan(batch, [4] * 32) == [4] * 32
    for seq_id in batch:
        _train(policy, seq_id, 0.3)
    assert policy.plan(batch, [4] * 32) == [0] * 32


def test_probe_interval_doubles_until_the_sequence_speculates_again():
    """A pinned (sampled) sequence of a draft model that stopped proposing is probed on its
    own schedule: one token after PROBE_INTERVAL idle steps, the interval doubling."""
    policy = _policy(lambda b, p: 1.0 + 0.001 * p)
    policy.acceptance[3] = [0.0, 0.0]  # never accepts (and no rejections recorded yet)
    gaps, last = [], 0
    for step in range(1, 16 * PROBE_INTERVAL):
        if step % 50 == 0:
            _measure(policy)
        if policy.plan([3], [5], pinned=[True], plan_first=True)[0]:
            gaps.append(step - last)
            last = step
            policy.record(3, 1, 0)  # rejected
    assert gaps[:4] == [PROBE_INTERVAL, PROBE_INTERVAL * 2, PROBE_INTERVAL * 4,
                        PROBE_INTERVAL * 8]
    assert policy.probe_interval[3] == PROBE_INTERVAL * 16
    _train(policy, 3, 1.0)  # its text became predictable: it speculates on its merits
    assert policy.plan([3], [5], pinned=[True], plan_first=True)[0] == 5
    assert 3 not in policy.probe_interval  # back to probing every PROBE_INTERVAL steps


def _draft_run(acceptance: float, steps: int, batch: int = 32, k: int = 4,
               fixed: float = 0.25, per_token: float = 0.0015) -> list[int]:
    """Drive plan(plan_first=True) like the engine does with a draft model whose steps cost
    (in plain steps) 1 + fixed + per_token * proposals, every proposal accepted with
    probability `acceptance` (seeded coin flips); returns the cap of every step."""
    rng = random.Random(0)
    policy = AdaptiveSpeculation(k)
    ids = list(range(batch))
    caps = []
    for _ in range(steps):
        ks = policy.plan(ids, [k] * batch, plan_first=True)
        cap = policy.last_cap
        caps.append(cap)
        p = sum(ks)
        assert all(0 < x <= cap for x in ks) if cap else p == 0  # everyone rides along
        seconds = PLAIN_SECONDS * (1.0 + (fixed + per_token * p if p else 0.0))
        emitted = 0
        for seq_id, x in zip(ids, ks, strict=True):
            accepted = 0
            while accepted < x and rng.random() < acceptance:
                accepted += 1
            policy.record(seq_id, x, accepted)
            emitted += accepted + 1
        policy.costs.observe(batch, p, seconds, after_spec=False)
        if cap:
            policy.caps.observe(policy.costs.step, batch, cap, seconds,
                                policy.costs.plain_time(batch))
    return caps


def _draft_speedup(cap: int, a: float, batch: int = 32) -> float:
    """Expected speedup of a cap in _draft_run's model (each sequence's own k: proposals
    whose gain a^j reaches SEQ_MIN_GAIN, at least one)."""
    if cap == 0:
        return 1.0
    k = min(cap, max([j for j in range(1, cap + 1) if a ** j >= SEQ_MIN_GAIN], default=1))
    return sum(a ** j for j in range(k + 1)) / (1.25 + 0.0015 * batch * k)


def test_a_draft_model_runs_the_cap_with_the_best_measured_speedup():
    """Batch 32, a draft whose passes cost a fixed 25 % of a plain step: each acceptance rate
    settles on a cap that pays (nearly) best, after trying only a few."""
    for acceptance in (0.1, 0.5, 0.7, 0.9):
        caps = _draft_run(acceptance, 100)
        best = max(_draft_speedup(c, acceptance) for c in range(5))
        late = [_draft_speedup(c, acceptance) for c in caps[-50:]]
        assert sum(late) / len(late) >= 0.97 * best, (acceptance, caps)
        early = [_draft_speedup(c, acceptance) for c in caps[:50]]
        assert sum(early) / len(early) >= 0.9 * best, (acceptance, caps)  # cheap exploring
    assert _draft_run(0.1, 50)[-1] == 0 and _draft_run(0.9, 100)[-1] == 4


def test_under_a_cap_each_sequence_proposes_what_its_acceptance_pays_for():
    policy = _policy(lambda b, p: 1.0 + 0.001 * p, batches=(2,))
    _train(policy, 1, 1.0)
    _train(policy, 2, 0.0)
    for cap, ratio in ((3, 1.2), (4, 1.2), (5, 3.0)) * 2:  # cap 4 pays best
        policy.caps.observe(policy.costs.step, 2, cap, PLAIN_SECONDS * ratio, PLAIN_SECONDS)
    assert policy.plan([1, 2], [5, 5], plan_first=True) == [4, 1]  # never below one
    assert policy.last_cap == 4


def test_samples_expire():
    policy = _policy(lambda b, p: 1.0)
    costs: StepCosts = policy.costs
    assert costs.plain_time(1) == PLAIN_SECONDS
    costs.step += PLAIN_EXPIRY + 1
    assert costs.plain_time(1) is None


def test_a_stale_plain_time_is_measured_again():
    """The first decode step after a prefill can cost several steady ones (a CPU backend builds
    its decode state then). Priced against it, a speculative step costing 2x a steady plain
    step looks like a 0.5x one; once a speculative step runs faster than "plain", the plain
    time is dropped and measured again, and the speculative step is priced against that."""
    batch = list(range(32))
    policy = AdaptiveSpeculation(4)
    for seq_id in batch:
        _train(policy, seq_id, 0.3)
    policy.costs.observe(32, 0, PLAIN_SECONDS * 4, after_spec=False)  # first decode step
    tried = sum(policy.plan(batch, [4] * 32))
    assert tried == EXPLORE_MIN  # looks nearly free: tried (as far as exploring goes)
    policy.costs.observe(32, tried, PLAIN_SECONDS * 2, after_spec=False)  # faster than "plain"
    assert policy.costs.plain_time(32) is None
    assert policy.plan(batch, [4] * 32) == [0] * 32  # so a plain step measures it again
    policy.costs.observe(32, 0, PLAIN_SECONDS, after_spec=True)
    policy.costs.observe(32, 0, PLAIN_SECONDS, after_spec=False)
    assert policy.costs.plain_time(32) == PLAIN_SECONDS
    policy.costs.observe(32, 128, PLAIN_SECONDS * 2, after_spec=False)
    policy.costs.observe(32, 32, PLAIN_SECONDS * 1.5, after_spec=False)
    # 0.3 acceptance: ~42 tokens for 1.5 plain steps, ~46 for 2: not worth it
    assert policy.plan(batch, [4] * 32) == [0] * 32


def test_plain_time_is_interpolated_between_nearby_batch_sizes():
    costs = StepCosts()
    costs.observe(10, 0, 1.0, after_spec=False)
    costs.observe(12, 0, 2.0, after_spec=False)
    assert costs.plain_time(11) == 1.5
    assert costs.plain_time(40) is None  # too far from anything measured


def test_prefers_sequences_that_accept():
    policy = _policy(lambda b, p: 1.0 + 0.3 * p / b, batches=(2,))
    _train(policy, 1, 1.0)
    _train(policy, 2, 0.2)
    ks = policy.plan([1, 2], [5, 5])
    assert ks[0] > ks[1]


def test_limits_pinning_and_probes():
    policy = _policy(lambda b, p: 1.0 + 0.001 * p, batches=(1, 33))
    _train(policy, 1, 1.0)
    assert policy.plan([1], [2]) == [2]  # never above the hard limit
    # A pinned (seeded) sequence's k depends only on its own history, not on the batch.
    _train(policy, 7, 0.8)
    alone = policy.plan([7], [5], pinned=[True])
    crowded = policy.plan(list(range(7, 40)), [5] * 33, pinned=[True] + [False] * 32)
    assert alone[0] == crowded[0] > 0
    # ... nor on other sequences' acceptance (new sequences start from the engine average).
    _train(policy, 50, 0.0, steps=200)
    assert policy.global_acceptance[0] < 0.1
    assert policy.plan([60], [5], pinned=[True]) == policy.plan([61], [5], pinned=[True])
    assert policy.plan([62], [5]) == [0]
    # Plan-first proposers (draft models): a pinned sequence that stopped gets a probe now
    # and then, on its own schedule.
    _train(policy, 3, 0.0)
    plans = [k[0] for k in _plans(policy, PROBE_INTERVAL, [3], [5], pinned=[True],
                                  plan_first=True)]
    assert plans[:-1] == [0] * (PROBE_INTERVAL - 1) and plans[-1] == 1


def _fake_seq(seq_id: int, tokens: list[int]):
    return SimpleNamespace(seq_id=seq_id, token_ids=tokens, num_tokens=len(tokens),
                           params=SamplingParams(temperature=0.0, max_tokens=100),
                           num_output_tokens=1)


def test_declined_draft_free_proposals_are_scored_for_free():
    """A proposal the policy declines is compared with the tokens the sequence commits next:
    the acceptance average keeps learning without paying for verification."""
    spec = SpeculativeConfig("ngram", 3, ngram_prompt_lookup_max=2)
    driver = SpeculationDriver(spec, NgramProposer(2, 1), max_model_len=1000,
                               spec_max_model_len=1000)
    driver.adaptive.plan = lambda ids, limits, **kw: [0] * len(ids)  # always decline
    tokens = [5, 6, 7, 8, 5, 6]  # proposes [7, 8, 5]
    seq = _fake_seq(1, tokens)
    scheduled = [SimpleNamespace(seq=seq, num_lookahead=3, num_new_tokens=1)]
    assert driver.propose(scheduled, scheduled)[0] == [[]]
    assert driver._shadows[1] == (6, [7, 8, 5], 2)  # the tail [5, 6] matched: class 2
    before = list(driver.adaptive.global_acceptance)
    for token in (7, 8):  # the text goes on as proposed: undecided yet
        tokens.append(token)
        seq.num_tokens += 1
        driver.propose(scheduled, scheduled)
        assert driver._shadows[1] == (6, [7, 8, 5], 2)
    tokens.append(9)  # third proposal rejected: 2 of 3 would have been accepted
    seq.num_tokens += 1
    driver._resolve_shadow(seq)
    assert 1 not in driver._shadows
    first, cont = before  # the prior: proposal 1 accepted, then 1 of 2 continuations
    assert driver.adaptive.acceptance[1] == [first + 0.3 * (1 - first), cont + 0.3 * (0.5 - cont)]
    assert driver.adaptive.global_acceptance == [first + 0.05 * (1 - first),
                                                 cont + 0.05 * (0.5 - cont)]
    # ... and so do the counts of its evidence class: depths 1-3 reached, 1-2 accepted
    evidence = driver.adaptive.evidence
    assert evidence.reached[2, :4].tolist() == [1, 1, 1, 0]
    assert evidence.accepted[2, :4].tolist() == [1, 1, 0, 0]


def test_first_decode_steps_teach_no_cost():
    """A sequence's first decode step pays one-time costs (the proposer indexes its prompt, the
    CPU backend gathers its context): 16-32 ms against 7-8 for a steady verification at batch
    1 on the CPU. Its time must not become the price of speculation, so it is no pure step;
    in a batch, one fresh sequence among eight leaves the step pure, two do not."""
    spec = SpeculativeConfig("ngram", 3, ngram_prompt_lookup_max=2)

    def pure(outputs: list[int]) -> bool:
        driver = SpeculationDriver(spec, NgramProposer(2, 1), max_model_len=1000,
                                   spec_max_model_len=1000)
        driver.adaptive.plan = lambda ids, limits, **kw: [0] * len(ids)
        scheduled = []
        for i, n in enumerate(outputs):
            seq = _fake_seq(i, [5, 6, 7, 8, 5, 6])
            seq.num_output_tokens = n
            scheduled.append(SimpleNamespace(seq=seq, num_lookahead=3, num_new_tokens=1))
        driver.propose(scheduled, scheduled)
        return driver._step.pure

    assert not pure([1])
    assert pure([2])
    assert pure([1] + [5] * 7)
    assert not pure([1, 1] + [5] * 6)


def test_continuation_rate_is_optimistic_until_tried():
    """A sequence that has only proposed one token at a time has never tried a continuation:
    its c is taken as at least its first-proposal rate until it has, or a draft pass that only
    pays when amortized over k = 4 (batch 32) would never be tried deep enough to learn c."""
    draft = _policy(lambda b, p: 1.0 if p == 0 else 1.8 + 0.008 * p, batches=(32,), k=4)
    batch = list(range(32))
    for seq_id in batch:
        for _ in range(20):
            draft.record(seq_id, 1, 1)  # single proposals, all accepted
    assert draft.plan(batch, [4] * 32) == [4] * 32
    for seq_id in batch:  # deep proposals now tried: mostly only the first is accepted
        for _ in range(20):
            draft.record(seq_id, 4, 1)
    assert draft.plan(batch, [4] * 32) == [0] * 32


def test_draft_speculation_is_not_flipped_on_and_off_near_break_even():
    """Each time a draft model's speculation is turned back on the draft catches up on what it
    skipped: near break-even the choice must not follow the estimates' noise."""
    caps = CapCosts()
    for step in range(2):
        caps.observe(step, 32, 1, PLAIN_SECONDS * 1.0, PLAIN_SECONDS)  # cap 1 costs 1.0 ...
        caps.observe(step, 32, 2, PLAIN_SECONDS * 3.0, PLAIN_SECONDS)
    caps.current[batch_bucket(32)] = 0
    assert caps.choose(2, 32, [1.0, 1.04, 1.05]) == 0  # ... a 4 % gain does not turn it on
    assert caps.choose(2, 32, [1.0, 1.06, 1.07]) == 1  # 6 % does
    assert caps.choose(2, 32, [1.0, 1.0, 1.01]) == 1  # and it stays on at break-even
    assert caps.choose(2, 32, [1.0, 0.97, 0.98]) == 0  # off once clearly behind


def test_draft_caps_are_tried_again_after_they_expire():
    """Load changes: a cap found not to pay is measured again once its samples expire (and
    no more often)."""
    caps = _draft_run(0.1, 3 * CAP_EXPIRY)
    tries = [i for i, c in enumerate(caps) if c]
    assert CAP_EXPIRY < tries[-1] and len(tries) <= 3 * 8, tries


def test_a_shrinking_batch_keeps_its_cap_through_unmeasured_batch_sizes():
    """The ragged end of a batch (requests finishing one by one) enters batch sizes whose plain
    step was never measured: it runs on the larger batches' cap measurements for up to
    BORROW_STEPS steps, then one plain step measures the new size, instead of a plain step
    (and a draft catch-up) at every new size."""
    policy = AdaptiveSpeculation(4)
    batch = list(range(32))
    for seq_id in batch:
        _train(policy, seq_id, 0.7)
    policy.costs.observe(32, 0, PLAIN_SECONDS, after_spec=False)
    for _ in range(8):
        policy.caps.observe(policy.costs.step, 32, 2, PLAIN_SECONDS * 1.3, PLAIN_SECONDS)
        policy.caps.observe(policy.costs.step, 32, 1, PLAIN_SECONDS * 1.25, PLAIN_SECONDS)
        policy.caps.observe(policy.costs.step, 32, 3, PLAIN_SECONDS * 1.5, PLAIN_SECONDS)
    assert policy.plan(batch, [4] * 32, plan_first=True) == [2] * 32
    caps = [policy.plan(batch[:n], [4] * n, plan_first=True) and policy.last_cap
            for n in (20, 18, 16, 14, 12, 10)]
    assert caps == [2] * 6  # 17-32 and 9-16: no plain step, no exploring
    caps = []
    for _ in range(BORROW_STEPS + 2):
        policy.plan(batch[:12], [4] * 12, plan_first=True)
        caps.append(policy.last_cap)
    assert caps[BORROW_STEPS - 4] == 0  # then a plain step measures batch 12 (after 4 above)
    assert policy.plan(list(range(3)), [4] * 3, plan_first=True) and policy.last_cap == 2
    assert AdaptiveSpeculation(4).plan(batch, [4] * 32, plan_first=True) == [0] * 32


def test_a_closed_batch_counts_extra_tokens_of_a_few_sequences_less():
    """With nobody waiting, extra tokens of two sequences out of 32 do not end the batch
    sooner; on a CPU, where every verified row costs about a decode row, they only save rows
    of later steps, which their own rejected rows cost again: not worth it. When the whole
    batch copies its input, the batch does finish sooner: still worth it."""
    batch = list(range(32))
    row_linear = _policy(lambda b, p: 1.0 + 0.7 * p / b, batches=(32,))  # a row: 0.7 / B
    for seq_id in batch:
        _train(row_linear, seq_id, 0.95 if seq_id < 2 else 0.0)
    assert sum(row_linear.plan(batch, [5] * 32)) > 0  # open: the two speculate
    assert sum(row_linear.plan(batch, [5] * 32, closed=True)) == 0
    for seq_id in batch:
        _train(row_linear, seq_id, 0.95)
    assert sum(row_linear.plan(batch, [5] * 32, closed=True)) > 32
    assert row_value(row_linear.costs.ratio_curve(32), 32) == pytest.approx(0.7, rel=0.01)


def _draft_policy(acceptance: float, cap_cost=None) -> tuple[AdaptiveSpeculation, list[int]]:
    """A draft model's policy over a batch of 32 whose every proposal (after an accepted one)
    is accepted at `acceptance`, plain decoding measured, and each cap c measured 8 times at
    cap_cost(c) plain steps (if given)."""
    policy = AdaptiveSpeculation(4)
    batch = list(range(32))
    for seq_id in batch:
        policy.acceptance[seq_id] = [acceptance, acceptance]
        policy.continuation_trials[seq_id] = 100  # verified: its own acceptance is known
    policy.costs.observe(32, 0, PLAIN_SECONDS, after_spec=False)
    for _ in range(8 if cap_cost else 0):
        for cap in range(1, 5):
            policy.caps.observe(policy.costs.step, 32, cap, PLAIN_SECONDS * cap_cost(cap),
                                PLAIN_SECONDS)
    return policy, batch


def _simulated_stretch(a: float, k: int, remaining: int, batch: int, trials: int) -> float:
    """Makespan of a closed batch in which each sequence gains 1 + (its accepted proposals:
    P(>= j) = a^j, j <= k) tokens a step, over its steps at the mean pace."""
    rng = np.random.default_rng(0)
    gains = np.array([a ** j for j in range(1, k + 1)])
    p_count = np.append(-np.diff(np.concatenate([[1.0], gains])), gains[-1])  # P(X = 0..k)
    steps = []
    for _ in range(trials):
        pos, n = np.zeros(batch), 0
        while (pos < remaining).any():
            pos += 1 + rng.choice(k + 1, size=batch, p=p_count)
            n += 1
        steps.append(n)
    return float(np.mean(steps)) / (remaining / (1.0 + gains.sum()))


@pytest.mark.parametrize("a, k, remaining, batch", [
    (0.5, 1, 128, 32), (0.7, 2, 128, 32), (0.9, 4, 128, 32), (0.7, 2, 20, 8)])
def test_makespan_stretch_matches_a_simulation(a, k, remaining, batch):
    gains = np.array([a ** j for j in range(1, k + 1)])
    mean = 1.0 + gains.sum()
    variance = ((2 * np.arange(1, k + 1) - 1) * gains).sum() - gains.sum() ** 2
    estimate = makespan_stretch(mean, variance, [remaining] * batch)
    assert estimate == pytest.approx(_simulated_stretch(a, k, remaining, batch, 300), rel=0.025)
    assert makespan_stretch(mean, variance, [remaining]) < estimate  # fewer to wait for
    assert makespan_stretch(mean, 0.0, [remaining] * batch) == 1.0  # plain decoding


def test_a_closed_batch_prices_draft_caps_by_its_slowest_sequence():
    """Batch 32 of 128 tokens each, a draft whose cap-c steps cost 1.12 + 0.24 c plain steps
    (the H200 with a 1B draft for an 8B target). At acceptance 0.5 cap 1 gains ~10 % per
    step, which an open batch takes; a closed one waits for its slowest sequence (~8 %
    longer at that pace) and decodes plainly. At 0.7 speculation still pays closed (cap 2;
    open, caps 2 and 3 are within 1 %)."""
    for acceptance, open_caps, closed_cap in ((0.5, {1}, 0), (0.7, {2, 3}, 2)):
        policy, batch = _draft_policy(acceptance, lambda cap: 1.12 + 0.24 * cap)
        policy.plan(batch, [4] * 32, plan_first=True)
        assert policy.last_cap in open_caps, acceptance
        policy.caps.current.clear()
        policy.plan(batch, [4] * 32, plan_first=True, closed=True, remaining=[128] * 32)
        assert policy.last_cap == closed_cap, acceptance
        policy.caps.current.clear()
        policy.plan(batch, [4] * 32, plan_first=True, remaining=[128] * 32)  # open: ignored
        assert policy.last_cap in open_caps, acceptance


def test_a_closed_batch_past_its_start_tries_no_cap_from_plain_decoding():
    """Plain decoding is best as far as anything is measured (here: nothing live, as after
    every cap sample expired). An open batch tries a cap, and so does a closed batch at its start
    (the draft's catch-up is the prompts); a closed batch that has generated a while does
    not: the catch-up over every context costs more than it can win back before it ends."""
    policy, batch = _draft_policy(0.3)

    def cap(ever: bool = True, **closed) -> int:
        policy.caps = CapCosts()
        if ever:  # measured once, long expired
            policy.caps.observe(policy.costs.step - 10 * CAP_EXPIRY, 32, 1, PLAIN_SECONDS,
                                PLAIN_SECONDS)
        policy.plan(batch, [4] * 32, plan_first=True, **closed)
        return policy.last_cap

    assert cap() > 0
    assert cap(closed=True, remaining=[128] * 32, generated=[3] * 32) > 0
    assert cap(closed=True, remaining=[100] * 32, generated=[28] * 32) == 0
    assert cap(remaining=[100] * 32, generated=[28] * 32) > 0  # open: ignored
    # never measured at all: nothing to go on, so even a settled batch tries once
    assert cap(ever=False, closed=True, remaining=[100] * 32, generated=[28] * 32) > 0


def test_a_closed_batch_charges_turning_speculation_on_with_the_drafts_catch_up():
    """Acceptance 0.5, a cap of 1 costing 1.28 plain steps: it pays in a closed batch of 128
    tokens a sequence if the draft is caught up, not if it first has to run 4143 tokens that
    cost 6 plain steps (the prompts' prefill at batch 32), spread over the ~85 steps left.
    Once speculating, the catch-up is not charged again."""
    policy, batch = _draft_policy(0.5, lambda cap: 1.04 + 0.24 * cap)
    policy.caps.observe_catch_up(policy.costs.step, 4143, 6 * PLAIN_SECONDS)
    closed = dict(closed=True, remaining=[128] * 32, generated=[0] * 32)

    def cap(lag: int) -> int:
        policy.plan(batch, [4] * 32, plan_first=True, lag=lag, **closed)
        return policy.last_cap

    assert cap(lag=4143) == 0
    assert cap(lag=0) == 1
    assert cap(lag=4143) == 1  # already on: nothing to catch up on by staying on


def test_a_long_speculative_run_measures_plain_decoding_again_without_a_cycle():
    """Plain-step samples expire during a long speculative run. The batch then runs on its cap
    measurements for BORROW_STEPS steps and decodes plainly until a plain step is measured;
    the first plain step after a speculative one only measures the switch. Stopping after
    that one step left plain decoding unmeasured and repeated: one plain step in nine."""
    policy, batch = _draft_policy(0.9)
    plain_steps, last_spec = 0, False
    for _ in range(3 * PLAIN_EXPIRY):
        policy.plan(batch, [4] * 32, plan_first=True)
        cap = policy.last_cap
        seconds = PLAIN_SECONDS * (1.0 + 0.2 * cap)
        policy.costs.observe(32, 32 * cap, seconds, after_spec=last_spec)
        if cap:
            policy.caps.observe(policy.costs.step, 32, cap, seconds, PLAIN_SECONDS)
        plain_steps += cap == 0
        last_spec = cap > 0
    assert plain_steps <= 3 * 3, plain_steps  # two to re-measure per expiry, plus the start


def test_a_caps_cost_is_the_lower_quartile_of_its_steps():
    """A draft's steps vary with what was accepted before them, not only with load: one fast
    step must not price a cap, nor one slow step among a few."""
    caps = CapCosts()
    for ratio in (1.25, 1.40, 1.38, 1.42, 1.36):
        caps.observe(0, 32, 1, PLAIN_SECONDS * ratio, PLAIN_SECONDS)
    assert caps.ratio(0, 32, 1) == pytest.approx(1.36)
    assert caps.choose(0, 32, [1.0, 1.5 / 1.08]) == 0  # ~1.02x: not worth it
    caps = CapCosts()
    for ratio in (4.3, 1.5):  # a slow step first
        caps.observe(0, 32, 2, PLAIN_SECONDS * ratio, PLAIN_SECONDS)
    assert caps.ratio(0, 32, 2) == pytest.approx(1.5)


def test_the_largest_cap_is_tried_from_plain_only_if_its_extrapolated_cost_could_pay():
    """While plain decoding is best the largest cap is tried (a draft may only pay with several
    proposals), unless the measured caps' costs, extrapolated linearly, already rule it out:
    in a closed batch of 32 on the H200 at acceptance 0.5 (where plain decoding was best),
    caps 1 and 2 cost 1.37 and 1.6 plain steps, and trying cap 4 (2.0, for 1.94 tokens) made
    the draft catch up on every sequence and ran steps at twice the plain cost."""
    def chosen(a: float, measured: dict[int, float]) -> int:
        caps = CapCosts()
        for cap, ratio in measured.items():
            for _ in range(TRIES_PER_CAP):
                caps.observe(0, 32, cap, PLAIN_SECONDS * ratio, PLAIN_SECONDS)
        expected = [1.0] + [1.0 + sum(a ** j for j in range(1, c + 1)) for c in range(1, 5)]
        return caps.choose(0, 32, expected)

    assert chosen(0.4, {1: 1.37, 2: 1.60}) == 0  # cap 4 at ~2.06: 1.65 tokens do not pay
    assert chosen(0.4, {1: 1.37}) == 4  # one measured cap: no slope to go on
    assert chosen(0.45, {1: 1.60, 2: 1.62}) == 4  # mostly a fixed cost: 1.79 tokens at ~1.66


def test_a_new_closed_batch_runs_cap_1_once_to_learn_its_own_acceptance():
    """The engine-wide acceptance (0.5) says plain decoding, every cap is measured, yet none of
    this batch's sequences was verified: it runs cap 1 once (on text that accepts 0.7 it then
    speculates), and a batch that verified its sequences decodes plainly."""
    policy, batch = _draft_policy(0.5, lambda cap: 1.12 + 0.24 * cap)
    closed = dict(plan_first=True, closed=True, remaining=[128] * 32, generated=[1] * 32)
    policy.plan(batch, [4] * 32, **closed)
    assert policy.last_cap == 0  # verified at 0.5: plain
    new_batch = [seq_id + 100 for seq_id in batch]
    policy.plan(new_batch, [4] * 32, **closed)
    assert policy.last_cap == 1
    for seq_id in new_batch:
        policy.record(seq_id, 1, 1 if seq_id % 10 < 7 else 0)  # first proposals: 0.7
    policy.plan(new_batch, [4] * 32, **closed)
    assert policy.last_cap >= 1



def test_a_learning_step_does_not_switch_speculation_on():
    """The learning step (cap 1 once, plain decoding being best) is a measurement: the next
    step must still beat plain decoding by SWITCH_MARGIN to speculate. When it counted as on,
    a batch at break-even (cap 1 worth 1.0x) stayed on and explored larger caps: 0.82-0.96x
    at acceptance 0.5, batch 32, on the H200."""
    caps = CapCosts()
    for _ in range(TRIES_PER_CAP):
        caps.observe(0, 32, 1, PLAIN_SECONDS * 1.4, PLAIN_SECONDS)
    break_even = [1.0, 1.4]  # cap 1: 1.4 tokens for 1.4 plain steps
    assert caps.choose(0, 32, break_even, explore_from_plain=False, learn=True) == 1
    assert caps.choose(1, 32, break_even, explore_from_plain=False) == 0
    paying = [1.0, 1.6]  # 1.14x: worth switching on
    assert caps.choose(2, 32, paying, explore_from_plain=False, learn=True) == 1
    assert caps.choose(3, 32, paying, explore_from_plain=False) == 1


def test_a_new_closed_batch_does_not_inherit_the_last_batchs_speculation():
    """A new batch's draft prefills every prompt whether or not the last batch ended
    speculating, so it is priced as from plain decoding: at break-even it learns and stops,
    instead of staying on by the switching margin (H200, batch 32, acceptance 0.5: caps 1-2
    for 17-30 steps at 0.92-0.95x plain decoding)."""
    policy, _ = _draft_policy(0.5, lambda cap: 1.12 + 0.24 * cap)
    policy.caps.current[batch_bucket(32)] = 1  # the last batch ended speculating
    batch = list(range(100, 132))
    closed = dict(plan_first=True, closed=True, remaining=[127] * 32, generated=[1] * 32)
    policy.plan(batch, [4] * 32, **closed)
    assert policy.last_cap == 1  # the learning step
    for seq_id in batch:
        policy.record(seq_id, 1, seq_id % 2)  # 0.5
    policy.plan(batch, [4] * 32, **closed)
    assert policy.last_cap == 0


def test_closed_batches_back_off_from_learning_that_does_not_pay():
    """Each learning step after which a closed batch settles on plain decoding doubles the
    number of new batches that start without one (1, then MAX_UNLEARNED_BATCHES = 3): on a
    steady workload where speculation does not pay (acceptance 0.5 on the H200 at batch 32;
    0.3 here) every batch paid 2.4-3.4 % to learn what the last one learned. A batch that
    settles speculating resets the backoff, so a shift to text that accepts well is found
    within four batches and then kept."""
    def cost(cap: int) -> float:
        return 1.12 + 0.24 * cap if cap else 1.0

    policy, _ = _draft_policy(0.5, cost)
    first_ids = iter(range(100, 10_000, 100))
    rng = np.random.default_rng(0)
    last_spec = [False]

    def closed_batch(acceptance: float) -> tuple[bool, int]:
        """(whether the young batch ran a cap, the cap it settled on)"""
        batch = list(range(next(first_ids), 0, -1))[:32]
        young_cap = False
        for generated in (*range(1, CLOSED_EXPLORE_TOKENS + 1), 12, FRUITFUL_TOKENS):
            ks = policy.plan(batch, [4] * 32, plan_first=True, closed=True,
                             remaining=[128 - generated] * 32, generated=[generated] * 32)
            if generated == 1:  # a batch that skips learning is settled from its start
                assert policy.settled_plain == (policy.learning.learning is False
                                                and policy.last_cap == 0)
            if generated <= CLOSED_EXPLORE_TOKENS:
                young_cap |= policy.last_cap > 0
            seconds = PLAIN_SECONDS * cost(policy.last_cap)  # the step's time teaches the costs
            policy.costs.observe(32, 32 * policy.last_cap, seconds, after_spec=last_spec[0])
            if policy.last_cap:
                policy.caps.observe(policy.costs.step, 32, policy.last_cap, seconds, PLAIN_SECONDS)
            last_spec[0] = policy.last_cap > 0
            for seq_id, k in zip(batch, ks, strict=True):  # the accepted prefix of k proposals
                if k:
                    hits = rng.random(k) < acceptance
                    policy.record(seq_id, k, int(np.cumprod(hits).sum()))
        return young_cap, policy.last_cap

    learned = [closed_batch(0.3) for _ in range(7)]
    assert learned == [(True, 0), (False, 0), (True, 0), (False, 0), (False, 0), (False, 0),
                       (True, 0)]
    assert MAX_UNLEARNED_BATCHES == 3
    shifted = [closed_batch(0.8) for _ in range(4)]
    # three batches start plainly (the backoff); the fourth learns, its sequences take the
    # batch's learned rate (not 30 % of the way from the engine's 0.3), it settles
    # speculating and resets the backoff
    assert [young for young, _ in shifted] == [False, False, False, True]
    assert shifted[-1][1] > 0
    assert (policy.learning.fruitless, policy.learning.skip_left) == (0, 0)
    assert closed_batch(0.8)[0]  # the next batch speculates from its start


def test_a_learning_batch_that_stops_speculating_early_learned_nothing():
    """A learning batch that speculates past its start and then decodes plainly before
    FRUITFUL_TOKENS counts as fruitless (the next batch skips learning); one still
    speculating at FRUITFUL_TOKENS resets the backoff. (At acceptance 0.5 on the H200 at
    batch 32 most learning batches speculated 4-23 steps and stopped, and each reset the
    backoff: 8 of 9 batches paid ~3.5 % for learning.)"""
    backoff = LearningBackoff()
    batches = (list(range(first, first + 32)) for first in range(0, 10_000, 100))

    def learns_and_stops() -> None:
        assert backoff.learns(next(batches))
        backoff.settled(1, CLOSED_EXPLORE_TOKENS + 1)  # speculating past its start
        backoff.settled(1, 20)
        assert backoff.pending  # not judged yet
        backoff.settled(0, 24)  # ... then plain

    learns_and_stops()
    assert (backoff.fruitless, backoff.skip_left) == (1, 1)
    assert not backoff.learns(next(batches))
    learns_and_stops()
    assert (backoff.fruitless, backoff.skip_left) == (2, 3)
    assert not any(backoff.learns(next(batches)) for _ in range(3))  # the next three
    assert backoff.learns(next(batches))
    backoff.settled(1, CLOSED_EXPLORE_TOKENS + 1)
    backoff.settled(1, FRUITFUL_TOKENS)  # still speculating: its text pays
    assert (backoff.fruitless, backoff.skip_left, backoff.pending) == (0, 0, False)
    assert backoff.learns(next(batches))


def test_a_batch_that_skips_learning_does_not_speculate_on_the_engines_average():
    """While the backoff skips learning, a new closed batch decodes plainly for its life even
    when the engine-wide acceptance (mostly the last batch's last verification) says a cap
    pays: recent batches' own evidence said it did not. (H100, batch 32, acceptance 0.5: a
    skipped batch started at cap 2 on that average and ran 5 steps at 0.95x.) The same batch
    with learning allowed speculates: the test would see the difference."""
    def young_cap(skip_left: int) -> tuple[int, bool]:
        policy, _ = _draft_policy(0.5, lambda cap: 1.12 + 0.24 * cap)
        policy.global_acceptance[:] = [0.9, 0.9]
        policy.learning.fruitless, policy.learning.skip_left = 1, skip_left
        closed = dict(plan_first=True, closed=True, remaining=[127] * 32, generated=[1] * 32)
        policy.plan(list(range(100, 132)), [4] * 32, **closed)
        return policy.last_cap, policy.settled_plain

    assert young_cap(skip_left=1) == (0, True)
    assert young_cap(skip_left=0)[0] > 0


def test_a_batch_that_speculates_without_learning_is_judged_like_a_learning_one():
    """A batch that did not learn, speculated past its start and then decoded plainly before
    FRUITFUL_TOKENS counts as fruitless; it must not reset the backoff just because it was
    speculating when first judged (session 34: that made the next batch learn again)."""
    backoff = LearningBackoff(fruitless=1, skip_left=1)
    assert not backoff.learns(list(range(32)))
    backoff.settled(2, CLOSED_EXPLORE_TOKENS + 1)
    assert (backoff.fruitless, backoff.skip_left, backoff.pending) == (1, 0, True)
    backoff.settled(0, 14)
    assert (backoff.fruitless, backoff.skip_left, backoff.pending) == (2, 3, False)


def test_a_learning_step_gives_the_batch_its_own_mean_rate():
    """A closed batch's learning step verifies the first proposals of LEARNING_SEQUENCES of its
    sequences, and then every sequence's first-proposal rate is their mean outcome: one
    verification would move it only EMA_WEIGHT of the way from the previous batches' rate."""
    policy, _ = _draft_policy(0.5, lambda cap: 1.12 + 0.24 * cap)
    policy.global_acceptance[:] = [0.3, 0.3]
    batch = list(range(100, 132))
    closed = dict(plan_first=True, closed=True, remaining=[127] * 32, generated=[1] * 32)
    ks = policy.plan(batch, [4] * 32, **closed)
    assert policy.last_cap == 1 and policy.learning.pending
    # only the batch's first LEARNING_SEQUENCES propose: the draft prefills just their prompts
    assert ks == [1] * LEARNING_SEQUENCES + [0] * (32 - LEARNING_SEQUENCES)
    for seq_id in batch[:LEARNING_SEQUENCES]:  # 6 of 8 first proposals accepted
        policy.record(seq_id, 1, int(seq_id % 4 != 0))
    policy.plan(batch, [4] * 32, **closed)
    assert {policy.acceptance[s][0] for s in batch} == {0.75}
    assert policy.last_cap >= 1
    policy.record(batch[0], 1, 0)  # later verifications go on from there
    assert policy.acceptance[batch[0]][0] == pytest.approx(0.75 * 0.7)


def _idle_batch(num_seqs: int, temperature: float = 0.0):
    """A draft-free driver whose policy declines every proposal, over num_seqs sequences that
    always have an n-gram match, and a count of the proposer's lookups."""
    spec = SpeculativeConfig("ngram", 3, ngram_prompt_lookup_max=2)
    proposer = NgramProposer(2, 1)
    looks = []
    propose = proposer.propose
    proposer.propose = lambda seqs, ks, on_device=False: (looks.append(1), propose(seqs, ks))[1]
    driver = SpeculationDriver(spec, proposer, max_model_len=1000, spec_max_model_len=1000)
    driver.adaptive.plan = lambda ids, limits, **kw: [0] * len(ids)  # always decline
    scheduled = []
    for seq_id in range(num_seqs):
        seq = _fake_seq(seq_id, [5, 6, 7, 5, 6])
        seq.params = SamplingParams(temperature=temperature, max_tokens=100)
        scheduled.append(SimpleNamespace(seq=seq, num_lookahead=3, num_new_tokens=1))
    return driver, scheduled, looks


def test_an_idle_closed_batch_looks_for_proposals_only_now_and_then():
    """After IDLE_AFTER steps in a row without a chosen proposal, a closed draft-free batch of
    IDLE_MIN_BATCH or more looks every IDLE_LOOK_EVERY steps; a joining sequence makes it look
    every step again. Open batches, small ones and batches with sampled sequences always look."""
    from specserve.spec_decode.driver import IDLE_AFTER, IDLE_LOOK_EVERY, IDLE_MIN_BATCH

    driver, scheduled, looks = _idle_batch(IDLE_MIN_BATCH)
    steps = IDLE_AFTER + 4 * IDLE_LOOK_EVERY
    for _ in range(steps):
        driver.propose(scheduled, scheduled, closed=True)
    assert len(looks) == IDLE_AFTER + 4
    joined = _fake_seq(99, [5, 6, 7, 5, 6])
    scheduled.append(SimpleNamespace(seq=joined, num_lookahead=3, num_new_tokens=1))
    looks.clear()
    for _ in range(IDLE_AFTER):
        driver.propose(scheduled, scheduled, closed=True)
    assert len(looks) == IDLE_AFTER
    for num_seqs, closed, temperature in ((IDLE_MIN_BATCH, False, 0.0),
                                          (IDLE_MIN_BATCH - 1, True, 0.0),
                                          (IDLE_MIN_BATCH, True, 0.8)):
        driver, scheduled, looks = _idle_batch(num_seqs, temperature)
        for _ in range(steps):
            driver.propose(scheduled, scheduled, closed=closed)
        assert len(looks) == steps, (num_seqs, closed, temperature)


def test_cost_past_the_measured_counts_follows_the_last_measured_slope():
    """Past the largest measured proposal count a step's cost continues the slope between the
    two largest measured counts (a lower bound: the cost is convex in p), flat while only one
    is measured (the step from plain decoding to the first count holds a speculative step's
    fixed cost) and never downwards (noise)."""
    points = [(0.0, 1.0), (32.0, 1.9), (64.0, 2.6)]
    cost = _cost_table(points, 128, 0.0)
    assert cost[48] == pytest.approx(2.25)  # interpolated
    assert cost[96] == pytest.approx(2.6 + 32 * 0.7 / 32)
    assert cost[128] == pytest.approx(4.0)
    assert _cost_table([(0.0, 1.0), (8.0, 1.3)], 16, 0.0)[16] == pytest.approx(1.3)
    assert _cost_table([(0.0, 1.0), (8.0, 1.3), (16.0, 1.2)], 32, 0.1)[32] == pytest.approx(1.3)
    # A batch of 32 whose proposals are worth 0.45 tokens each does not bet 105 of them
    # where 64 were measured at 2.6 plain steps (flat, they seemed to cost 2.6: 47 tokens
    # more for 1.6 steps more; they cost 3.7).
    policy = AdaptiveSpeculation(4)
    policy.costs.observe(32, 0, PLAIN_SECONDS, after_spec=False)
    policy.costs.observe(32, 32, PLAIN_SECONDS * 1.9, after_spec=False)
    policy.costs.observe(32, 64, PLAIN_SECONDS * 2.6, after_spec=False)
    batch = list(range(32))
    for seq_id in batch:
        policy.acceptance[seq_id] = [0.45, 1.0]
        policy.continuation_trials[seq_id] = MIN_CONTINUATION_TRIALS
    assert sum(policy.plan(batch, [4] * 32)) <= 64


def test_unmeasured_proposals_cost_what_a_plain_row_does(monkeypatch):
    """Before any speculative step of a batch bucket is measured, a proposal is priced at what
    one more sequence adds to a plain step there (StepCosts.proposal_prior), not at nothing.
    On the 2-core CPU a closed batch shrinking from 32 entered each bucket betting up to
    EXPLORE_MIN proposals as if free; they cost 1.3-2.5 plain steps (session 41)."""
    policy = AdaptiveSpeculation(4)
    for b in range(20, 33):  # a closed batch's plain steps: 10 ms + 2 ms a sequence
        policy.costs.observe(b, 0, 0.010 + 0.002 * b, after_spec=False)
    assert policy.costs.proposal_prior(32) == pytest.approx(0.002 / 0.074)
    assert policy.costs.proposal_prior(4) == 0.0  # no plain steps measured near it
    assert _cost_table([(0.0, 1.0)], 8, 0.0, 0.03)[8] == pytest.approx(1.24)
    assert _cost_table([(0.0, 1.0), (4.0, 1.1)], 8, 0.0, 0.03)[8] == pytest.approx(1.22)
    batch = list(range(32))
    for seq_id in batch:  # 8 sequences whose first proposal is accepted 60 % of the time
        policy.acceptance[seq_id] = [0.6 if seq_id < 8 else 0.0, 0.5]
        policy.continuation_trials[seq_id] = MIN_CONTINUATION_TRIALS
    # 8 proposals: 4.8 tokens for 8 rows, 1.22 plain steps: 36.8 tokens against 32 * 1.22
    assert sum(policy.plan(batch, [1] * 8 + [0] * 24)) == 0
    monkeypatch.setattr(policy.costs, "proposal_prior", lambda batch_size: 0.0)
    assert sum(policy.plan(batch, [1] * 8 + [0] * 24)) == 8  # priced as free, they were bet


def test_unmeasured_proposals_fall_back_on_a_chord_from_a_smaller_batch():
    """With no batch size near it measured (a closed batch of 32 runs at one size until its
    end), or a local slope that noise flattened, a proposal costs at least the chord from a
    smaller batch size measured at any time, even one whose samples expired: on the Zen 3
    CPU a batch of 32 priced its first proposals at nothing and bet 8, then 16 on chat text
    (1.2 and 1.5 plain steps) (session 44)."""
    costs = StepCosts()
    costs.observe(1, 0, 0.012, after_spec=False)  # 10 ms + 2 ms a sequence
    costs.observe(8, 0, 0.026, after_spec=False)
    costs.step += PLAIN_EXPIRY + 1  # both expire as samples, not as floors
    costs.observe(32, 0, 0.074, after_spec=False)
    assert costs.plain_time(8) is None
    # the nearest size at or below half of 32: 8
    assert costs.proposal_prior(32) == pytest.approx(0.048 / 24 / 0.074)
    assert costs.proposal_prior(4) == 0.0  # nothing at least PRIOR_MIN_SPREAD below
    # noise made 28 look dearer than 32: the local slope reads 0, the chord still counts
    costs.observe(28, 0, 0.080, after_spec=False)
    assert costs.proposal_prior(32) == pytest.approx(0.048 / 24 / 0.074)
    costs.observe(26, 0, 0.036, after_spec=False)  # a local slope steeper than the chord
    assert costs.proposal_prior(32) == pytest.approx((0.074 - 0.036) / 6 / 0.074)


def test_a_counts_cost_is_the_median_of_its_samples(monkeypatch):
    """A count's cost is the median of its ratio samples, not the fastest. Each sample is one
    step against the typical plain step, so its noise goes both ways, and the fastest of six
    read 0.98-1.00 plain steps on the 2-core CPU for 8 proposals at batch 30 that cost 1.12-1.23
    (session 41): the policy went on betting on them."""
    policy = AdaptiveSpeculation(4)
    for _ in range(3):
        policy.costs.observe(32, 0, PLAIN_SECONDS, after_spec=False)
    for ratio in (1.3, 1.0, 1.15, 1.2, 1.1):
        policy.costs.observe(32, 8, PLAIN_SECONDS * ratio, after_spec=False)
    assert policy.costs.ratio_curve(32) == [(0.0, 1.0), (8, pytest.approx(1.15))]
    monkeypatch.setattr(adaptive, "MEDIAN_RATIOS", False)
    assert policy.costs.ratio_curve(32) == [(0.0, 1.0), (8, pytest.approx(1.0))]
