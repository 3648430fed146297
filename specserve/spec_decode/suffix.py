"""Suffix decoding ("[suffix]"; SuffixDecoding, Oliaro et al. 2024): propose what most often
followed the context's tail, in this request and in earlier requests' outputs.

Two frequency-counting suffix trees feed the proposals:

* a per-request tree over the request's prompt and every completion generated so far, extended
  as tokens are committed (n > 1 completions of one request share it);
* a global tree over the outputs of finished requests, bounded to the most recent
  ``max_cached_requests`` requests (older ones are removed again, count by count).

Each tree holds every substring of length <= ``max_tree_depth`` of its sequences, path
compressed: an edge carries a run of tokens, and a node's count is the number of suffixes that
pass through its whole edge, so ``child.count / node.count`` is the empirical probability that
``child`` follows. Every suffix ends exactly at a node boundary, which keeps those counts exact;
chains of equal counts are folded, so a tree stays O(tokens) in size, and one new token costs
O(max_tree_depth) steps (one per suffix still growing).

To propose for a sequence, every tail of its last ``max_tree_depth`` tokens that occurs in a tree
is a candidate starting point (as in Arctic Inference): from each, walk down to the most frequent
child while the product of the step probabilities stays >= ``min_token_prob``, proposing at most
``floor(max_spec_factor * match_length)`` tokens (short matches are weak evidence). The walk
with the highest score (sum of the path probabilities: the expected number of accepted tokens
under the counts) wins, the per-request tree on ties. Proposals are point masses (q(x) = 1),
so sampled requests stay exact.

The proposer's trees are the C++ twin of SuffixTree (csrc/suffix_tree.cpp, through
NativeSuffixTree) wherever it builds: the same algorithm, proposing the same tokens, without
an interpreted call per tree step. SuffixTree here is the reference and the fallback.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from operator import attrgetter

from specserve.engine.sequence import Sequence
from specserve.spec_decode import suffix_native
from specserve.spec_decode.proposer import DraftProposals, Proposer

_EPS = 1e-6  # floor(m * factor) must not lose a whole token to float rounding (3 * 0.1 * 10)
_by_count = attrgetter("count")


class _Node:
    """An edge (a run of tokens) and the node it leads to."""

    __slots__ = ("label", "count", "children", "parent")

    def __init__(self, label: list[int], count: int, parent: _Node | None) -> None:
        self.label = label  # tokens of the edge into this node; owned by this node only
        self.count = count  # suffixes that pass through the whole edge
        self.children: dict[int, _Node] = {}  # first token of the child's edge -> child
        self.parent = parent


@dataclass
class SuffixCandidate:
    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0  # sum of the path probabilities of the proposed tokens
    match_len: int = 0  # how many context tokens the proposal's starting point matched


class Cursor:
    """The growing end of one sequence in a tree: the nodes where its last suffixes end."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active: list[_Node] = []  # oldest (longest) suffix first


class SuffixTree:
    """Counts of every substring of length <= max_depth of the sequences added to it."""

    def __init__(self, max_depth: int) -> None:
        assert max_depth >= 1
        self.max_depth = max_depth
        self.root = _Node([], 0, None)  # root.count: number of suffixes (= tokens) added

    def new_cursor(self) -> Cursor:
        return Cursor()

    # ---- building --------------------------------------------------------------------------
    def extend(self, cursor: Cursor, tokens: list[int]) -> None:
        """Append tokens to a growing sequence (O(max_depth) per token)."""
        root, step = self.root, self._step
        for token in tokens:
            active = cursor.active
            active.append(root)  # the suffix starting at this token
            root.count += 1
            if len(active) > self.max_depth:
                del active[0]  # that suffix reached max_depth and stays as it is
            cursor.active = [step(node, token) for node in active]

    def insert(self, tokens: list[int], num_starts: int | None = None) -> None:
        """Add a complete sequence: its suffixes starting at 0..num_starts-1 (default all)."""
        starts = len(tokens) if num_starts is None else num_starts
        for start in range(starts):
            node = self.root
            node.count += 1
            for token in tokens[start : start + self.max_depth]:
                node = self._step(node, token)

    def remove(self, tokens: list[int]) -> None:
        """Undo ``insert(tokens)``. Growing cursors stay valid: a node is only deleted when no
        suffix passes through it, and only folded when no suffix ends at it."""
        for start in range(len(tokens)):
            end = min(start + self.max_depth, len(tokens))
            self.root.count -= 1
            node, i = self.root, start
            while i < end:
                child = node.children[tokens[i]]
                child.count -= 1
                if child.count == 0:  # only this suffix used the rest of the path
                    del node.children[tokens[i]]
                    break
                i += len(child.label)
                node = child
            else:
                assert i == end, "a suffix must end at a node boundary"
            self._fold(node)

    def _step(self, node: _Node, token: int) -> _Node:
        """Extend a suffix that ends at ``node``'s boundary by ``token``; return its new end.

        ``node.count`` already counts this suffix; the cases keep every suffix ending at a
        boundary and fold a node whose count would equal its only child's."""
        child = node.children.get(token)
        is_root = node is self.root
        if child is None:
            if not is_root and node.count == 1:  # a leaf only this suffix uses: grow its edge
                node.label.append(token)
                return node
            leaf = _Node([token], 1, node)
            node.children[token] = leaf
            return leaf
        if not is_root and node.count == child.count + 1:
            # This suffix is the only one ending at node; all others continue into child.
            if len(child.label) == 1:  # node and child would carry the same count: merge
                child.label = node.label + child.label
                child.count += 1
                child.parent = node.parent
                node.parent.children[child.label[0]] = child
                return child
            node.label.append(token)  # move the boundary one token into child's edge
            child.label = child.label[1:]
            del node.children[token]
            node.children[child.label[0]] = child
            return node
        if len(child.label) == 1:
            child.count += 1
            return child
        mid = _Node([token], child.count + 1, node)  # split child's edge after one token
        child.label = child.label[1:]
        child.parent = mid
        mid.children[child.label[0]] = child
        node.children[token] = mid
        return mid

    def _fold(self, node: _Node) -> None:
        """Merge node into its only child when no suffix ends at node any more."""
        if node is self.root or len(node.children) != 1:
            return
        child = next(iter(node.children.values()))
        if child.count == node.count:
            child.label = node.label + child.label
            child.parent = node.parent
            node.parent.children[child.label[0]] = child

    # ---- queries ---------------------------------------------------------------------------
    def _match(self, pattern: list[int], start: int) -> tuple[_Node, int] | None:
        """(node, tokens of its edge consumed) where pattern[start:] ends, or None if absent."""
        node, offset = self.root, 0
        for i in range(start, len(pattern)):
            token = pattern[i]
            if offset == len(node.label):
                node = node.children.get(token)
                if node is None:
                    return None
                offset = 1
            elif node.label[offset] == token:
                offset += 1
            else:
                return None
        return node, offset

    def count(self, tokens: list[int]) -> int:
        """How many times ``tokens`` (1..max_depth long) occurs in the added sequences."""
        hit = self._match(tokens, 0) if 0 < len(tokens) <= self.max_depth else None
        return 0 if hit is None else hit[0].count

    def longest_match(self, context: list[int]) -> int:
        """Length of the longest tail of context (<= max_depth) that occurs in the tree.

        A binary search: the tree holds every substring of length <= max_depth of its
        sequences, so when a tail occurs so does every shorter one (its suffixes). A scan from
        the longest tail down matched ~23 tails per lookup on chat text that occurs nowhere
        (each walk from the root), ~4 % of a batch-32 run's time on the 2-core CPU."""
        pattern = context[-self.max_depth :]
        lo, hi = 0, len(pattern)  # the tail of length lo occurs; hi is an upper bound
        while lo < hi:
            m = (lo + hi + 1) // 2
            if self._match(pattern, len(pattern) - m) is None:
                hi = m - 1
            else:
                lo = m
        return lo

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float, cursor: Cursor | None = None) -> SuffixCandidate:
        """The best-scoring frequency walk over all matching tails of context.

        cursor: the context's own cursor in this tree (the tree holds the context itself, as
        a request's tree holds its sequence): its nodes are where the context's tails end, so
        no tail is matched from the root. Else the tails that occur are found with
        longest_match and matched one by one."""
        pattern = context[-self.max_depth :]
        best = SuffixCandidate()
        if cursor is not None:
            ends = cursor.active  # [i]: where the tail of length len(ends) - i ends
            longest = min(len(ends), len(pattern))
        else:
            longest = self.longest_match(pattern)
        for m in range(longest, 0, -1):  # longest match first: it wins ties
            # A walk from depth m yields at most this many tokens, each adding <= 1 to the score.
            limit = min(max_tokens, int(m * max_spec_factor + _EPS), self.max_depth - m)
            if limit <= best.score:
                continue
            if cursor is not None:
                node = ends[len(ends) - m]
                hit = (node, len(node.label))  # a suffix ends at its node's boundary
            else:
                hit = self._match(pattern, len(pattern) - m)
            tokens, score = _walk(hit[0], hit[1], limit, min_token_prob)
            if score > best.score:
                best = SuffixCandidate(tokens, score, m)
        return best


def _walk(node: _Node, offset: int, max_tokens: int, min_token_prob: float
          ) -> tuple[list[int], float]:
    """Follow the most frequent continuation while its probability stays >= min_token_prob."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while True:
        take = min(len(node.label) - offset, max_tokens - len(tokens))
        if take > 0:  # inside an edge every suffix continues the same way
            tokens.extend(node.label[offset : offset + take])
            score += prob * take
        if len(tokens) >= max_tokens or not node.children:
            return tokens, score
        child = max(node.children.values(), key=_by_count)  # ties: the earliest seen
        prob *= child.count / node.count
        if prob < min_token_prob:
            return tokens, score
        node, offset = child, 0


class NativeSuffixTree:
    """SuffixTree's interface over the C++ tree (csrc/suffix_tree.cpp; suffix_native.py says
    why): the same counts and the same proposals."""

    def __init__(self, max_depth: int, module) -> None:
        self._tree = module.SuffixTree(max_depth)  # (deep copies copy it: benchmarks do)
        self._cursor_type = module.Cursor  # (a class: deep copies share it)
        self.max_depth = max_depth

    def new_cursor(self):
        return self._cursor_type()

    def extend(self, cursor, tokens: list[int]) -> None:
        self._tree.extend(cursor, tokens)

    def insert(self, tokens: list[int], num_starts: int | None = None) -> None:
        self._tree.insert(tokens, -1 if num_starts is None else num_starts)

    def remove(self, tokens: list[int]) -> None:
        self._tree.remove(tokens)

    def count(self, tokens: list[int]) -> int:
        return self._tree.count(tokens)

    def longest_match(self, context: list[int]) -> int:
        return self._tree.longest_match(context)

    def num_nodes(self) -> int:
        return self._tree.num_nodes()

    @property
    def root_count(self) -> int:
        return self._tree.root_count

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float, cursor=None) -> SuffixCandidate:
        tokens, score, match_len = self._tree.speculate(context, max_tokens, max_spec_factor,
                                                        min_token_prob, cursor)
        return SuffixCandidate(tokens, score, match_len)


def new_tree(max_depth: int, native: bool = True) -> SuffixTree | NativeSuffixTree:
    """The C++ tree where it builds (and native), else the Python one."""
    module = suffix_native.load() if native else None
    return SuffixTree(max_depth) if module is None else NativeSuffixTree(max_depth, module)


class OutputCache:
    """The global tree over finished outputs, holding at most max_requests requests."""

    def __init__(self, max_depth: int, max_requests: int, native: bool = True) -> None:
        assert max_requests >= 1
        self.tree = new_tree(max_depth, native)
        self.max_requests = max_requests
        # request_id -> {seq_id: output tokens}, oldest request first
        self.entries: OrderedDict[str, dict[int, list[int]]] = OrderedDict()

    def add(self, request_id: str, seq_id: int, tokens: list[int]) -> None:
        """Cache one finished output; idempotent per seq_id (abort may free a sequence twice)."""
        entry = self.entries.get(request_id)
        if not tokens or (entry is not None and seq_id in entry):
            return
        if entry is None:
            entry = self.entries[request_id] = {}
        entry[seq_id] = list(tokens)
        self.tree.insert(entry[seq_id])
        while len(self.entries) > self.max_requests:
            _, evicted = self.entries.popitem(last=False)
            for old in evicted.values():
                self.tree.remove(old)


@dataclass
class _RequestTree:
    tree: SuffixTree | NativeSuffixTree
    seq_ids: set[int] = field(default_factory=set)  # registered sequences not yet finished


@dataclass
class _SeqState:
    request: _RequestTree
    cursor: object  # its tree's cursor (Cursor, or the C++ tree's)
    num_added: int  # tokens of seq.token_ids already appended through the cursor


class SuffixProposer(Proposer):
    has_probs = False

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float, native: bool = True) -> None:
        self.max_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.native = native  # the C++ trees where they build (new_tree)
        self.cache = (OutputCache(max_tree_depth, max_cached_requests, native)
                      if max_cached_requests > 0 else None)
        self._requests: dict[str, _RequestTree] = {}
        self._seqs: dict[int, _SeqState] = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int],
                on_device: bool = False) -> DraftProposals:
        out, lengths = [], []
        for seq, k in zip(seqs, max_tokens, strict=True):
            state = self._catch_up(seq)
            if k <= 0:
                out.append([])
                lengths.append(0)
                continue
            context = seq.token_ids[-self.max_depth :]
            best = state.request.tree.speculate(context, k, self.max_spec_factor,
                                                self.min_token_prob, state.cursor)
            if self.cache is not None:
                other = self.cache.tree.speculate(context, k, self.max_spec_factor,
                                                  self.min_token_prob)
                if other.score > best.score:
                    best = other
            out.append(best.token_ids)
            lengths.append(best.match_len if best.token_ids else 0)
        return DraftProposals(out, None, match_lengths=lengths)

    def free(self, seq: Sequence) -> None:
        # Preemption keeps a sequence's tokens, so its tree stays valid: keep it and save the
        # rebuild. A finished (or aborted) sequence leaves its output to the global cache.
        if not seq.is_finished:
            return
        state = self._seqs.pop(seq.seq_id, None)
        if state is not None:
            state.request.seq_ids.discard(seq.seq_id)
            if not state.request.seq_ids and self._requests.get(seq.request_id) is state.request:
                del self._requests[seq.request_id]
        if self.cache is not None:
            self.cache.add(seq.request_id, seq.seq_id, seq.output_token_ids)

    def _catch_up(self, seq: Sequence) -> _SeqState:
        """The sequence's state with every committed token added (lazily, O(depth) each)."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            state = self._seqs[seq.seq_id] = self._register(seq)
        if state.num_added < seq.num_tokens:
            state.request.tree.extend(state.cursor, seq.token_ids[state.num_added :])
            state.num_added = seq.num_tokens
        return state

    def _register(self, seq: Sequence) -> _SeqState:
        """The prompt's suffixes that end inside the prompt at full depth are shared by all n
        completions and added once per request; each sequence adds the suffixes that start
        in the prompt's last max_depth - 1 tokens, which run on into its own output."""
        shared = max(0, seq.num_prompt_tokens - self.max_depth + 1)
        request = self._requests.get(seq.request_id)
        if request is None:
            request = self._requests[seq.request_id] = _RequestTree(
                new_tree(self.max_depth, self.native))
            request.tree.insert(seq.prompt_token_ids, num_starts=shared)
        request.seq_ids.add(seq.seq_id)
        return _SeqState(request, request.tree.new_cursor(), shared)
