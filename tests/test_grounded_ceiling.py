"""benchmarks/grounded_ceiling.py's bookkeeping on hand-made sequences: which proposals would be
accepted, the hindsight dynamic program, and a static rule's replay. The bound it reports for the
real model is only as good as these."""

from __future__ import annotations

import sys

from specserve.entrypoints.cli import BENCHMARKS_DIR

sys.path.insert(0, str(BENCHMARKS_DIR))
import grounded_ceiling as ceiling  # noqa: E402  (a script beside the package, not inside it)

FREE = {r: 1.0 for r in range(1, ceiling.MAX_ROWS + 1)}  # extra rows cost nothing
LINEAR = {r: 1.0 + 0.5 * (r - 1) for r in range(1, ceiling.MAX_ROWS + 1)}


def test_accepted_runs_follow_the_most_recent_occurrence():
    prompt = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]  # tail [1, 2]: most recent earlier occurrence -> 5
    output = [5, 6, 1, 9]
    rows = ceiling.accepted_runs(prompt, output, n_max=2, k=8, oracle=False)
    n, available, accepted = rows[0]
    assert n == 2 and accepted == 3  # proposes 5 6 1 2 ...: 5 6 1 accepted, 2 != 9
    assert available >= accepted
    # the oracle may use the older occurrence too (after [1, 2] came 3 4 and 5 6), never worse
    oracle = ceiling.accepted_runs(prompt, output, n_max=2, k=8, oracle=True)
    assert all(o[2] >= r[2] for o, r in zip(oracle, rows, strict=True))


def test_oracle_finds_an_older_occurrence_the_most_recent_one_misses():
    prompt = [7, 1, 3, 4, 8, 1, 5]
    output = [1, 3, 4]  # at t = 1 the tail [1]: most recent -> 5 (wrong), older -> 3 4 (right)
    recent = ceiling.accepted_runs(prompt, output, n_max=1, k=4, oracle=False)
    oracle = ceiling.accepted_runs(prompt, output, n_max=1, k=4, oracle=True)
    assert recent[1][2] == 0 and oracle[1][2] == 2


def test_aligned_runs_follow_the_copy_and_carry_the_aligned_flag():
    """The rename case of test_ngram: after "\\n def" was copied and "g" replaced "f", the
    tail "(" is looked up next to the copy anchor (accepting "a , b ) :"), where the most
    recent occurrence proposes "y ) ..." (nothing accepted)."""
    from specserve.spec_decode.evidence import ALIGNED

    prompt = [11, 1, 2, 3, 4, 5, 6, 7, 8, 30, 9, 3, 10, 7, 12, 11]
    output = [1, 20, 3, 4, 5, 6, 7, 8]
    recent = ceiling.accepted_runs(prompt, output, n_max=3, k=5, oracle=False)
    aligned = ceiling.accepted_runs(prompt, output, n_max=3, k=5, oracle=False, aligned=True)
    assert recent[3][2] == 0
    assert aligned[3] == (1 | ALIGNED, 5, 5)
    every = {n: 5 for n, _, _ in recent + aligned if n}  # a rule by evidence: 5 after any
    assert ceiling.rule_cost(aligned, LINEAR, every) < ceiling.rule_cost(recent, LINEAR, every)


def test_hindsight_cost_with_free_rows_counts_steps():
    # accepted runs: at t = 0 three tokens, then nothing: steps emit 4, then 1, 1
    rows = [(2, 5, 3), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0)]
    assert ceiling.hindsight_cost(rows, FREE) == 3.0
    # with dear rows it still never pays for a row that is not accepted, and may take fewer
    assert ceiling.hindsight_cost(rows, LINEAR) <= 6.0
    assert ceiling.hindsight_cost([(0, 0, 0)] * 4, LINEAR) == 4.0


def test_rule_cost_pays_for_rejected_rows_and_hindsight_never_costs_more():
    rows = [(1, 4, 0), (3, 4, 4), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0)]
    # propose 4 after a 1-token match (all rejected), 4 after a 3-token match (all accepted)
    cost = ceiling.rule_cost(rows, LINEAR, (0, 4, 4, 4, 4))
    assert cost == LINEAR[5] + LINEAR[5] + LINEAR[1]  # t = 0 (4 rejected), 1-5, 6
    assert ceiling.hindsight_cost(rows, LINEAR) <= cost
    assert ceiling.rule_cost(rows, LINEAR, (0, 0, 0, 0, 0)) == 7 * LINEAR[1]  # plain decoding


def test_policy_replay_speculates_on_copied_text_and_backs_off_where_nothing_is_accepted():
    """The replay drives the engine's own policy: on text that copies its input with rows for
    free it verifies long runs; where no proposal is ever accepted and rows cost half a pass,
    it stays (nearly) plain. Either way hindsight is never beaten."""
    copying = [[(4, 5, 5)] * 60]
    assert ceiling.policy_cost(copying, FREE, 5) < 0.4 * 60
    assert ceiling.policy_cost(copying, FREE, 5) >= ceiling.hindsight_cost(copying[0], FREE)
    wrong = [[(1, 5, 0)] * 60]
    assert ceiling.policy_cost(wrong, LINEAR, 5) <= 1.05 * 60


def test_suffix_runs_propose_what_followed_and_count_what_matches():
    """The "[suffix]" replay: the prompt's tail [1, 2, 3, 4] occurred before, so the proposer
    continues it (as far as the match length allows, vLLM's max_spec_factor 1.0); the accepted
    count is the proposal's agreement with the output; and a later request sees an earlier
    request's output through the global tree."""
    prompt = [9, 1, 2, 3, 4, 8, 6, 0, 1, 2, 3, 4]
    output = [8, 6, 0, 5]
    rows = ceiling.suffix_runs([prompt], [output], k=5)[0]
    assert rows[0] == (4, 4, 3)  # match 4, proposes 8 6 0 1, the output goes 8 6 0 5
    assert all(a <= p for _, p, a in rows)
    second = ceiling.suffix_runs([prompt, [5, 6, 8, 6, 0]], [output, [5]], k=5)[1]
    assert second[0] == (3, 1, 1)  # "8 6 0" was followed by 5 in the first request's output


def test_hybrid_runs_replay_the_chosen_candidate():
    """The hybrid replay ("[suffix]" with the aligned lookup beside it): at the first position
    both sources match the tail [1, 2, 3, 4] and no rate is known yet, so the longer candidate
    is proposed: the lookup's 8 6 0 1 2 (k = 5) over suffix's 8 6 0 1 (match length 4)."""
    from specserve.spec_decode.evidence import LOOKUP
    from specserve.spec_decode.hybrid import HybridProposer
    from specserve.spec_decode.ngram import NgramProposer

    prompt = [9, 1, 2, 3, 4, 8, 6, 0, 1, 2, 3, 4]
    output = [8, 6, 0, 5]
    hybrid = HybridProposer(ceiling.default_suffix_proposer(), NgramProposer(4, 1, aligned=True))
    rows = ceiling.suffix_runs([prompt], [output], k=5, proposer=hybrid)[0]
    assert rows[0] == (4 | LOOKUP, 5, 3)  # the lookup's own classes (evidence.LOOKUP)
    assert all(a <= p for _, p, a in rows)
    assert sum(hybrid.rates.made[0]) > 0 and sum(hybrid.rates.made[1]) > 0  # both scored


def test_verifying_every_proposal_whole_pays_for_its_rejected_rows():
    rows = [(1, 4, 0), (3, 4, 4), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0)]
    assert ceiling.verify_all_cost(rows, LINEAR) == ceiling.rule_cost(rows, LINEAR, (0, 4, 4, 4, 4))
    assert ceiling.verify_all_cost(rows, FREE) == 3.0  # steps at t = 0, 1 (emits 5), 6


def test_candidate_rows_find_a_second_branch_and_score_both():
    # tail [1]: the most recent occurrence is followed by 5 (wrong here), an older one by 3 4
    prompt = [7, 1, 3, 4, 8, 1, 5]
    output = [1, 3, 4]
    rows = ceiling.candidate_rows(prompt, output, n_max=1, k=4)
    at1 = rows[1]  # output[:1] known: tail [1]
    assert (at1.n, at1.accepted) == (1, 0)  # proposes 5 ...
    assert (at1.n2, at1.accepted2) == (1, 2)  # ... and the branch 3 4 would be accepted
    assert at1.agreement == 0.5  # of [1]'s two earlier occurrences, one is followed by 5
    # as a tree (2 tokens of each branch) the step takes the accepted branch
    table, second = {1: 2}, {(1, 1): 2}
    by_n = ceiling.match_length
    tree = ceiling.class_rule_cost(rows[1:], FREE, table, second, key=by_n)
    chain = ceiling.class_rule_cost(rows[1:], FREE, table, {(1, 1): 0}, key=by_n)
    assert tree == 1.0 and chain == 2.0  # 3 tokens in one pass, against 1 + 2


def test_fit_tables_never_does_worse_than_its_start():
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9]
    output = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    rows = [ceiling.candidate_rows(prompt, output, n_max=2, k=4)]
    table = {(a, b): 3 for a in range(7) for b in range(3)}
    start = sum(ceiling.class_rule_cost(r, LINEAR, table) for r in rows)
    assert ceiling.fit_tables(rows, LINEAR, 4, [table]) <= start
