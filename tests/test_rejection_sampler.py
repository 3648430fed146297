"""The rejection sampler on synthetic distributions: exactness, greedy rule, shapes, seeds.

Distribution tests run a tiny "engine" around `rejection_sample`: every row keeps generating
until it has `LENGTH` tokens, each call proposing up to k tokens drawn from position-dependent
proposal distributions q_j and verifying them against position-dependent targets p_j (context
free, so the exact law of the emitted tokens is the product p_1 x p_2 x ...). Chi-square tests
then compare the first token with p_1 and the first two with p_1 x p_2 over 120k rows. (Rows
continue into later calls: the first two tokens of ONE call, given that it emitted two, are
biased towards accepted proposals; only the continued sequence is i.i.d.)

Every distribution test has a power check: deliberately wrong samplers (always accept, accept
with q/p instead of p/q, recover from p instead of norm(max(p - q, 0)), and a bonus drawn from
the last proposal's position, which only the joint test can see) must fail the same test with
p < 1e-6, so a pass means something.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.spec_decode.rejection_sampler import (
    PAD_TOKEN,
    AcceptanceResult,
    greedy_accept,
    rejection_sample,
)

VOCAB = 10
K_MAX = 3
LENGTH = 2  # tokens per simulated row that the tests look at
ROWS = 20_000  # rows per call
CALLS = 6  # calls per distribution test: 120k draws
PASS_P = 1e-3  # the correct sampler must pass at this level
FAIL_P = 1e-6  # a wrong sampler must fail below this level
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are pooled

Sampler = Callable[..., AcceptanceResult]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: intra-op threads only add overhead (a lot on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[..., V] (unnormalised) probabilities -> [...] int64 draws, by inverse CDF.

    Zero-probability tokens are never drawn (u * total < the cumulative mass of the last
    token with mass, so the count of cumulative masses <= u * total stops before it).
    """
    cum = probs.double().cumsum(dim=-1)  # [..., V]
    u = torch.rand(probs.shape[:-1], generator=gen, dtype=torch.float64) * cum[..., -1]
    return (cum <= u[..., None]).sum(dim=-1)


# ---- synthetic distributions ---------------------------------------------------------------
def _dirichlet(gen: torch.Generator, rows: int, support: list[int] | None = None) -> torch.Tensor:
    """[rows, VOCAB] Dirichlet(1) draws (normalised Exp(1)), zero outside `support`."""
    x = torch.empty(rows, VOCAB, dtype=torch.float64).exponential_(generator=gen)
    if support is not None:
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[support] = True
        x = torch.where(mask, x, torch.zeros_like(x))
    return x / x.sum(dim=1, keepdim=True)


def _one_hot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).double()


NUM_POSITIONS = LENGTH + K_MAX  # a call at output position m <= LENGTH-1 reads p_m..p_{m+k}


def _case(name: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(p [NUM_POSITIONS, V], q [NUM_POSITIONS, V], point_mass) for one named scenario."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    n = NUM_POSITIONS
    point_mass = False
    if name == "generic":
        p, q = _dirichlet(gen, n), _dirichlet(gen, n)
    elif name == "q_mass_where_p_has_none":
        p, q = _dirichlet(gen, n, support=list(range(3, VOCAB))), _dirichlet(gen, n)
    elif name == "p_mass_where_q_has_none":
        p, q = _dirichlet(gen, n), _dirichlet(gen, n, support=list(range(VOCAB - 3)))
    elif name == "equal":
        p = _dirichlet(gen, n)
        q = p.clone()
    elif name == "disjoint":
        p = _dirichlet(gen, n, support=list(range(5)))
        q = _dirichlet(gen, n, support=list(range(5, VOCAB)))
    elif name == "point_mass":
        # An n-gram proposer: q is a point mass on a fixed token; draft_probs=None.
        p = _dirichlet(gen, n, support=list(range(1, VOCAB)))
        order = p.argsort(dim=1, descending=True)
        # Position 0 proposes p's 2nd most likely token, 1 a token p never emits, then argmax.
        tokens = [int(order[0, 1]), 0] + [int(order[j, 0]) for j in range(2, n)]
        q = _one_hot(tokens)
        point_mass = True
    else:
        raise AssertionError(name)
    return p.float(), q.float(), point_mass


CASES = ("generic", "q_mass_where_p_has_none", "p_mass_where_q_has_none", "equal", "disjoint",
         "point_mass")


# ---- the simulation ------------------------------------------------------------------------
def _simulate(sampler: Sampler, p: torch.Tensor, q: torch.Tensor, point_mass: bool, k: int,
              seed: int, rows: int = ROWS, calls: int = CALLS) -> torch.Tensor:
    """[rows * calls, LENGTH] tokens generated by repeated speculative steps.

    A fifth of the rows in each call get a random number of proposals in 0..k (mixed batches
    with padding); the others get k.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(calls):
        tokens = torch.full((rows, LENGTH + k + 1), PAD_TOKEN, dtype=torch.long)
        m = torch.zeros(rows, dtype=torch.long)  # tokens generated so far per row
        while bool((m < LENGTH).any()):
            active = (m < LENGTH).nonzero().squeeze(1)  # [A]
            m_act, num = m[active], active.shape[0]
            positions = m_act[:, None] + torch.arange(k + 1)  # [A, k+1]
            target = p[positions]  # [A, k+1, V]
            short = torch.rand(num, generator=gen) < 0.2
            num_draft = torch.where(short, torch.randint(0, k + 1, (num,), generator=gen),
                                    torch.full((num,), k))  # [A]
            valid = torch.arange(k)[None, :] < num_draft[:, None]  # [A, k]
            q_rows = q[positions[:, :k]] * valid[..., None]  # [A, k, V], zero past num_draft
            if k:
                draft = _draw(q[positions[:, :k]], gen)  # [A, k]
            else:
                draft = torch.empty(num, 0, dtype=torch.long)
            draft = torch.where(valid, draft, torch.full_like(draft, PAD_TOKEN))
            res = sampler(target, target.argmax(dim=-1), draft, None if point_mass else q_rows,
                          num_draft.tolist(), torch.zeros(num, dtype=torch.bool), [None] * num,
                          gen)
            n_emit = res.num_emitted
            assert bool(((n_emit >= 1) & (n_emit <= num_draft + 1)).all())
            for j in range(k + 1):
                sel = j < n_emit
                tokens[active[sel], m_act[sel] + j] = res.output_token_ids[sel, j]
            m[active] = m_act + n_emit
        out.append(tokens[:, :LENGTH])
    return torch.cat(out)


def _chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer `samples` to `probs` (cells with tiny expectation pooled).

    Any sample in a zero-probability cell is impossible under `probs`: p-value 0.
    """
    probs = probs.double().flatten().numpy()
    probs = probs / probs.sum()
    observed = np.bincount(samples.numpy(), minlength=probs.size).astype(np.float64)
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs * observed.sum()
    big = expected >= MIN_EXPECTED
    obs = list(observed[big])
    exp = list(expected[big])
    small_exp = expected[~big & (probs > 0)].sum()
    if small_exp > 0:
        obs.append(observed[~big & (probs > 0)].sum())
        exp.append(small_exp)
    return float(chisquare(obs, exp).pvalue)


def _pvalues(sampler: Sampler, name: str, k: int, seed: int) -> tuple[float, float]:
    """(first token vs p_1, first two tokens vs p_1 x p_2) p-values."""
    p, q, point_mass = _case(name)
    tokens = _simulate(sampler, p, q, point_mass, k, seed)
    first = _chi2_pvalue(tokens[:, 0], p[0])
    joint = _chi2_pvalue(tokens[:, 0] * VOCAB + tokens[:, 1], p[0][:, None] * p[1][None, :])
    return first, joint


# ---- deliberately wrong samplers (the tests' power) ---------------------------------------
def _textbook(target_probs, target_argmax, draft_token_ids, draft_probs, num_draft_host, greedy,
              generators, default_generator, *, accept: str = "min") -> AcceptanceResult:
    """A plain, separate implementation of speculative sampling (random rows only).

    accept="min": u < p/q (correct); "always": every proposal accepted; "swapped": u < q/p.
    """
    num_seqs, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    rows = torch.arange(num_seqs)
    num_draft = torch.tensor(num_draft_host)
    safe = draft_token_ids.clamp(min=0)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(safe, vocab).float()
    p_x = target_probs[:, :k].gather(2, safe[..., None]).squeeze(2)  # [S, k]
    q_x = draft_probs.gather(2, safe[..., None]).squeeze(2)  # [S, k]
    u = torch.rand(num_seqs, k, generator=default_generator)
    if accept == "min":
        ok = u < p_x / q_x
    elif accept == "always":
        ok = torch.ones_like(u, dtype=torch.bool)
    elif accept == "swapped":
        ok = u < q_x / p_x
    else:
        raise AssertionError(accept)
    rejected = (torch.arange(k)[None, :] < num_draft[:, None]) & ~ok
    first = torch.where(rejected.any(dim=1), rejected.int().argmax(dim=1), num_draft)
    p_stop = target_probs[rows, first]
    if k:
        residual = (p_stop - draft_probs[rows, first.clamp(max=k - 1)]).clamp(min=0)
        residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_stop)
        p_stop = torch.where((first < num_draft)[:, None], residual, p_stop)
    stop = _draw(p_stop, default_generator)
    out = torch.full((num_seqs, k + 1), PAD_TOKEN, dtype=torch.long)
    keep = torch.arange(k)[None, :] < first[:, None]
    out[:, :k] = torch.where(keep, draft_token_ids, out[:, :k])
    out[rows, first] = stop
    return AcceptanceResult(out, first + 1, first)


def _recover_from_p(target_probs, target_argmax, draft_token_ids, draft_probs, num_draft_host,
                    greedy, generators, default_generator, **kwargs) -> AcceptanceResult:
    """The library's sampler, but a rejected position's token is redrawn from p itself."""
    res = rejection_sample(target_probs, target_argmax, draft_token_ids, draft_probs,
                           num_draft_host, greedy, generators, default_generator, **kwargs)
    num_draft = torch.tensor(num_draft_host)
    rows = ((res.num_accepted < num_draft) & ~greedy).nonzero().squeeze(1)
    pos = res.num_accepted[rows]
    if rows.numel():
        res.output_token_ids[rows, pos] = _draw(target_probs[rows, pos], default_generator)
    return res


def _stale_bonus(target_probs, target_argmax, draft_token_ids, draft_probs, num_draft_host,
                 greedy, generators, default_generator, **kwargs) -> AcceptanceResult:
    """The library's sampler, but the bonus token is drawn from p_n instead of p_{n+1}."""
    res = rejection_sample(target_probs, target_argmax, draft_token_ids, draft_probs,
                           num_draft_host, greedy, generators, default_generator, **kwargs)
    num_draft = torch.tensor(num_draft_host)
    rows = ((res.num_accepted == num_draft) & (num_draft > 0) & ~greedy).nonzero().squeeze(1)
    pos = res.num_accepted[rows]
    if rows.numel():
        res.output_token_ids[rows, pos] = _draw(target_probs[rows, pos - 1], default_generator)
    return res


def _textbook_variant(accept: str) -> Sampler:
    def sampler(*args, **kwargs):
        return _textbook(*args, accept=accept, **kwargs)
    return sampler


WRONG = {
    "always_accept": _textbook_variant("always"),
    "accept_q_over_p": _textbook_variant("swapped"),
    "recover_from_p": _recover_from_p,
}
# Only visible from the second token on (a bonus is never a row's first token).
SECOND_TOKEN_WRONG = {"stale_bonus": _stale_bonus}
# Scenarios where each wrong sampler really changes the law (e.g. with q == p every variant is
# exact, and with disjoint supports the residual is p itself).
POWER_CASES = ("generic", "q_mass_where_p_has_none", "p_mass_where_q_has_none", "point_mass")


# ---- distribution tests --------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", CASES)
def test_emitted_tokens_follow_target(name: str, k: int) -> None:
    first, joint = _pvalues(rejection_sample, name, k, seed=1000 + k)
    assert first > PASS_P, f"first token != p_1 ({name}, k={k}): p={first:.2e}"
    assert joint > PASS_P, f"first two tokens != p_1 x p_2 ({name}, k={k}): p={joint:.2e}"


def test_textbook_copy_is_exact() -> None:
    """The copy the wrong variants are built from passes, so their failures are the bug's."""
    first, joint = _pvalues(_textbook_variant("min"), "generic", 2, seed=7)
    assert first > PASS_P and joint > PASS_P, (first, joint)


@pytest.mark.parametrize("name", POWER_CASES)
@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_wrong_samplers_fail(wrong: str, name: str) -> None:
    first, joint = _pvalues(WRONG[wrong], name, 2, seed=2000)
    assert first < FAIL_P, f"{wrong} passed the first-token test on {name}: p={first:.2e}"
    assert joint < FAIL_P, f"{wrong} passed the joint test on {name}: p={joint:.2e}"


@pytest.mark.parametrize("name", ["generic", "equal", "point_mass"])
@pytest.mark.parametrize("wrong", sorted(SECOND_TOKEN_WRONG))
def test_wrong_second_token_fails_joint_test(wrong: str, name: str) -> None:
    first, joint = _pvalues(SECOND_TOKEN_WRONG[wrong], name, 2, seed=2000)
    assert first > PASS_P, (first, joint)  # the first token is still right...
    assert joint < FAIL_P, f"{wrong} passed the joint test on {name}: p={joint:.2e}"


def _plain_rows(k: int, num_draft: int, seed: int, rows: int = 60_000) -> AcceptanceResult:
    """One call where every row has `num_draft` proposals, with k columns in the batch."""
    p, q, _ = _case("generic")
    gen = torch.Generator().manual_seed(seed)
    target = p[: k + 1].expand(rows, k + 1, VOCAB)
    draft = torch.full((rows, k), PAD_TOKEN, dtype=torch.long)
    if num_draft:
        draft[:, :num_draft] = torch.multinomial(q[:num_draft], rows, replacement=True,
                                                 generator=gen).T
    q_rows = q[:k].expand(rows, k, VOCAB)
    return rejection_sample(target, target.argmax(-1), draft, q_rows, [num_draft] * rows,
                            torch.zeros(rows, dtype=torch.bool), [None] * rows, gen)


@pytest.mark.parametrize("k", [0, 3])
def test_rows_without_proposals_are_plain_samples(k: int) -> None:
    p, _, _ = _case("generic")
    res = _plain_rows(k, 0, seed=31 + k)
    assert bool((res.num_emitted == 1).all()) and bool((res.num_accepted == 0).all())
    assert bool((res.output_token_ids[:, 1:] == PAD_TOKEN).all())
    assert _chi2_pvalue(res.output_token_ids[:, 0], p[0]) > PASS_P


def test_chi2_helper_tells_distributions_apart() -> None:
    """Sanity of the helper itself: 60k draws from q are not draws from p."""
    p, q, _ = _case("generic")
    gen = torch.Generator().manual_seed(5)
    tokens = torch.multinomial(q[0], 60_000, replacement=True, generator=gen)
    assert _chi2_pvalue(tokens, p[0]) < FAIL_P
    assert _chi2_pvalue(tokens, q[0]) > PASS_P


# ---- structure, greedy rule, seeds ---------------------------------------------------------
def _random_batch(seed: int, rows: int, k: int, match: float = 0.6):
    """Random targets, and proposals that equal the target's argmax with prob `match`."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, k + 1, VOCAB, generator=gen) * 2, dim=-1)
    argmax = probs.argmax(dim=-1)  # [S, k+1]
    other = (argmax[:, :k] + torch.randint(1, VOCAB, (rows, k), generator=gen)) % VOCAB
    draft = torch.where(torch.rand(rows, k, generator=gen) < match, argmax[:, :k], other)
    num_draft = torch.randint(0, k + 1, (rows,), generator=gen)
    draft = torch.where(torch.arange(k)[None, :] < num_draft[:, None], draft,
                        torch.full_like(draft, PAD_TOKEN))
    q = torch.softmax(torch.randn(rows, k, VOCAB, generator=gen), dim=-1)
    return probs, argmax, draft, q, num_draft.tolist()


def _expected_greedy(argmax: torch.Tensor, draft: torch.Tensor, num_draft: list[int]):
    out = []
    for i, n in enumerate(num_draft):
        row = []
        for j in range(n):
            if int(draft[i, j]) != int(argmax[i, j]):
                break
            row.append(int(draft[i, j]))
        row.append(int(argmax[i, len(row)]))
        out.append(row)
    return out


def _emitted(res: AcceptanceResult) -> list[list[int]]:
    tokens, counts = res.output_token_ids.tolist(), res.num_emitted.tolist()
    for row, n in zip(tokens, counts, strict=True):
        assert all(t == PAD_TOKEN for t in row[n:]), row
        assert all(t != PAD_TOKEN for t in row[:n]), row
    return [row[:n] for row, n in zip(tokens, counts, strict=True)]


def test_greedy_rule_all_greedy_batch() -> None:
    probs, argmax, draft, _, num_draft = _random_batch(0, 400, K_MAX)
    greedy = torch.ones(400, dtype=torch.bool)
    expected = _expected_greedy(argmax, draft, num_draft)
    res = rejection_sample(None, argmax, draft, None, num_draft, greedy, [None] * 400, None)
    assert _emitted(res) == expected
    assert res.num_accepted.tolist() == [len(e) - 1 for e in expected]
    direct = greedy_accept(argmax, draft, torch.tensor(num_draft))
    assert _emitted(direct) == expected
    # Some rows accept everything, some nothing: both branches are exercised.
    assert {len(e) - 1 for e in expected} == set(range(K_MAX + 1))


def test_greedy_rows_in_a_random_batch() -> None:
    rows = 400
    probs, argmax, draft, q, num_draft = _random_batch(1, rows, K_MAX)
    greedy = torch.arange(rows) % 2 == 0
    gen = torch.Generator().manual_seed(3)
    res = rejection_sample(probs, argmax, draft, q, num_draft, greedy, [None] * rows, gen)
    emitted = _emitted(res)
    expected = _expected_greedy(argmax, draft, num_draft)
    for i in range(rows):
        n = num_draft[i]
        assert 1 <= len(emitted[i]) <= n + 1
        assert emitted[i][:-1] == draft[i, : len(emitted[i]) - 1].tolist()
        if greedy[i]:
            assert emitted[i] == expected[i], i


def test_point_mass_never_emits_rejected_proposal_as_recovery() -> None:
    """With q a point mass on x, a rejection at x must recover a token other than x."""
    rows = 20_000
    p = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3))
    target = p.expand(rows, 2, VOCAB)
    draft = torch.zeros(rows, 1, dtype=torch.long)  # always propose token 0 (p = 0.5)
    gen = torch.Generator().manual_seed(11)
    res = rejection_sample(target, target.argmax(-1), draft, None, [1] * rows,
                           torch.zeros(rows, dtype=torch.bool), [None] * rows, gen)
    rejected = res.num_accepted == 0
    assert bool((res.output_token_ids[rejected, 0] != 0).all())
    assert 0.45 < float(rejected.float().mean()) < 0.55
    assert bool((res.output_token_ids[:, 0] < 3).all())


SEEDED_K_MAX = 4


def _seeded_run(rows_spec: list[tuple[int | None, int]], k: int, base_seed: int):
    """Run a batch described by (seed or None, num_draft) per row; returns emitted per row.

    A seeded row's target and proposals depend only on its seed, so it gets the same inputs in
    any batch and with any batch K (unseeded rows: on base_seed and their index).
    """
    probs, q, draft = [], [], []
    for i, (seed, n) in enumerate(rows_spec):
        assert n <= k <= SEEDED_K_MAX
        g = torch.Generator().manual_seed(10_000 + (seed if seed is not None else base_seed + i))
        row_p = torch.softmax(torch.randn(SEEDED_K_MAX + 1, VOCAB, generator=g), -1)
        row_q = torch.softmax(torch.randn(SEEDED_K_MAX, VOCAB, generator=g), -1)
        d = torch.multinomial(row_q, 1, generator=g).squeeze(1)[:k]
        probs.append(row_p[: k + 1])
        q.append(row_q[:k])
        draft.append(torch.where(torch.arange(k) < n, d, torch.full_like(d, PAD_TOKEN)))
    probs_t, q_t, draft_t = torch.stack(probs), torch.stack(q), torch.stack(draft)
    gens = [None if s is None else torch.Generator().manual_seed(s) for s, _ in rows_spec]
    default = torch.Generator().manual_seed(base_seed)
    res = rejection_sample(probs_t, probs_t.argmax(-1), draft_t, q_t, [n for _, n in rows_spec],
                           torch.zeros(len(rows_spec), dtype=torch.bool), gens, default)
    return _emitted(res)


def test_seeded_rows_do_not_depend_on_batch() -> None:
    seeded = [(101, 3), (102, 0), (103, 1), (104, 2)]
    for k in (3, 4):  # the batch's own K may exceed every seeded row's num_draft
        alone = [_seeded_run([row], row[1], base_seed=1)[0] for row in seeded]
        mates = [(None, 3), (None, 0), (None, 2)]
        batch = _seeded_run(mates[:1] + seeded[:2] + mates[1:] + seeded[2:], k, base_seed=2)
        batch_seeded = batch[1:3] + batch[5:]
        other = _seeded_run(seeded[::-1] + [(None, 1)] * 5, k, base_seed=3)[:4][::-1]
        assert batch_seeded == alone == other, (alone, batch_seeded, other)
    # The seed matters (guards against a test that compares constant outputs).
    draws = {tuple(_seeded_run([(s, 3)], 3, base_seed=0)[0]) for s in range(200, 240)}
    assert len(draws) > 5


def test_no_proposals_anywhere_in_batch() -> None:
    """K = 0 (a batch of plain decodes): shapes and a draw from p_1."""
    p = torch.tensor([0.0, 1.0] + [0.0] * (VOCAB - 2)).expand(5, 1, VOCAB)
    res = rejection_sample(p, p.argmax(-1), torch.empty(5, 0, dtype=torch.long), None,
                           [0] * 5, torch.zeros(5, dtype=torch.bool), [None] * 5,
                           torch.Generator().manual_seed(0))
    assert res.output_token_ids.tolist() == [[1]] * 5
    assert res.num_emitted.tolist() == [1] * 5

