"""Inference caches of one pipeline stage, as SGLang keeps them for K3 (two pools), and one iteration's view of them.

- Gated MLA: the latent [c | k_p] of every past token (c = RMSNorm of the compressed KV [r], k_p the decoupled
  slice [p], K3's layout), in fixed-size pages (`latent[layer]`: [pages + 1, P, r + p]). k and v are recomputed from
  it (with RoPE at each position where the model rotates), so the latent alone reproduces the training forward.
- KDA: the recurrent state S [H, K, V] of every sequence, one fixed slot per sequence (`state[layer]`:
  [slots + 1, H, K, V], fp32, float64 for float64 models); its size does not grow with the context. With KDA's short
  convolution (kernel W) each slot also keeps the last W-1 inputs of q, k, v (`conv[layer]`: [slots + 1, W-1, 3 H K]).
  Each is a view of one tensor of every KDA layer (`states`, `convs`: layer first), so that admitting a sequence
  (emptying or restoring its states) is an op for all layers.
- Prefix cache (k3ray.serve.prefix_cache): checkpoints of a sequence's KDA states (and convolution tails) at
  boundaries of its prefix (`checkpoint_state[layer]`: [C, H, K, V], `checkpoint_conv[layer]`: [C, W-1, 3 H K]),
  saved where the engine asks (`StateSave`: after a row's first `offset` new tokens) and copied into the slot of a
  sequence admitted past a cached prefix (`SeqAdmit.checkpoint`); the latent pages of the prefix are shared through
  the page tables.

Everything an iteration needs beyond its new tokens lives on the device beside the pools, written once when a
sequence is admitted (`CachePools.admit`): each slot's page table and sampling parameters. An iteration then names
its sequences by slot with their start and token count, and every index (positions, latent rows to write and read,
attention masks) is derived on the device without a host sync, so a decode iteration can be replayed as a CUDA graph.
The last page and the last slot are scratch: the padding rows of a graph's batch bucket read and write only there.

Shapes: T packed tokens of the iteration, N sequences, H heads, h head dim, r kv_rank, P page size, Lc the context
length the iteration's attention reads (a bucket at least as long as its longest sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from k3ray.config import ModelConfig
from k3ray.kernels import (kda_decode, kda_decode_slots, kda_prefill, kda_state_chunk, short_conv,
                           short_conv_packed)
from k3ray.kernels.kda import chunk_layout
from k3ray.kernels.short_conv import PackedConv, packed_conv_index
from k3ray.model.serving_attention import (PromptSegments, decode_attention, prompt_rows_attention, prompt_segments,
                                           segment_offsets)
from k3ray.model.transfer import to_device


@dataclass(frozen=True)
class SeqAdmit:
    """A sequence new on a data-parallel rank: its state slot, its first KV pages and its sampling parameters."""
    slot: int
    pages: list[int]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    checkpoint: int = -1  # the prefix cache's checkpoint its KDA states start from (-1: the empty state)


@dataclass(frozen=True)
class StateSave:
    """Save row `row`'s KDA states (and convolution tails) after its first `offset` new tokens in `checkpoint`."""
    row: int
    offset: int
    checkpoint: int


@dataclass(frozen=True)
class SeqPages:
    """KV pages a running sequence grew by: they take its page table's entries first, first + 1, ..."""
    slot: int
    first: int
    pages: list[int]


class CachePools:
    def __init__(self, cfg: ModelConfig, layers: range, pages: int, page_size: int, slots: int, device=None,
                 checkpoints: int = 0):
        dtype = getattr(torch, cfg.dtype)
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.page_size, self.pages, self.slots = page_size, pages, slots
        self.max_pages = -(-cfg.max_seq_len // page_size)
        self.latent: dict[int, torch.Tensor] = {}  # MLA layer -> [pages + 1, P, r]
        self.state: dict[int, torch.Tensor] = {}  # KDA layer -> [slots + 1, H, K, V]
        self.conv: dict[int, torch.Tensor] = {}  # KDA layer with a short convolution -> [slots + 1, W-1, 3 H K]
        self.checkpoint_state: dict[int, torch.Tensor] = {}  # KDA layer -> [C, H, K, V]
        self.checkpoint_conv: dict[int, torch.Tensor] = {}  # KDA layer with a short convolution -> [C, W-1, 3 H K]
        self.load: dict[int, torch.Tensor] = {}  # MoE layer -> [E] int64 routes served since the last read
        kda = [layer for layer in layers if cfg.layer_kind(layer) != "mla"]
        h, conv_width = cfg.kda_head_dim, 3 * cfg.n_heads * cfg.kda_head_dim
        # every KDA layer's states in one tensor (layer first), so that admitting, restoring and saving a sequence's
        # states is an op for all layers, not one per layer (K3 has 45 KDA layers); the dicts hold each layer's view
        self.states = torch.zeros(len(kda), slots + 1, cfg.n_heads, h, h, dtype=state_dtype, device=device)
        self.checkpoint_states = torch.zeros(len(kda), checkpoints, cfg.n_heads, h, h, dtype=state_dtype,
                                             device=device)
        convs = len(kda) if cfg.kda_conv_size else 0
        self.convs = torch.zeros(convs, slots + 1, max(cfg.kda_conv_size - 1, 0), conv_width, dtype=dtype,
                                 device=device)
        self.checkpoint_convs = torch.zeros(convs, checkpoints, max(cfg.kda_conv_size - 1, 0), conv_width,
                                            dtype=dtype, device=device)
        for i, layer in enumerate(kda):
            self.state[layer], self.checkpoint_state[layer] = self.states[i], self.checkpoint_states[i]
            if convs:
                self.conv[layer], self.checkpoint_conv[layer] = self.convs[i], self.checkpoint_convs[i]
        for layer in layers:
            if cfg.layer_kind(layer) == "mla":
                self.latent[layer] = torch.zeros(pages + 1, page_size, cfg.kv_rank + cfg.mla_rope_dim, dtype=dtype,
                                                 device=device)
            if cfg.is_moe_layer(layer):
                self.load[layer] = torch.zeros(cfg.n_experts, dtype=torch.int64, device=device)
        # per slot: its page table (unused entries: the scratch page) and its sampling parameters
        self.page_table = torch.full((slots + 1, self.max_pages), pages, dtype=torch.int64, device=device)
        # the same on the host, for the indices a prompt iteration computes there (`IterationCache.from_plan`)
        self.page_table_host = np.full((slots + 1, self.max_pages), pages, dtype=np.int64)
        self.temperature = torch.zeros(slots + 1, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots + 1, dtype=torch.float32, device=device)
        self.seed = torch.zeros(slots + 1, dtype=torch.int64, device=device)
        # per slot: the token the last stage sampled last (pp = 1: the input of a row scheduled before it came back)
        self.last_token = torch.zeros(slots + 1, dtype=torch.int64, device=device)

    @property
    def scratch_slot(self) -> int:
        return self.slots

    def admit(self, seqs: list[SeqAdmit]) -> None:
        """Write the page tables and sampling parameters of sequences new on this rank (one copy each table); their
        KDA states start empty, or from the checkpoint of their cached prefix."""
        if not seqs:
            return
        dev = self.page_table.device
        table = torch.full((len(seqs), self.max_pages), self.pages, dtype=torch.int64)
        for i, s in enumerate(seqs):
            table[i, :len(s.pages)] = torch.tensor(s.pages, dtype=torch.int64)
        restored = [(s.slot, s.checkpoint) for s in seqs if s.checkpoint >= 0]
        # one copy of the integers, one of the floats
        ints = to_device(torch.cat([table.reshape(-1), torch.tensor([[s.slot, s.seed] for s in seqs]).reshape(-1),
                                    torch.tensor(restored, dtype=torch.int64).reshape(-1)]), torch.int64, dev)
        n = len(seqs)
        table_d, slot_seed, restored_d = ints.split([table.numel(), 2 * n, 2 * len(restored)])
        slots, seeds = slot_seed.view(n, 2).unbind(1)
        self.page_table[slots] = table_d.view(table.shape)
        self.page_table_host[[s.slot for s in seqs]] = table.numpy()
        for states in (self.states, self.convs):  # a sequence starts from the empty state
            states.index_fill_(1, slots, 0.0)  # (`states[:, slots] = 0.0` copies the 0 to the device: a stream sync)
        if restored:
            to, ckpt = restored_d.view(-1, 2).unbind(1)
            for states, saved in ((self.states, self.checkpoint_states), (self.convs, self.checkpoint_convs)):
                states.index_copy_(1, to, saved.index_select(1, ckpt))
        floats = to_device([[s.temperature, s.top_p] for s in seqs], torch.float32, dev)
        self.temperature[slots], self.top_p[slots] = floats.unbind(1)
        self.seed[slots] = seeds

    def save(self, slots: list[int], checkpoints: list[int]) -> None:
        """Checkpoint the KDA states (and convolution tails) of `slots` as they are now (one copy per layer)."""
        if not slots:
            return
        frm, to = to_device([slots, checkpoints], torch.int64, self.page_table.device).unbind(0)
        for states, saved in ((self.states, self.checkpoint_states), (self.convs, self.checkpoint_convs)):
            saved.index_copy_(1, to, states.index_select(1, frm))

    def grow(self, seqs: list[SeqPages]) -> None:
        """Append pages to running sequences' page tables (one copy for all)."""
        if not seqs:
            return
        rows = [s.slot for s in seqs for _ in s.pages]
        cols = [s.first + i for s in seqs for i in range(len(s.pages))]
        rows_d, cols_d, pages_d = to_device([rows, cols, [p for s in seqs for p in s.pages]], torch.int64,
                                            self.page_table.device).unbind(0)
        self.page_table[rows_d, cols_d] = pages_d
        self.page_table_host[rows, cols] = [p for s in seqs for p in s.pages]

    def take_load(self) -> dict[int, list[int]]:
        """layer -> routes served to each expert since the last call (then reset)."""
        out = {layer: t.tolist() for layer, t in self.load.items()}
        for t in self.load.values():
            t.zero_()
        return out

    def context_bucket(self, longest: int) -> int:
        """The attention length Lc for an iteration whose longest sequence has `longest` tokens: whole pages, a
        power of two of them (few distinct shapes, so few CUDA graphs), at most the page table's reach."""
        pages = max(1, -(-longest // self.page_size))
        return min(1 << (pages - 1).bit_length(), self.max_pages) * self.page_size


def pages_that_fit(cfg: ModelConfig, layers: range, page_size: int, slots: int, free_bytes: float,
                   checkpoints: int = 0) -> int:
    """How many latent pages of this stage's layers fit in `free_bytes` beside the per-slot state (KDA state and
    convolution, page tables) of `slots` sequences and `checkpoints` prefix-cache state checkpoints; at most every
    slot's full context (more pages serve nobody)."""
    elem = torch.tensor([], dtype=getattr(torch, cfg.dtype)).element_size()
    state_elem = 8 if elem == 8 else 4
    mla = [layer for layer in layers if cfg.layer_kind(layer) == "mla"]
    kda = len(layers) - len(mla)
    h = cfg.kda_head_dim
    per_checkpoint = kda * (cfg.n_heads * h * h * state_elem
                            + max(cfg.kda_conv_size - 1, 0) * 3 * cfg.n_heads * h * elem)
    free_bytes -= checkpoints * per_checkpoint
    per_slot = per_checkpoint
    max_pages = -(-cfg.max_seq_len // page_size)
    per_slot += max_pages * 8  # its page table row
    per_page = len(mla) * page_size * (cfg.kv_rank + cfg.mla_rope_dim) * elem
    cap = slots * max_pages
    if per_page == 0:
        return cap
    return int(max(0, min(cap, (free_bytes - (slots + 1) * per_slot) // per_page - 1)))


def new_pools(cfg: ModelConfig, layers: range, pages: int, page_size: int, slots: int, device=None,
              checkpoints: int = 0) -> CachePools:
    return CachePools(cfg, layers, pages, page_size, slots, device, checkpoints)


@dataclass(frozen=True)
class TokenRows:
    """An iteration's per-token and per-row indices: cu_seqlens [N + 1] each row's first packed token (and the end),
    last_rows [N] each row's last, positions [T] each token's position in its sequence, write_rows [T] the latent
    page row its latent goes to, token_weight [T] (0: a padding row's token, whose routes are not counted)."""
    cu_seqlens: torch.Tensor
    last_rows: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    token_weight: torch.Tensor


@dataclass
class PromptRows:
    """The rows of an iteration with more than one new token (prompt chunks), R of them. tokens: their new tokens
    in the packed row, row after row ([sum n] indices, or a slice where they lie back to back, the usual case:
    prompt rows come after the decode rows); slots [R] and cu_seqlens [R + 1] (offsets within their tokens), for
    KDA's prefill, which runs over them alone. For MLA's attention in the non-absorbed form
    (k3ray.model.serving_attention): segments, the rows in groups of one attention call each; read_rows / kv_pos
    [sum L]: each row's whole context (cached + new), packed row after row: the latent page rows it is read from and
    its positions."""
    tokens: torch.Tensor | slice
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    segments: list[PromptSegments]
    read_rows: torch.Tensor
    kv_pos: torch.Tensor
    # every prompt row's chunks of kda_state_chunk tokens (kda.chunk_layout), for KDA's prefill: [C, 2] and [R + 1]
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    conv: PackedConv | None  # KDA's short convolution over the rows (and its tails at the saves), where it has one


@dataclass(frozen=True)
class SaveIndices:
    """`SavesInRows.indices` on the device."""
    chunks: torch.Tensor
    checkpoints: torch.Tensor
    within: torch.Tensor
    within_tokens: torch.Tensor
    within_cu: torch.Tensor


@dataclass
class SavesInRows:
    """Checkpoints of an iteration inside its rows (`StateSave`s, offset < the row's count), with every row's first
    packed token (host ints), and the chunks of the prefill kernel's chunk states: their length
    (kernels.kda_state_chunk) and, per row, where its chunks start among the prompt rows' (kda.chunk_layout's
    offsets). `device`: their indices on the device, once `IterationCache.from_plan` copied them."""
    saves: list[StateSave]
    firsts: list[int]
    chunk: int
    chunk_offsets: list[int]
    device: SaveIndices | None = None

    def indices(self) -> list[torch.Tensor]:
        """On the host: chunks [S] each save's chunk in the chunk states (the one it starts, else the one it falls
        in), checkpoints [S]; for the saves inside a chunk (in a row that starts off a boundary: a long prompt's
        later chunk), within [M] their indices in `saves`, within_tokens [t] the packed tokens from their chunk's
        start to them and within_cu [M + 1] those pieces' offsets."""
        chunks, within, tokens, cu = [], [], [], [0]
        for i, s in enumerate(self.saves):
            chunks.append(self.chunk_offsets[s.row] + s.offset // self.chunk)
            past = s.offset % self.chunk
            if past:
                end = self.firsts[s.row] + s.offset
                within.append(i)
                tokens += range(end - past, end)
                cu.append(cu[-1] + past)
        return [torch.tensor(t, dtype=torch.int64) for t in
                (chunks, [s.checkpoint for s in self.saves], within, tokens, cu)]


def _as_slice(rows: list[int], firsts: list[int]) -> slice | None:
    """The packed tokens of `rows` as a slice where the rows are consecutive (their tokens then lie back to back):
    a view instead of a gather; else None."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(firsts[rows[0]], firsts[rows[-1] + 1])
    return None


def fold_maxabs(token_maxabs_T: torch.Tensor | None, x_1Td: torch.Tensor) -> torch.Tensor:
    """Each token's largest |activation| so far [T] with a block's output folded in (NaN propagates)."""
    m = x_1Td[0].detach().abs().amax(-1)
    return m if token_maxabs_T is None else torch.maximum(token_maxabs_T, m)


def add_served_routes(load_E: torch.Tensor, idx_TK: torch.Tensor, token_weight_T: torch.Tensor) -> None:
    """Add each token's routes, times its weight (0: a padding row's), into a layer's served load [E], in place."""
    load_E.index_add_(0, idx_TK.reshape(-1), token_weight_T[:, None].expand_as(idx_TK).reshape(-1))


class IterationCache:
    """One iteration of N sequences on a stage: their new tokens packed into one row [1, T].

    Device inputs: slots_N, starts_N (tokens already cached), counts_N (new tokens), seq_of_token_T, valid_N (False:
    a padding row of a graph bucket). Host: context (Lc, the decode rows' attention length); `prompt`: the rows with
    more than one new token (None: every row is a decode row, so KDA runs the batched recurrent kernel over the N
    sequences as a batch and a CUDA graph can hold the iteration); decode_rows [Nd]: the rows of one new token
    (None: all)."""

    def __init__(self, pools: CachePools, slots_N: torch.Tensor, starts_N: torch.Tensor, counts_N: torch.Tensor,
                 seq_of_token_T: torch.Tensor, context: int, valid_N: torch.Tensor | None = None,
                 rows: TokenRows | None = None, prompt: PromptRows | None = None,
                 decode_rows: torch.Tensor | None = None, decode_tokens: torch.Tensor | slice | None = None,
                 decode_slots: torch.Tensor | None = None, saves: SavesInRows | None = None):
        """rows: the token-wise indices as `from_plan` computes them on the host; None (a decode iteration, or a
        graph's, whose inputs are device tensors): derived here on the device from valid_N and the page tables.
        With prompt rows: decode_rows [Nd] the rows of one new token, decode_tokens their tokens in the packed row
        (indices or a slice), decode_slots [Nd] their slots."""
        self.pools, self.context, self.prompt, self.saves = pools, context, prompt, saves
        self.decode = prompt is None
        self.slots, self.starts, self.counts = slots_N, starts_N, counts_N
        self.seq_of_token = seq_of_token_T
        dev = slots_N.device
        P = pools.page_size
        table = pools.page_table[slots_N]  # [N, max_pages]
        if rows is None:
            ends = counts_N.cumsum(0)
            first = ends - counts_N
            tok = torch.arange(seq_of_token_T.numel(), device=dev)
            positions = starts_N[seq_of_token_T] + tok - first[seq_of_token_T]
            rows = TokenRows(torch.cat([ends.new_zeros(1), ends]), ends - 1, positions,
                             table[seq_of_token_T, positions // P] * P + positions % P,
                             valid_N[seq_of_token_T].to(torch.int64))
        self.cu_seqlens, self.last_rows, self.positions = rows.cu_seqlens, rows.last_rows, rows.positions
        self.write_rows, self.token_weight = rows.write_rows, rows.token_weight
        # decode rows: their tokens in the packed row ([Nd] indices, or a slice), their slots [Nd], and their
        # context through the page tables [Nd, Lc]
        self.decode_rows = decode_rows
        dec_table, dec_starts = table, starts_N
        first = self.cu_seqlens[:-1]  # packed row of each sequence's first new token
        if decode_rows is not None:
            dec_table, dec_starts = table[decode_rows], starts_N[decode_rows]
        self.decode_tokens = first if decode_rows is None else decode_tokens
        self.decode_slots = slots_N if decode_rows is None else decode_slots
        j = torch.arange(context, device=dev)
        self.read_rows = dec_table[:, j // P] * P + j % P  # [Nd, Lc]
        self.in_context = j[None, :] < (dec_starts + 1)[:, None]  # [Nd, Lc]
        self.layer = -1  # set by each block before its attention runs
        # [T] the largest |residual| of each token over the blocks run, for the serving guards, which stop only the
        # sequences that blew up (`sequence_maxabs`)
        self.token_maxabs: torch.Tensor | None = None

    @classmethod
    def from_plan(cls, pools: CachePools, slots: list[int], starts: list[int], counts: list[int], device,
                  context: int | None = None, saves: list[StateSave] = (), padded: bool = False
                  ) -> "IterationCache":
        """An eager iteration's cache from the plan's lists: every index computed on the host, then one
        host-to-device copy (no host sync inside the forward). saves: checkpoints inside prompt rows (those at a
        row's end are the pools' `save` after the iteration); `padded`: the last row pads the iteration's tokens
        (the scratch slot's: its routes are not counted)."""
        n = len(slots)
        dec = [i for i, c in enumerate(counts) if c == 1]
        pre = [i for i, c in enumerate(counts) if c > 1]
        longest = max((starts[i] + 1 for i in dec), default=1)
        context = context or pools.context_bucket(longest)
        if not pre:  # a decode iteration: its indices derived on the device, as its graph does
            seq_of_token = np.repeat(np.arange(n), counts).tolist()
            packed = to_device([*slots, *starts, *counts, *seq_of_token], torch.int64, device)
            valid = torch.ones(n, dtype=torch.bool, device=device)
            if padded:
                valid[-1] = False
            return cls(pools, packed[:n], packed[n:2 * n], packed[2 * n:3 * n], packed[3 * n:], context, valid)
        P = pools.page_size
        slots_a, starts_a, counts_a = (np.asarray(x, dtype=np.int64) for x in (slots, starts, counts))
        ends = np.cumsum(counts_a)
        firsts = [0, *ends.tolist()]
        seq = np.repeat(np.arange(n), counts_a)
        positions = starts_a[seq] + np.arange(int(ends[-1])) - (ends - counts_a)[seq]
        table = pools.page_table_host
        write_rows = table[slots_a[seq], positions // P] * P + positions % P
        weight = np.ones_like(positions)
        if padded:
            weight[firsts[-2]:] = 0
        lens = starts_a[pre] + counts_a[pre]
        kv_seq = np.repeat(slots_a[pre], lens)
        kv_pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        prompt_read_rows = table[kv_seq, kv_pos // P] * P + kv_pos % P
        chunk = kda_state_chunk(device)
        pre_counts, pre_lens = [counts[i] for i in pre], lens.tolist()
        chunk_indices, chunk_offsets = chunk_layout(pre_counts, chunk)  # KDA's prefill runs over the prompt rows
        tokens = np.concatenate([np.arange(firsts[i], firsts[i] + counts[i]) for i in pre])
        host = [np.concatenate([slots_a, starts_a, counts_a]), seq, np.asarray(firsts), ends - 1, positions,
                write_rows, weight, np.asarray(dec), slots_a[dec], np.asarray(firsts)[dec], prompt_read_rows, kv_pos,
                tokens, slots_a[pre], np.concatenate([[0], np.cumsum(pre_counts)]),
                np.asarray(segment_offsets(pre_counts, pre_lens))]
        parts = [torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in host]
        parts += [chunk_indices.reshape(-1), chunk_offsets]
        conv = None
        if pools.conv:  # every KDA layer's kernel is the same width
            W = next(iter(pools.conv.values())).shape[1] + 1
            conv = packed_conv_index(counts, slots, W, [(s.row, s.offset) for s in saves])
            parts += [conv.src.reshape(-1), conv.last.reshape(-1), conv.tails.reshape(-1)]
        inside = None
        if saves:  # saves inside rows are in prompt rows: their chunks counted among the prompt rows'
            row_chunks = dict(zip(pre, chunk_offsets.tolist()))
            inside = SavesInRows(list(saves), firsts, chunk, [row_chunks.get(i, 0) for i in range(n)])
            parts += inside.indices()
        out = to_device(torch.cat(parts), torch.int64, device).split([p.numel() for p in parts])  # one copy
        (sn, seq_t, cu_d, last_d, positions_d, write_d, weight_d, dec_d, dec_slots_d, dec_tokens_d, read_d, kv_pos_d,
         tokens_d, pre_slots_d, pre_cu_d, segments_d, indices_d, offsets_d) = out[:18]
        out = out[18:]
        if conv is not None:
            conv = PackedConv(*(d.view(h.shape) for d, h in zip(out[:3], (conv.src, conv.last, conv.tails))))
            out = out[3:]
        if inside is not None:
            inside.device = SaveIndices(*out)
        segments = prompt_segments(pre_counts, pre_lens, segments_d.to(torch.int32))
        prompt = PromptRows(_as_slice(pre, firsts) or tokens_d, pre_slots_d, pre_cu_d, segments, read_d, kv_pos_d,
                            indices_d.view(-1, 2), offsets_d, conv)
        rows = TokenRows(cu_d, last_d, positions_d, write_d, weight_d)
        return cls(pools, sn[:n], sn[n:2 * n], sn[2 * n:], seq_t, context, rows=rows, prompt=prompt,
                   decode_rows=dec_d, decode_tokens=_as_slice(dec, firsts) or dec_tokens_d, decode_slots=dec_slots_d,
                   saves=inside)

    def note_activations(self, x_1Td: torch.Tensor) -> None:
        """Fold a block's output (the residual stream) into each token's max-abs (NaN propagates)."""
        self.token_maxabs = fold_maxabs(self.token_maxabs, x_1Td)

    def sequence_maxabs(self) -> torch.Tensor:
        """[N] float64: each sequence's largest |activation| over the blocks run (inf: something not finite)."""
        out = torch.zeros(self.slots.numel(), dtype=torch.float64, device=self.slots.device)
        if self.token_maxabs is None or not self.seq_of_token.numel():
            return out
        m = self.token_maxabs.double()
        m = torch.where(torch.isfinite(m), m, torch.inf)
        return out.scatter_reduce(0, self.seq_of_token, m, "amax")

    def note_routes(self, idx_TK: torch.Tensor) -> None:
        """Count the iteration's routes per expert into the layer's served load (in place, so graph replays add)."""
        add_served_routes(self.pools.load[self.layer], idx_TK, self.token_weight)

    def mla_attention(self, q_1THe: torch.Tensor, lat_1Tl: torch.Tensor, mla) -> torch.Tensor:
        """Store this iteration's latents [c | k_p], then causal attention of each sequence's new queries over its
        cached context (k3ray.model.serving_attention): decode rows in the absorbed form over the paged latents,
        prompt rows in the non-absorbed form over their own context, one packed segment each. `mla` is the layer
        (layers.GatedMLA). Returns [1, T, H, h]."""
        if not self.slots.numel():
            return q_1THe.new_zeros(q_1THe.shape[:-1] + (mla.head_dim,))
        pool = self.pools.latent[self.layer]
        flat = pool.view(-1, pool.shape[-1])
        flat.index_copy_(0, self.write_rows, lat_1Tl[0].to(flat.dtype))
        q = q_1THe[0]  # [T, H, e]
        if self.prompt is None:
            return decode_attention(q[self.decode_tokens], flat[self.read_rows], self.in_context, mla)[None]
        o = q.new_empty(q.shape[:-1] + (mla.head_dim,))  # [T, H, h]: every token is a decode or a prompt row's
        if self.decode_rows.numel():
            o[self.decode_tokens] = decode_attention(q[self.decode_tokens], flat[self.read_rows], self.in_context,
                                                     mla).to(o.dtype)
        p = self.prompt
        lat = flat[p.read_rows]  # [sum L, r + p]
        q_m = q[p.tokens]  # [sum n, H, e]
        parts = [prompt_rows_attention(q_m[s.queries], lat[s.contexts], s, mla, p.kv_pos[s.contexts])
                 for s in p.segments]
        o[p.tokens] = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(o.dtype)
        return o[None]

    def kda(self, q, k, v, g, beta, gate_lower_bound: float | None = None) -> torch.Tensor:
        """KDA over the packed sequences from their slots' states; the final states go back into the slots. Decode
        iterations (one token per sequence) run the recurrent kernel with the sequences as a batch, others the
        chunked prefill over the packed sequences, its chunk indices from the plan's copy (no host sync), with the
        states at the saves inside rows (gate_lower_bound: kernels.kda_prefill's)."""
        if not self.seq_of_token.numel():
            return v.new_zeros(v.shape)
        pool = self.pools.state[self.layer]
        if self.decode:  # [N, 1, ...]: one token per sequence, each state updated in its slot
            as_batch = [t.transpose(0, 1) for t in (q, k, v, g, beta)]
            return kda_decode_slots(*as_batch, pool, self.slots).transpose(0, 1)
        # decode rows step their states in place in the pool (as a decode iteration does); the chunked prefill runs
        # over the prompt rows alone: decode rows there would each be a chunk whose state is gathered, carried and
        # written back (~2 MB each at gpu2's widths, a mixed iteration of 64 rows moving ~0.6 GB a layer)
        p = self.prompt
        o = v.new_empty(v.shape)
        if self.decode_rows.numel():
            d = self.decode_tokens
            as_batch = [t[:, d].transpose(0, 1) for t in (q, k, v, g, beta)]
            o[:, d] = kda_decode_slots(*as_batch, pool, self.decode_slots).transpose(0, 1)
        o_p, s1, chunk_states = kda_prefill(*(t[:, p.tokens] for t in (q, k, v, g, beta)), pool[p.slots], p.cu_seqlens,
                                            p.chunk_indices, p.chunk_offsets, gate_lower_bound,
                                            chunk_states=self.saves is not None)
        o[:, p.tokens] = o_p
        if self.saves is not None:
            self._checkpoint(chunk_states, q, k, v, g, beta)
        pool.index_copy_(0, p.slots, s1.to(pool.dtype))
        return o

    def _checkpoint(self, chunk_states: torch.Tensor, q, k, v, g, beta) -> None:
        """The states at the saves inside rows into their checkpoints, from the prefill's chunk states [C, H, K, V]:
        a save where a chunk starts takes that chunk's state, one inside a chunk runs the recurrence on from its
        chunk's start (all such in one call)."""
        idx = self.saves.device
        states = chunk_states[idx.chunks]
        if idx.within.numel():
            _, advanced = kda_decode(*(t[:, idx.within_tokens] for t in (q, k, v, g, beta)),
                                     initial_state=states[idx.within], output_final_state=True,
                                     cu_seqlens=idx.within_cu)
            states[idx.within] = advanced.to(states.dtype)
        ckpt = self.pools.checkpoint_state[self.layer]
        ckpt.index_copy_(0, idx.checkpoints, states.to(ckpt.dtype))

    def short_conv(self, x_1TC: torch.Tensor, weight_CW: torch.Tensor) -> torch.Tensor:
        """KDA's causal short convolution (+ SiLU) over the packed sequences, each continuing from its slot's last
        W-1 inputs; the new last inputs go back into the slots, and those before each save inside a row into its
        checkpoint. x [1, T, 3 H K]. Decode iterations run the sequences as a batch of one token each, prompt
        iterations read by the plan's indices (kernels.short_conv_packed); neither syncs with the host."""
        if not self.slots.numel():
            return x_1TC.new_zeros(x_1TC.shape)
        pool = self.pools.conv[self.layer]
        if self.decode:
            y, s1 = short_conv(x_1TC.transpose(0, 1), weight_CW, pool[self.slots], output_final_state=True)
            y = y.transpose(0, 1)
        else:  # read from the pool where they are; written back below, once read
            y, s1, tails = short_conv_packed(x_1TC, weight_CW, pool, self.prompt.conv)
            if self.saves is not None:
                self.pools.checkpoint_conv[self.layer].index_copy_(0, self.saves.device.checkpoints, tails)
        pool.index_copy_(0, self.slots, s1.to(pool.dtype))
        return y
