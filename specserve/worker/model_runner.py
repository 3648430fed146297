"""Loads a model, owns its KV cache, turns scheduled sequences into one forward pass.

The runner knows nothing about sampling or requests: it gets, per sequence, the token run to
compute and which offsets of that run need logits, and returns those logits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specserve.model.base import CausalLM
from specserve.model.layers.attention import AttentionMetadata, get_attention_backend
from specserve.worker.cuda_graphs import CudaGraphRunner
from specserve.worker.kv_cache import allocate_kv_cache, bytes_per_block
from specserve.worker.transfer import index_tensor

logger = logging.getLogger(__name__)

# warm_up_kernels: query runs whose q x group rows round to every power-of-two tile (for any
# group size 1..8), over a context that is not split, one split in <= 16 and one in > 16 parts
WARM_UP_QUERY_LENS = (1, 2, 3, 5, 9, 17, 33, 65, 129)
WARM_UP_CONTEXTS = (16, 300, 2100)


@dataclass
class SequenceRun:
    """One sequence's share of a forward pass."""

    token_ids: list[int]  # the tokens to compute, starting at absolute position `start`
    start: int
    block_table: list[int]
    logit_offsets: list[int]  # offsets into token_ids whose next-token logits are wanted


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype,
                 block_size: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend = get_attention_backend(device)
        self.num_blocks = 0
        self.graphs: CudaGraphRunner | None = None  # set by enable_cuda_graphs

    # ---- KV cache --------------------------------------------------------------------------
    def init_kv_cache(self, num_blocks: int) -> int:
        """Allocate num_blocks blocks (the engine sizes target and draft caches together)."""
        geom = self.model.kv_geometry()
        per_block = bytes_per_block(geom, self.block_size, self.dtype)
        if num_blocks < 1:
            raise ValueError("no memory is left for the KV cache; lower the model size, raise "
                             "gpu_memory_utilization or kv_cache_memory_bytes.")
        t0 = time.perf_counter()
        self._bind(allocate_kv_cache(geom, num_blocks, self.block_size, self.dtype,
                                     self.device))
        self.num_blocks = num_blocks
        self.graphs = None  # captured against the old cache and backend
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB) in %.2fs", num_blocks,
                    self.block_size, num_blocks * per_block / 2**20, time.perf_counter() - t0)
        return num_blocks

    # ---- memory profiling ----------------------------------------------------------------
    @torch.inference_mode()
    def profile_peak_memory(self, max_num_tokens: int, max_num_seqs: int, tokens_per_seq: int,
                            max_seq_len: int) -> int:
        """Peak bytes the largest steps allocate beyond weights and cache (0 off CUDA).

        Why: the KV cache is sized from what is free, and every step allocates activations
        and logits on top of it; unless the largest step is reserved, the first full batch
        runs out of memory. Runs, against a small temporary cache freed afterwards, (a) a
        prefill of max_num_tokens tokens (chunks of at most max_seq_len) and (b) a verify step
        of max_num_seqs x tokens_per_seq tokens with logits (and the sampler's softmax) for
        every row. Call before init_kv_cache; the runner is left without a cache."""
        assert self.num_blocks == 0 and self.graphs is None, "profile before init_kv_cache"
        bs = self.block_size
        # a draft may have a shorter context than the target: its rotary table ends there
        limit = getattr(self.model.config, "max_position_embeddings", None)
        max_seq_len = min(max_seq_len, limit) if limit else max_seq_len
        chunks = [min(max_seq_len, max_num_tokens - s) for s in range(0, max_num_tokens,
                                                                       max_seq_len)]
        prefill = _dummy_runs(chunks, bs, all_logits=False)
        verify = _dummy_runs([tokens_per_seq] * max_num_seqs, bs, all_logits=True)
        num_blocks = max(_blocks_needed(prefill), _blocks_needed(verify))
        cuda = self.device.type == "cuda"
        self._bind(allocate_kv_cache(self.model.kv_geometry(), num_blocks, bs, self.dtype,
                                     self.device))
        if cuda:
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        for runs in (prefill, verify):
            logits = self.execute(runs)  # [R, vocab] float32
            torch.softmax(logits, dim=-1)  # the verifier's probabilities: one more [R, vocab]
            del logits
        peak = 0
        if cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self._bind([(empty, empty)] * len(list(self.model.attention_layers())))
        return peak

    @torch.inference_mode()
    def warm_up_kernels(self, max_seq_len: int) -> float:
        """Compile now the attention kernel variants that eager steps can meet; returns the
        seconds it took (0 off CUDA).

        Why: the Triton attention kernel is specialized on its tile (query run length x
        group heads, rounded to a power of two) and on whether the context is split; each
        variant compiles the first time a step needs it, 0.3-0.9 s on an H200. CUDA graphs
        cover decode and verify steps, but eager steps (a draft catching up after steps it
        sat out, prefill chunks) meet new variants at unpredictable times: a stall in the
        middle of serving, and one the adaptive policy would mistake for the cost of
        speculating. Runs one-sequence steps of every tile size over a short, a split and a
        long split context. Call after init_kv_cache, before any request: the dummy runs
        write K/V into blocks that no sequence owns yet."""
        if self.device.type != "cuda" or self.num_blocks == 0:
            return 0.0
        t0 = time.perf_counter()
        bs = self.block_size
        for q in WARM_UP_QUERY_LENS:
            for context in WARM_UP_CONTEXTS:
                blocks = -(-(context + q) // bs)
                if context + q > max_seq_len or blocks > self.num_blocks:
                    continue
                self.execute([SequenceRun([0] * q, context, list(range(blocks)), [q - 1])])
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        logger.info("attention kernels warmed up in %.2fs", seconds)
        return seconds

    def _bind(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # A fresh backend per cache: backends may keep state about the cache across steps.
        self.backend = get_attention_backend(self.device)
        for layer, (k, v) in zip(self.model.attention_layers(), caches, strict=True):
            layer.bind(k, v, self.backend)

    # ---- CUDA graphs -------------------------------------------------------------------------
    def enable_cuda_graphs(self, max_batch: int, max_query_len: int, max_model_len: int,
                           capture: bool | None = None) -> bool:
        """Serve batches of up to max_batch sequences x max_query_len tokens from padded
        static buffers, captured as CUDA graphs (lazily, per bucket). A no-op returning False
        unless the device is CUDA (or capture=False, the eager padded path tests use) and the
        attention backend can run inside a graph. Call after init_kv_cache."""
        assert self.num_blocks > 0, "allocate the KV cache before enabling CUDA graphs"
        if capture is None and self.device.type != "cuda":
            return False
        if not self.backend.supports_cuda_graphs:
            logger.info("attention backend %s cannot run in CUDA graphs: running eagerly",
                        self.backend.name)
            return False
        self.graphs = CudaGraphRunner(self.model, self.backend, self.device, self.block_size,
                                      max_batch, max_query_len, max_model_len, capture)
        logger.info("CUDA graphs on: batch ladder %s x 1..%d query tokens", self.graphs.ladder,
                    max_query_len)
        return True

    # ---- one forward -------------------------------------------------------------------------
    def _prepare(self, runs: list[SequenceRun]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        for run in runs:
            n = len(run.token_ids)
            base = len(input_ids)
            input_ids.extend(run.token_ids)
            pos = range(run.start, run.start + n)
            positions.extend(pos)
            table = run.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_lens.append(n)
            seq_lens.append(run.start + n)
            logit_rows.extend(base + o for o in run.logit_offsets)
        max_blocks = max(len(r.block_table) for r in runs)
        tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in runs]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        dev = self.device

        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(starts, torch.int32),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
            block_tables_host=[r.block_table for r in runs],
        )
        # Plain decoding wants every row in order: skip the [T, hidden] gather then.
        every_row = logit_rows == list(range(len(input_ids)))
        return (tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta,
                None if every_row else tensor(logit_rows, torch.int64))

    @torch.inference_mode()
    def execute(self, runs: list[SequenceRun]) -> torch.Tensor:
        """Run the model over all runs; return float32 logits [num_logit_rows, vocab] in the
        order of runs and their logit_offsets."""
        key = self.graphs.key_for(runs) if self.graphs is not None else None
        if key is None:
            hidden, logit_rows = self._eager_hidden(runs)
        else:
            hidden = self.graphs.run(key, runs)  # [T, hidden], a view of the graph's output
            logit_rows = self._logit_rows(runs)
        if logit_rows is not None:
            hidden = hidden[logit_rows]  # [R, hidden]
        return self.model.compute_logits(hidden).float()  # [R, vocab]

    @torch.inference_mode()
    def execute_argmax(self, runs: list[SequenceRun]) -> list[int]:
        """The argmax token of each logit row (execute's rows, in its order), on the host:
        what greedy rows sample when no transform touches their logits. A graph step computes
        logits and argmax inside the graph, so only the token ids come back (the step's one
        device->host read)."""
        return self.execute_argmax_device(runs).tolist()

    @torch.inference_mode()
    def execute_argmax_device(self, runs: list[SequenceRun],
                              fed: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> torch.Tensor:
        """execute_argmax without the read: the tokens [R] stay on the device (int64).

        fed = (rows, tokens): the packed input tokens at these rows (of the runs' tokens, in
        order) are replaced on the device before the forward; the runs hold placeholders
        there. Why: a draft model's proposals are verified without first reading them back,
        so a speculative step needs one device->host read, not three."""
        key = self.graphs.key_for(runs) if self.graphs is not None else None
        if key is None:
            hidden, logit_rows = self._eager_hidden(runs, fed)
            if logit_rows is not None:
                hidden = hidden[logit_rows]  # [R, hidden]
            return self.model.greedy_tokens(hidden)  # [R]
        tokens = self.graphs.run(key, runs, argmax=True, fed=fed)  # [T] real tokens
        rows = self._logit_rows(runs)
        return tokens if rows is None else tokens[rows]  # [R]

    @torch.inference_mode()
    def execute_argmax_steps(self, runs: list[SequenceRun], num_steps: int) -> list[list[int]]:
        """num_steps greedy decode forwards in a row: each run is one token (logits for it),
        and every later step feeds each sequence the argmax token of its previous step.
        Returns each run's num_steps tokens. The caller has reserved KV slots for positions
        start .. start + num_steps - 1 in every run's block table.

        Why: at batch 1 a decode step's host work (scheduling, input building, output
        processing) leaves the GPU idle ~10 % of the time. Here the host enqueues all steps
        and reads the tokens back once; on graphs the token feedback stays on the device."""
        return self.execute_argmax_steps_device(runs, num_steps).T.tolist()

    @torch.inference_mode()
    def execute_argmax_steps_device(self, runs: list[SequenceRun], num_steps: int,
                                    first: torch.Tensor | None = None) -> torch.Tensor:
        """execute_argmax_steps without the read: tokens [num_steps, len(runs)] on the device.
        first: the first step's input tokens [len(runs)] on the device (the runs' own tokens
        are placeholders then), e.g. a draft's first proposal, never read back."""
        assert num_steps >= 1 and all(len(r.token_ids) == 1 == len(r.logit_offsets)
                                      for r in runs)
        key = self.graphs.key_for(runs) if self.graphs is not None else None
        if key is not None:
            return self.graphs.run_argmax_steps(key, runs, num_steps, first=first)
        rows = torch.arange(len(runs), device=self.device)
        steps: list[torch.Tensor] = []
        fed = None if first is None else (rows, first)
        for j in range(num_steps):  # off graphs: one forward per step, fed on the device
            current = [SequenceRun([0 if fed is not None else r.token_ids[0]], r.start + j,
                                   r.block_table, [0]) for r in runs]
            steps.append(self.execute_argmax_device(current, fed))  # [len(runs)]
            fed = (rows, steps[-1])
        return torch.stack(steps)  # [num_steps, len(runs)]

    def _eager_hidden(self, runs: list[SequenceRun],
                      fed: tuple[torch.Tensor, torch.Tensor] | None = None):
        input_ids, positions, meta, logit_rows = self._prepare(runs)
        if fed is not None:
            input_ids[fed[0]] = fed[1]  # tokens given on the device (execute_argmax_device)
        self.backend.prepare(meta)
        return self.model(input_ids, positions, meta), logit_rows  # [T, hidden]

    def _logit_rows(self, runs: list[SequenceRun]) -> torch.Tensor | None:
        """Rows of the packed tokens whose logits are wanted; None when it is every row."""
        rows: list[int] = []
        base = 0
        for run in runs:
            rows.extend(base + o for o in run.logit_offsets)
            base += len(run.token_ids)
        if rows == list(range(base)):
            return None
        return index_tensor(rows, self.device)


def _dummy_runs(query_lens: list[int], block_size: int, all_logits: bool) -> list[SequenceRun]:
    """Fresh sequences (position 0) of the given lengths on consecutive blocks; logits for
    every token, or for each sequence's last."""
    runs, block = [], 0
    for n in query_lens:
        nb = -(-n // block_size)
        offsets = list(range(n)) if all_logits else [n - 1]
        runs.append(SequenceRun([0] * n, 0, list(range(block, block + nb)), offsets))
        block += nb
    return runs


def _blocks_needed(runs: list[SequenceRun]) -> int:
    return sum(len(r.block_table) for r in runs)


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] without a host sync (a Python-list index is a blocking copy on CUDA);
    no copy at all when rows are every row in order (plain decoding)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[index_tensor(rows, logits.device)]
