"""Paged KV block allocation with reference counts, rollback and automatic prefix caching.

A block is identified by a chained hash of all tokens up to its end, registered only once its
K/V are computed, so a request can reuse a block only when another request has really filled it.
Freed blocks keep their hash and stay reusable until the allocator hands them out again (least
recently freed last), which is what makes repeated system prompts cheap.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from specserve.engine.sequence import Sequence

NO_HASH = -1


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    free_ids: OrderedDict[int, None] = field(init=False)  # LRU order: oldest first
    hash_to_block: dict[int, int] = field(init=False)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_ids = OrderedDict((i, None) for i in range(self.num_blocks))
        self.hash_to_block = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- allocation ------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = NO_HASH, (), 1
        return block_id

    def _cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """Blocks already holding this sequence's leading tokens (never the last token's block:
        at least one token must be computed to produce logits)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits, parent = [], NO_HASH
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def allocate_prefix(self, seq: Sequence) -> None:
        """Start a waiting sequence: attach cached prefix blocks (counted as computed)."""
        assert not seq.block_table
        hits = self._cached_prefix_blocks(seq)
        self.stats.queried_blocks += (seq.num_tokens - 1) // self.block_size
        self.stats.hit_blocks += len(hits)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
        seq.block_table = hits
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_prefix_tokens = len(hits) * self.block_size

    def can_admit(self, seq: Sequence, num_total_tokens: int) -> bool:
        """Whether a waiting sequence fits: cached prefix blocks that sit in the free pool are
        taken out of it on admission, so they count against the free blocks too."""
        hits = self._cached_prefix_blocks(seq)
        idle_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(num_total_tokens) - len(hits)
        return needed <= self.num_free_blocks - idle_hits

    def can_grow(self, seq: Sequence, num_total_tokens: int) -> bool:
        return self.blocks_needed(num_total_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_total_tokens: int) -> None:
        """Make the block table cover slots [0, num_total_tokens)."""
        needed = self.blocks_needed(num_total_tokens) - len(seq.block_table)
        assert needed <= self.num_free_blocks, "caller must check can_grow first"
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Drop slots past num_tokens (e.g. rejected speculative tokens): free whole blocks."""
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free_ids[block_id] = None

    # ---- prefix registration -----------------------------------------------------------------
    def register_computed_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose K/V are now fully computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            parent = self.blocks[seq.block_table[i - 1]].hash if i else NO_HASH
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH:
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.hash, block.token_ids = chain_hash(parent, tokens), tokens
                self.hash_to_block.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)
