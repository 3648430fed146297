"""Suffix decoding ("[suffix]"): the counting suffix tree, the proposer, and the engine."""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest
from helpers import tiny_llm

from specserve import LLM, SamplingParams
from specserve.engine.sequence import Sequence, SequenceStatus
from specserve.spec_decode import suffix_native
from specserve.spec_decode.spec_config import SpeculativeConfig
from specserve.spec_decode.suffix import (
    Cursor,
    NativeSuffixTree,
    OutputCache,
    SuffixProposer,
    SuffixTree,
    _walk,
    new_tree,
)

# ---------------------------------------------------------------------------------------------
# the tree


def substring_counts(seqs: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


def assert_counts_exact(tree: SuffixTree, seqs: list[list[int]]) -> None:
    expected = substring_counts(seqs, tree.max_depth)
    for sub, n in expected.items():
        assert tree.count(list(sub)) == n, sub
    assert tree.root.count == sum(len(s) for s in seqs)
    # structure: children are keyed by their first token and never outnumber their parent
    stack = [tree.root]
    while stack:
        node = stack.pop()
        assert sum(c.count for c in node.children.values()) <= node.count
        for token, child in node.children.items():
            assert child.label[0] == token and child.parent is node and child.count > 0
            stack.append(child)


def python_nodes(tree: SuffixTree) -> int:
    """How many nodes the Python tree holds, its root included."""
    stack, n = [tree.root], 0
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n


def test_insert_counts_every_substring_up_to_depth():
    tree = SuffixTree(max_depth=3)
    tree.insert([1, 2, 3, 1, 2, 4])
    assert tree.count([1, 2]) == 2
    assert tree.count([1, 2, 3]) == 1 and tree.count([2, 4]) == 1
    assert tree.count([1, 2, 3, 1]) == 0  # longer than max_depth: not stored
    assert tree.count([4, 1]) == 0
    assert_counts_exact(tree, [[1, 2, 3, 1, 2, 4]])


def test_prefix_only_insert_and_growing_sequence():
    tree = SuffixTree(max_depth=4)
    tree.insert([5, 6, 7, 8, 9, 5], num_starts=2)  # suffixes starting at 0 and 1 only
    assert tree.count([5, 6, 7, 8]) == 1 and tree.count([6, 7, 8, 9]) == 1
    assert tree.count([9, 5]) == 0 and tree.root.count == 2
    cursor = Cursor()
    tree.extend(cursor, [1, 2])
    tree.extend(cursor, [1, 2, 1])  # incremental: same counts as one insert of 1 2 1 2 1
    assert tree.count([1, 2]) == 2 and tree.count([2, 1]) == 2 and tree.count([1, 2, 1]) == 2


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_keep_exact_counts(seed):
    """Inserts, removals and several growing sequences interleaved, checked against brute force
    (small alphabets force every split, merge and boundary-shift case)."""
    rng = random.Random(seed)
    tree = SuffixTree(max_depth=rng.randint(1, 6))
    vocab = rng.randint(1, 4)
    complete: list[list[int]] = []
    growing: list[tuple[Cursor, list[int]]] = []
    for _ in range(12):
        r = rng.random()
        if r < 0.35:
            complete.append([rng.randrange(vocab) for _ in range(rng.randint(0, 14))])
            tree.insert(complete[-1])
        elif r < 0.5 and complete:
            tree.remove(complete.pop(rng.randrange(len(complete))))
        else:
            if not growing or rng.random() < 0.3:
                growing.append((Cursor(), []))
            cursor, tokens = rng.choice(growing)
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            tree.extend(cursor, new)
            tokens.extend(new)
        assert_counts_exact(tree, complete + [t for _, t in growing])


def test_tree_stays_compact_and_removal_empties_it():
    rng = random.Random(0)
    tree = SuffixTree(max_depth=24)
    seqs = [[rng.randrange(1000) for _ in range(200)] for _ in range(5)]
    for s in seqs + seqs[:2]:  # repeats must not split paths into one node per token
        tree.insert(s)
    assert python_nodes(tree) <= 2 * sum(len(s) for s in seqs) + 1
    for s in seqs + seqs[:2]:
        tree.remove(s)
    assert tree.root.count == 0 and not tree.root.children


def test_longest_match():
    tree = SuffixTree(max_depth=4)
    tree.insert([1, 2, 3, 4, 5])
    assert tree.longest_match([9, 9, 2, 3]) == 2
    assert tree.longest_match([1, 2, 3, 4]) == 4
    assert tree.longest_match([7, 1, 2, 3, 4]) == 4  # only the last max_depth tokens count
    assert tree.longest_match([9]) == 0


def scan_every_tail(tree: SuffixTree, context: list[int], max_tokens: int, factor: float,
                    min_prob: float) -> tuple[list[int], float, int]:
    """The proposal by brute force: every tail of context matched from the root, longest
    first (what SuffixTree.speculate computed before its binary search and cursor lookups)."""
    pattern = context[-tree.max_depth :]
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    for m in range(len(pattern), 0, -1):
        limit = min(max_tokens, int(m * factor + 1e-6), tree.max_depth - m)
        hit = tree._match(pattern, len(pattern) - m)
        if hit is None or limit <= best[1]:
            continue
        tokens, score = _walk(hit[0], hit[1], limit, min_prob)
        if score > best[1]:
            best = (tokens, score, m)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_speculate_equals_a_scan_of_every_tail(seed):
    """The binary search for the longest matching tail (a cache tree, with removals) and the
    cursor's own tail nodes (a growing sequence, its prompt shared as a request's is) propose
    exactly what matching every tail from the root does. Small alphabets give long repeats,
    large max_spec_factor long walks."""
    rng = random.Random(seed)
    depth = rng.randint(2, 8)
    vocab = rng.randint(2, 5)
    factor, min_prob = rng.choice([0.5, 1.0, 4.0]), rng.choice([0.0, 0.1, 0.5])
    cache = SuffixTree(depth)
    complete = []
    for _ in range(rng.randint(1, 5)):
        complete.append([rng.randrange(vocab) for _ in range(rng.randint(1, 30))])
        cache.insert(complete[-1])
    if rng.random() < 0.5:
        cache.remove(complete.pop(0))
    own = SuffixTree(depth)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 3 * depth))]
    shared = max(0, len(prompt) - depth + 1)  # as SuffixProposer._register shares a prompt
    own.insert(prompt, num_starts=shared)
    cursor, context = Cursor(), list(prompt)
    own.extend(cursor, prompt[shared:])
    for _ in range(20):
        k = rng.randint(1, 2 * depth)
        for tree, kwargs in ((cache, {}), (own, {"cursor": cursor})):
            got = tree.speculate(context, k, factor, min_prob, **kwargs)
            assert (got.token_ids, got.score, got.match_len) == scan_every_tail(
                tree, context, k, factor, min_prob)
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        own.extend(cursor, new)
        context.extend(new)


def native_module():
    module = suffix_native.load()
    assert module is not None, "the C++ suffix tree did not build (see the log's warning)"
    return module


@pytest.mark.parametrize("seed", range(60))
def test_native_tree_equals_the_python_tree(seed):
    """The C++ tree (csrc/suffix_tree.cpp) and SuffixTree, driven by the same random inserts,
    removals and growing sequences: the same counts, nodes, longest matches and proposals
    after every operation, with and without cursors. Alphabets of 1-4 tokens force every
    split, merge, fold and boundary shift, and many equally frequent children, so the choice
    among those (the oldest child) is compared too."""
    rng = random.Random(seed)
    depth = rng.randint(1, 7)
    vocab = rng.randint(1, 4)
    ref, native = SuffixTree(depth), NativeSuffixTree(depth, native_module())
    complete: list[list[int]] = []
    growing: list[tuple[Cursor, object, list[int]]] = []
    for _ in range(16):
        r = rng.random()
        if r < 0.3:
            complete.append([rng.randrange(vocab) for _ in range(rng.randint(0, 16))])
            starts = None if rng.random() < 0.7 else rng.randint(0, len(complete[-1]))
            ref.insert(complete[-1], starts)
            native.insert(complete[-1], starts)
            if starts is not None:  # only for counting: those suffixes start in its head
                complete[-1] = None
        elif r < 0.45 and any(c is not None for c in complete):
            i = rng.choice([i for i, c in enumerate(complete) if c is not None])
            ref.remove(complete[i])
            native.remove(complete.pop(i))
        else:
            if not growing or rng.random() < 0.3:
                growing.append((ref.new_cursor(), native.new_cursor(), []))
            cursor, native_cursor, tokens = rng.choice(growing)
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            ref.extend(cursor, new)
            native.extend(native_cursor, new)
            tokens.extend(new)
        assert native.root_count == ref.root.count
        assert native.num_nodes() == python_nodes(ref)
        for n in range(1, depth + 2):
            for _ in range(6):
                probe = [rng.randrange(vocab + 1) for _ in range(n)]
                assert native.count(probe) == ref.count(probe), probe
        k, factor = rng.randint(1, 2 * depth), rng.choice([0.5, 1.0, 4.0])
        min_prob = rng.choice([0.0, 0.1, 0.5])
        for _ in range(4):
            context = [rng.randrange(vocab) for _ in range(rng.randint(0, 2 * depth))]
            assert native.longest_match(context) == ref.longest_match(context)
            got = native.speculate(context, k, factor, min_prob)
            assert got == ref.speculate(context, k, factor, min_prob), context
        for cursor, native_cursor, tokens in growing:
            got = native.speculate(tokens, k, factor, min_prob, native_cursor)
            assert got == ref.speculate(tokens, k, factor, min_prob, cursor)
    # a deep copy (the benchmark's repeats restore the proposer's state) is a separate tree
    # whose copied cursors still grow in it
    cursor, native_cursor, tokens = growing[0] if growing else (None, None, None)
    if cursor is not None:
        copy_tree, copy_cursor = copy.deepcopy((native, native_cursor))
        copy_tree.extend(copy_cursor, [0, 1])
        ref_copy, ref_cursor = copy.deepcopy((ref, cursor))
        ref_copy.extend(ref_cursor, [0, 1])
        assert copy_tree.speculate(tokens + [0, 1], 4, 1.0, 0.0, copy_cursor) == \
            ref_copy.speculate(tokens + [0, 1], 4, 1.0, 0.0, ref_cursor)
        assert native.root_count == ref.root.count == copy_tree.root_count - 2
    for tokens in complete:  # removal of everything inserted in full leaves only the growing
        if tokens is not None:
            ref.remove(tokens)
            native.remove(tokens)
    assert native.num_nodes() == python_nodes(ref)


def test_the_proposer_uses_the_native_tree_and_proposes_as_the_python_one():
    """SuffixProposer builds its trees with the C++ tree (new_tree) and proposes what the
    Python trees do on a whole run of requests, the cache of earlier outputs included."""
    assert isinstance(new_tree(4), NativeSuffixTree) and native_module() is not None
    assert isinstance(new_tree(4, native=False), SuffixTree)
    rng = random.Random(1)
    proposers = [SuffixProposer(8, 3, 1.0, 0.1, native=native) for native in (True, False)]
    assert isinstance(proposers[0].cache.tree, NativeSuffixTree)
    assert isinstance(proposers[1].cache.tree, SuffixTree)
    proposed = 0
    for r in range(6):
        prompt = [rng.randrange(5) for _ in range(rng.randint(1, 20))]
        seqs = [make_seq(10 * r + i, f"r{r}", prompt, []) for i in range(2)]
        for _ in range(30):
            ks = [rng.randint(0, 6) for _ in seqs]
            outs = [p.propose(seqs, ks) for p in proposers]
            assert outs[0].token_ids == outs[1].token_ids
            assert outs[0].match_lengths == outs[1].match_lengths
            proposed += sum(map(len, outs[0].token_ids))
            for seq in seqs:
                seq.token_ids.append(rng.randrange(5))
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED_LENGTH
            for p in proposers:
                p.free(seq)
    assert proposed > 100


def test_walk_follows_the_most_frequent_continuation():
    tree = SuffixTree(max_depth=8)
    for tail in ([7, 8], [7, 8], [7, 8], [5, 6]):
        tree.insert([1, 2, *tail])
    cand = tree.speculate([1, 2], max_tokens=8, max_spec_factor=4.0, min_token_prob=0.1)
    assert cand.token_ids == [7, 8] and cand.match_len == 2
    assert cand.score == pytest.approx(2 * 0.75)  # P(7 | 1 2) = 3/4, then 8 surely


def test_min_token_prob_stops_the_walk():
    tree = SuffixTree(max_depth=8)
    for tail in ([3, 4], [3, 4], [3, 6], [3, 6], [9]):
        tree.insert([1, 2, *tail])
    # P(3 | 1 2) = 0.8, then 4 or 6 with 0.5: the path falls to 0.4
    kwargs = {"max_tokens": 8, "max_spec_factor": 4.0}
    assert tree.speculate([1, 2], min_token_prob=0.3, **kwargs).token_ids == [3, 4]
    assert tree.speculate([1, 2], min_token_prob=0.5, **kwargs).token_ids == [3]
    assert tree.speculate([1, 2], min_token_prob=0.9, **kwargs).token_ids == []


def test_spec_factor_limits_by_match_length():
    tree = SuffixTree(max_depth=16)
    tree.insert(list(range(10)))
    for factor, expected in ((1.0, 2), (0.5, 1), (2.0, 4), (0.0, 0)):
        cand = tree.speculate([0, 1], max_tokens=8, max_spec_factor=factor, min_token_prob=0.1)
        assert cand.token_ids == list(range(2, 2 + expected))
    cand = tree.speculate([0, 1], max_tokens=3, max_spec_factor=10.0, min_token_prob=0.1)
    assert cand.token_ids == [2, 3, 4]  # and never past max_tokens


@pytest.mark.parametrize("native", [False, True])
def test_output_cache_evicts_oldest_requests(native):
    cache = OutputCache(max_depth=4, max_requests=2, native=native)
    cache.add("a", 0, [1, 2, 3])
    cache.add("a", 0, [1, 2, 3])  # a second free of the same sequence is ignored
    cache.add("b", 1, [4, 5])
    cache.add("b", 2, [4, 6])  # n > 1: both completions belong to request b
    assert cache.tree.count([1, 2]) == 1 and cache.tree.count([4]) == 2
    cache.add("c", 3, [7, 8])
    assert list(cache.entries) == ["b", "c"]
    assert cache.tree.count([1, 2]) == 0 and cache.tree.count([4]) == 2
    if native:
        assert cache.tree.count([4, 6]) == 1 and cache.tree.root_count == 6
    else:
        assert_counts_exact(cache.tree, [[4, 5], [4, 6], [7, 8]])


# ---------------------------------------------------------------------------------------------
# the proposer


def make_seq(seq_id: int, request_id: str, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(seq_id, request_id, 0, list(prompt), SamplingParams(), 0.0)
    seq.token_ids.extend(output)
    return seq


def test_proposer_uses_the_request_then_the_global_cache():
    proposer = SuffixProposer(max_tree_depth=8, max_cached_requests=4, max_spec_factor=2.0,
                              min_token_prob=0.1)
    seq = make_seq(0, "r0", [1, 2, 3, 4, 5, 1, 2], [])
    assert proposer.propose([seq], [4]).token_ids == [[3, 4, 5, 1]]
    seq.token_ids.extend([3, 4])  # committed tokens are picked up incrementally
    assert proposer.propose([seq], [3]).token_ids == [[5, 1, 2]]
    assert proposer.propose([seq], [0]).token_ids == [[]]
    seq.token_ids.extend([9, 8, 7, 6])
    seq.status = SequenceStatus.FINISHED_STOPPED
    proposer.free(seq)
    assert not proposer._seqs and not proposer._requests
    # a new request has never seen "9 8" itself; the finished output has
    other = make_seq(1, "r1", [0, 9, 8], [])
    assert proposer.propose([other], [4]).token_ids == [[7, 6]]


def test_proposer_keeps_state_through_preemption_and_shares_the_prompt():
    proposer = SuffixProposer(max_tree_depth=4, max_cached_requests=0, max_spec_factor=1.0,
                              min_token_prob=0.1)
    prompt = [1, 2, 3, 4, 5, 6]
    a, b = make_seq(0, "r", prompt, [1, 2]), make_seq(1, "r", prompt, [1, 2])
    proposer.propose([a, b], [2, 2])
    tree = proposer._requests["r"].tree
    # prompt suffixes with full depth are counted once, the ones running into outputs per seq
    assert tree.count([1, 2, 3, 4]) == 1 and tree.count([5, 6, 1, 2]) == 2
    a.reset_for_recompute()  # preemption: free() keeps the tree, tokens stay
    proposer.free(a)
    assert 0 in proposer._seqs
    for seq in (a, b):
        seq.status = SequenceStatus.FINISHED_ABORTED
        proposer.free(seq)
        proposer.free(seq)  # abort may free twice
    assert not proposer._seqs and not proposer._requests and proposer.cache is None


# ---------------------------------------------------------------------------------------------
# configuration


def test_config_defaults_and_v1_keys():
    spec = SpeculativeConfig.from_args(speculative_model="[suffix]")
    assert spec.method == "suffix" and spec.num_speculative_tokens == 24  # vLLM: k = depth
    assert (spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob) == (
        24, 10000, 1.0, 0.1)
    spec = SpeculativeConfig.from_args(speculative_config={
        "method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 12,
        "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.3})
    assert spec.num_speculative_tokens == 6 and spec.suffix_decoding_max_tree_depth == 12
    assert spec.suffix_decoding_max_cached_requests == 0
    assert spec.suffix_decoding_min_token_prob == 0.3


@pytest.mark.parametrize("kwargs, match", [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
])
def test_bad_suffix_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_args(speculative_model="[suffix]", num_speculative_tokens=4,
                                    **kwargs)


# ---------------------------------------------------------------------------------------------
# the engine


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _proposer(llm: LLM) -> SuffixProposer:
    proposer = llm.llm_engine.speculation.proposer
    assert isinstance(proposer, SuffixProposer)
    return proposer


def _mean_acceptance(out) -> float:
    m = out.metrics
    return m.num_accepted_tokens / max(m.num_spec_steps, 1)


def test_greedy_equals_plain_and_accepts(tiny_llama, test_prompts):
    params = _greedy(40)
    repetitive = [" ".join([p] * 3) for p in test_prompts[:6]]
    plain = _tokens(tiny_llm(tiny_llama).generate(repetitive, params, use_tqdm=False))
    llm = tiny_llm(tiny_llama, speculative_model="[suffix]", num_speculative_tokens=8,
                   speculative_adaptive=False)  # tests the proposer, not the policy
    assert _tokens(llm.generate(repetitive, params, use_tqdm=False)) == plain
    assert _tokens(llm.generate(repetitive, params, use_tqdm=False)) == plain  # cache warm
    spec = llm.get_metrics()["spec_decode"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] > 0
    proposer = _proposer(llm)
    assert not proposer._seqs and not proposer._requests  # finished requests leave no state
    assert len(proposer.cache.entries) == 2 * len(repetitive)


def test_second_identical_request_benefits_from_the_cache(tiny_llama, test_prompts):
    llm = tiny_llm(tiny_llama, speculative_model="[suffix]", num_speculative_tokens=8,
                   speculative_adaptive=False)  # tests the proposer, not the policy
    first = llm.generate(test_prompts[6], _greedy(40), use_tqdm=False)[0]
    second = llm.generate(test_prompts[6], _greedy(40), use_tqdm=False)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.metrics.num_accepted_tokens > 0
    assert _mean_acceptance(second) > _mean_acceptance(first)


def test_no_global_cache_when_disabled(tiny_llama, test_prompts):
    llm = tiny_llm(tiny_llama, speculative_config={
        "method": "suffix", "num_speculative_tokens": 4,
        "suffix_decoding_max_cached_requests": 0})
    llm.generate(test_prompts[6], _greedy(16), use_tqdm=False)
    assert _proposer(llm).cache is None


def test_sampled_requests_and_n_completions(tiny_llama, test_prompts):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    runs = []
    for _ in range(2):  # fresh engines: same proposals, so the same seeded draws
        llm = tiny_llm(tiny_llama, speculative_model="[suffix]", num_speculative_tokens=5)
        runs.append(llm.generate(test_prompts[9], params, use_tqdm=False)[0].outputs[0])
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 24
    many = SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([test_prompts[3]] * 2, many, use_tqdm=False)
    assert all(len(c.token_ids) == 20 for o in outs for c in o.outputs)
    assert not _proposer(llm)._seqs


def test_preemption_under_suffix_speculation(tiny_llama, test_prompts):
    params = _greedy(37)
    plain = _tokens(tiny_llm(tiny_llama).generate(test_prompts, params, use_tqdm=False))
    llm = tiny_llm(tiny_llama, speculative_model="[suffix]", num_speculative_tokens=4,
                   num_gpu_blocks_override=24, max_model_len=256)
    for _ in range(2):
        assert _tokens(llm.generate(test_prompts, params, use_tqdm=False)) == plain
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert not _proposer(llm)._seqs and not _proposer(llm)._requests


def test_llm_keywords_reach_the_proposer(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", speculative_model="[suffix]",
              num_speculative_tokens=3, suffix_decoding_max_tree_depth=10,
              suffix_decoding_min_token_prob=0.25)
    proposer = _proposer(llm)
    assert (proposer.max_depth, proposer.min_token_prob) == (10, 0.25)
