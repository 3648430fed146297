"""CUDA graphs for decode and verify steps: one captured target forward per (batch, query) bucket.

Why: a decode step of an 8B model is ~2000 small kernel launches; launched one by one from
Python the GPU idles between them (issue 2 measured 62 ms of host time for 7 ms of kernels).
A captured graph replays the whole forward with one launch.

How it stays exact and host-independent:

* A bucket is ``(batch_size, query_len)``: up to ``batch_size`` sequences of at most
  ``query_len`` tokens each (1 for decode, ``k + 1`` to verify ``k`` proposals). Batch sizes
  come from a ladder (1, 2, 4, ..., max); a batch is padded up to the next rung.
* Inputs live in one static device buffer (int64: token ids, positions, KV slots; then int32:
  context lengths, query start offsets, block tables), written on the host into a pinned twin
  and sent with ONE host->device copy per step. Real tokens are packed first, then padding:
  padded tokens have slot ``PAD_SLOT``
  (the KV write skips them) and belong to no sequence; padded sequences have query length 0 and
  context length 0, so the attention kernels skip them. Every op outside attention is row-wise,
  so whatever padded rows compute never reaches a real row.
* The attention backend must read nothing on the host inside ``forward`` and must fix its
  launch shape from the bucket alone (``AttentionBackend.supports_cuda_graphs``): the bucket's
  metadata claims ``max_seq_len = max_model_len``, so the Triton backend picks its flash-decoding
  split count for the longest possible context; the kernels take every actual range from the
  device ``seq_lens`` (splits past the context are empty and cost almost nothing).
* Graphs are captured lazily, the first time a bucket is used, into one shared memory pool
  (graphs never run concurrently). Two heads per bucket: the model's hidden states (the logits
  of the rows that are sampled are then computed after the replay, as in the eager path), or,
  for steps whose every row is plain greedy, the argmax token of every row, with the final
  norm, lm_head and argmax inside the graph, so the step reads back token ids alone.

``capture=False`` runs the very same padded static-buffer path eagerly: that is how the bucket
and padding logic is tested on CPU (with the Triton kernels under the interpreter), and what a
graph replay must match bit for bit on a GPU.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specserve.model.layers import fused_argmax, pdl
from specserve.model.layers.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

PAD_SLOT = -1  # KV slot of a padded token: the cache write skips it
DEFAULT_MAX_GRAPH_BATCH = 256
WARMUP_RUNS = 2  # eager runs before a capture: Triton compiles, cuBLAS picks its kernels


class Run(Protocol):
    """What the graph runner needs of a scheduled sequence (model_runner.SequenceRun)."""

    token_ids: list[int]
    start: int
    block_table: list[int]


@dataclass(frozen=True, order=True)
class GraphKey:
    batch_size: int  # sequences the graph serves (a rung of the ladder)
    query_len: int  # tokens per sequence it is sized for

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.query_len


def batch_ladder(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch (which is always the last rung, power of two or not)."""
    assert max_batch >= 1
    rungs = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return (*rungs, max_batch)


def pick_key(num_seqs: int, max_query_len: int, ladder: Sequence[int],
             max_graph_query_len: int) -> GraphKey | None:
    """The smallest bucket that holds the batch, or None (run it eagerly)."""
    if num_seqs < 1 or not 1 <= max_query_len <= max_graph_query_len or num_seqs > ladder[-1]:
        return None
    batch = next(b for b in ladder if b >= num_seqs)
    return GraphKey(batch, max_query_len)


@dataclass
class PaddedInputs:
    """One step's inputs laid out for a bucket, on the host (what the static buffer receives)."""

    longs: torch.Tensor  # [3 * T] int64: token ids | positions | slots (PAD_SLOT past real)
    ints: torch.Tensor  # [2 * B + 1 + n * W] int32: seq_lens | query_start_loc | n table rows
    num_tokens: int  # real tokens (packed first)


def write_inputs(key: GraphKey, runs: Sequence[Run], block_size: int, longs: np.ndarray,
                 ints: np.ndarray, table_width: int) -> int:
    """Pack the runs' tokens first, then padding, into longs [3 * T] int64 and the first
    2 * B + 1 + n * W entries of ints (int32); padded sequences get q_len 0, seq_len 0.
    Returns the number of real tokens.

    Only the real sequences' block-table rows are written: a padded sequence is never read."""
    num_seqs, tokens_cap, batch = len(runs), key.num_tokens, key.batch_size
    assert num_seqs <= batch
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    for run in runs:
        n = len(run.token_ids)
        assert 1 <= n <= key.query_len, (n, key)
        bt = run.block_table
        assert len(bt) <= table_width, (len(bt), table_width)
        ids.extend(run.token_ids)
        pos = range(run.start, run.start + n)
        positions.extend(pos)
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in pos)
        seq_lens.append(run.start + n)
        starts.append(starts[-1] + n)
    real, t = len(ids), tokens_cap
    longs[:real] = ids
    longs[real:t] = 0
    longs[t : t + real] = positions
    longs[t + real : 2 * t] = 0
    longs[2 * t : 2 * t + real] = slots
    longs[2 * t + real : 3 * t] = PAD_SLOT
    ints[:num_seqs] = seq_lens
    ints[num_seqs:batch] = 0
    ints[batch : batch + num_seqs + 1] = starts
    ints[batch + num_seqs + 1 : 2 * batch + 1] = real
    head = 2 * batch + 1
    table = ints[head : head + num_seqs * table_width].reshape(num_seqs, table_width)  # [n, W]
    table[:] = 0
    for i, run in enumerate(runs):
        if run.block_table:
            table[i, : len(run.block_table)] = run.block_table
    return real


def pad_inputs(key: GraphKey, runs: Sequence[Run], block_size: int,
               table_width: int) -> PaddedInputs:
    """write_inputs into fresh host tensors (the layout tests read)."""
    longs = np.empty(3 * key.num_tokens, dtype=np.int64)
    ints = np.empty(2 * key.batch_size + 1 + len(runs) * table_width, dtype=np.int32)
    real = write_inputs(key, runs, block_size, longs, ints, table_width)
    return PaddedInputs(torch.from_numpy(longs), torch.from_numpy(ints), real)


class _StaticBuffers:
    """The one device buffer every graph reads, and its pinned host twin.

    A bucket of T tokens and B sequences views the front of the buffer: [3T] int64 (token
    ids | positions | slots), then [2B + 1 + B * W] int32 (seq_lens | query_start_loc | block
    tables). Each step writes its inputs into the host twin and sends them with ONE copy of
    just the bytes it wrote (the padded sequences' table rows are never read, never sent)."""

    def __init__(self, max_batch: int, max_query_len: int, table_width: int,
                 device: torch.device) -> None:
        max_tokens = max_batch * max_query_len
        self.table_width = table_width
        nbytes = 8 * 3 * max_tokens + 4 * (2 * max_batch + 1 + max_batch * table_width)
        self.device_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.pinned = device.type == "cuda"
        self.host_bytes = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.host_np = self.host_bytes.numpy()
        # The last copy out of host_bytes: the host must not overwrite bytes still in flight.
        self.sent = torch.cuda.Event() if self.pinned else None
        self.steps_host: torch.Tensor | None = None  # fill_steps' staging, grown on demand
        # ... and out of steps_host. Two events: a fill() right after a window (a draft's
        # proposals verified without a read) must not wait for the whole window to run.
        self.steps_sent = torch.cuda.Event() if self.pinned else None

    def _sizes(self, key: GraphKey) -> tuple[int, int]:
        """(bytes of the int64 part, entries of the int32 part) of the bucket."""
        return 24 * key.num_tokens, 2 * key.batch_size + 1 + key.batch_size * self.table_width

    def views(self, key: GraphKey) -> tuple[torch.Tensor, ...]:
        """(input_ids [T], positions [T], slots [T], seq_lens [B], query_start_loc [B + 1],
        block_tables [B, W]) for the bucket, on the device."""
        t, b, w = key.num_tokens, key.batch_size, self.table_width
        long_bytes, num_ints = self._sizes(key)
        longs = self.device_bytes[:long_bytes].view(torch.int64)
        ints = self.device_bytes[long_bytes : long_bytes + 4 * num_ints].view(torch.int32)
        return (longs[:t], longs[t : 2 * t], longs[2 * t : 3 * t], ints[:b],
                ints[b : 2 * b + 1], ints[2 * b + 1 :].view(b, w))

    def fill(self, key: GraphKey, runs: Sequence[Run], block_size: int) -> int:
        """Write the runs' padded inputs and send them; returns the number of real tokens."""
        if self.sent is not None:
            self.sent.synchronize()  # a no-op in practice: every step ends in a sync
        real = self._send(key, runs, block_size, self.host_bytes)
        if self.sent is not None:
            self.sent.record()
        return real

    def fill_steps(self, key: GraphKey, runs: Sequence[Run], block_size: int,
                   num_steps: int) -> Iterator[int]:
        """fill() for num_steps consecutive decode steps, one step per iteration: before the
        j-th step runs, the buffer holds the runs advanced by j positions (token ids 0: the
        caller feeds them on the device). Each step's bytes go through their own slice of a
        pinned staging area, so the host can write step j + 1 while step j's copy is still
        in flight; the copies are ordered with the graph replays on the current stream."""
        if self.steps_sent is not None:
            self.steps_sent.synchronize()
        step_bytes = self.host_bytes.numel()
        staging = self._staging(num_steps * step_bytes)
        for j in range(num_steps):
            shifted = [_Shifted(r.start + j, r.block_table) for r in runs] if j else runs
            yield self._send(key, shifted, block_size, staging[j * step_bytes :])
        if self.steps_sent is not None:
            self.steps_sent.record()

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self.steps_host is None or self.steps_host.numel() < nbytes:
            self.steps_host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return self.steps_host

    def _send(self, key: GraphKey, runs: Sequence[Run], block_size: int,
              host_bytes: torch.Tensor) -> int:
        long_bytes, num_ints = self._sizes(key)
        host = host_bytes.numpy()
        longs = host[:long_bytes].view(np.int64)
        ints = host[long_bytes : long_bytes + 4 * num_ints].view(np.int32)
        real = write_inputs(key, runs, block_size, longs, ints, self.table_width)
        nbytes = long_bytes + 4 * (2 * key.batch_size + 1 + len(runs) * self.table_width)
        self.device_bytes[:nbytes].copy_(host_bytes[:nbytes], non_blocking=self.pinned)
        return real


@dataclass
class _Shifted:
    """A decode run advanced to a later position of a multi-step window (its token is fed on
    the device, so the host writes a placeholder)."""

    start: int
    block_table: list[int]
    token_ids: tuple[int] = (0,)


class CudaGraphRunner:
    """Padded static-buffer forwards over a bucket ladder, captured as CUDA graphs."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 block_size: int, max_batch: int, max_query_len: int, max_model_len: int,
                 capture: bool | None = None) -> None:
        assert backend.supports_cuda_graphs, f"backend {backend.name} cannot run in a graph"
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.ladder = batch_ladder(max_batch)
        self.max_query_len = max_query_len
        self.max_model_len = max_model_len
        self.capture = device.type == "cuda" if capture is None else capture
        # A verify run may reach past max_model_len by its lookahead: size tables for that.
        self.table_width = math.ceil((max_model_len + max_query_len) / block_size)
        self.buffers = _StaticBuffers(self.ladder[-1], max_query_len, self.table_width, device)
        self.metas: dict[GraphKey, AttentionMetadata] = {}
        # hidden-state head: graphs / outputs [T, hidden]; argmax head: [T] int64 tokens
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.argmax_graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.argmax_outputs: dict[GraphKey, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.capture_seconds = 0.0

    # ---- buckets -----------------------------------------------------------------------------
    def key_for(self, runs: Sequence[Run]) -> GraphKey | None:
        if not runs or any(len(r.block_table) > self.table_width for r in runs):
            return None
        return pick_key(len(runs), max(len(r.token_ids) for r in runs), self.ladder,
                        self.max_query_len)

    def _meta(self, key: GraphKey) -> AttentionMetadata:
        meta = self.metas.get(key)
        if meta is None:
            _, _, slots, seq_lens, starts, tables = self.buffers.views(key)
            b, q = key.batch_size, key.query_len
            # Host fields describe the bucket, not a batch: the backend plans launch shapes
            # for b sequences of q tokens and the longest context allowed.
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                query_start_loc=starts, query_lens=[q] * b,
                seq_lens_host=[self.max_model_len + q] * b, max_query_len=q,
                max_seq_len=self.max_model_len + q, block_size=self.block_size)
            self.metas[key] = meta
        return meta

    # ---- running -----------------------------------------------------------------------------
    def run(self, key: GraphKey, runs: Sequence[Run], argmax: bool = False,
            fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Final hidden states [num_real_tokens, hidden] of the runs' tokens, in order; with
        argmax=True the argmax of each token's logits instead ([num_real_tokens] int64).
        fed = (rows, tokens): input tokens at these packed rows are set on the device."""
        graphs, outputs = self._head(argmax)
        if self.capture and key not in graphs:
            self._capture(key, argmax)
        real = self.buffers.fill(key, runs, self.block_size)
        if fed is not None:
            self.buffers.views(key)[0][fed[0]] = fed[1]  # queued after the inputs' copy
        if not self.capture:
            # what a replay returns: a view of the bucket's one static output, overwritten by
            # the next forward of the bucket (so code that reads it after launching another
            # pass is wrong here too, not only on a GPU)
            out = self._forward(key, argmax)
            static = outputs.get(key)
            if static is None or static.shape != out.shape or static.dtype != out.dtype:
                static = outputs[key] = torch.empty_like(out)
            return static.copy_(out)[:real]
        graphs[key].replay()
        return outputs[key][:real]

    def run_argmax_steps(self, key: GraphKey, runs: Sequence[Run], num_steps: int,
                         first: torch.Tensor | None = None) -> torch.Tensor:
        """num_steps greedy decode steps of one-token runs, each step's argmax fed back as
        the next step's token on the device; returns the tokens [num_steps, num_runs] on the
        device. No host sync inside: every copy and replay is queued on the current stream,
        so the GPU runs the steps back to back while the host stages the next inputs.
        first: the first step's tokens [num_runs] on the device (else the runs' own)."""
        assert key.query_len == 1
        graphs, outputs = self._head(True)
        if self.capture and key not in graphs:
            self._capture(key, True)
        ids = self.buffers.views(key)[0]  # [T] the graph's token ids
        tokens = torch.empty(num_steps, len(runs), dtype=torch.int64,
                             device=self.device)  # [steps, n]
        for j, real in enumerate(self.buffers.fill_steps(key, runs, self.block_size,
                                                         num_steps)):
            if j:
                ids[:real].copy_(tokens[j - 1])
            elif first is not None:
                ids[:real].copy_(first)
            if self.capture:
                graphs[key].replay()
                out = outputs[key]
            else:
                out = self._forward(key, argmax=True)
            tokens[j].copy_(out[:real])
        return tokens

    def _head(self, argmax: bool):
        if argmax:
            return self.argmax_graphs, self.argmax_outputs
        return self.graphs, self.outputs

    def _forward(self, key: GraphKey, argmax: bool = False) -> torch.Tensor:
        ids, positions = self.buffers.views(key)[:2]
        meta = self._meta(key)
        if not meta.backend_state:
            self.backend.prepare(meta)  # plans once per bucket; the graph bakes the plan in
        hidden = self.model(ids, positions, meta)  # [T, hidden]
        if not argmax:
            return hidden
        # Raw logits' argmax (ties -> lowest id, as the sampler's): [T] int64
        return fused_argmax.logits_argmax(self.model.compute_logits(hidden))

    def _capture(self, key: GraphKey, argmax: bool = False) -> None:
        """Warm up eagerly on an empty batch (every kernel skips: no KV is touched), capture."""
        t0 = time.perf_counter()
        self.buffers.fill(key, [], self.block_size)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with pdl.graph_launches():  # the warm-up compiles the kernels' PDL variants
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self._forward(key, argmax)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            graphs, outputs = self._head(argmax)
            with torch.cuda.graph(graph, pool=self.pool):
                outputs[key] = self._forward(key, argmax)
        graphs[key] = graph
        dt = time.perf_counter() - t0
        self.capture_seconds += dt
        logger.info("captured CUDA graph (%s) for batch %d x %d tokens in %.2fs",
                    "argmax" if argmax else "hidden", key.batch_size, key.query_len, dt)

    def capture_keys(self, keys: Sequence[GraphKey], heads: Sequence[bool] = (False,)) -> None:
        """Capture these buckets now instead of on first use (largest first, so the shared
        pool is sized once), for each head (False: hidden states, True: argmax tokens);
        benchmarks call it to keep captures out of timed regions."""
        for key in sorted(set(keys), reverse=True):
            for argmax in heads:
                if self.capture and key not in self._head(argmax)[0]:
                    self._capture(key, argmax)

    def capture_all(self) -> None:
        self.capture_keys([GraphKey(b, q) for b in self.ladder
                           for q in range(1, self.max_query_len + 1)], heads=(False, True))
