"""A stage's weights restored from one packed state in bulk (`k3ray.grid.snapshots.Packed`: serving's held weights,
no optimizer state): what the stage needs is found as byte ranges of the packed buffer (`weight_pieces`), and those
go to the device in large chunks through a reused pinned buffer, each chunk landing in the parameters it overlaps by
device-to-device copies (`copy_pieces`). Per tensor, from pageable memory, the restore ran at 0.45 GB/s on an H200
(benchmarks/RESULTS.md); in chunks it is one host-to-device stream. Its reference is the per-tensor restore
(`StageEngine.load_state`), which tests compare it with.

Pieces: (chunk, offset in it, a contiguous uint8 view of the destination); a piece's bytes are
data[chunk][offset:offset + dest.numel()]. Expert rows come in runs of consecutive source rows, so an EP rank's
shard of contiguously homed experts is one piece per weight and layer.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from k3ray.grid.snapshots import Packed, TensorSlot, view
from k3ray.model.decoder import K3Stage, is_expert_param

CHUNK_BYTES = 64 << 20  # per host-to-device copy: large enough for the link's full rate, two of them pinned


def weights_only(tree: Any) -> bool:
    """Whether a packed state is weights without optimizer state (serving's held weights)."""
    return (isinstance(tree, dict) and not tree.get("opt_dense")
            and all(all(v is None for v in p["opt"].values()) for p in tree.get("experts", {}).values()))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (writes go to the tensor)."""
    return t.detach().view(-1).view(torch.uint8)


Pieces = list[tuple[int, int, torch.Tensor]]  # (chunk, offset, destination bytes)


def weight_pieces(stage: K3Stage, tree: Any) -> tuple[Pieces, list[tuple[TensorSlot, Any]]]:
    """(pieces, conversions) filling every parameter and router bias of `stage` from the packed state's `tree`:
    pieces where the packed tensor has the destination's dtype and shape, conversions (slot, destination) where not
    (copied with a cast, tensor by tensor)."""
    pieces, conversions = [], []

    def whole(slot: TensorSlot, dest: torch.Tensor) -> None:
        if slot.dtype == str(dest.dtype).removeprefix("torch.") and tuple(slot.shape) == tuple(dest.shape):
            pieces.append((slot.chunk, slot.offset, _bytes(dest)))
        else:
            conversions.append((slot, dest))

    for name, p in stage.named_parameters():
        if not is_expert_param(name):
            whole(tree["dense"][name], p)
    for i, moe in stage.moe_layers().items():
        whole(tree["router_bias"][i], moe.router.bias)
    for layer, shard in stage.expert_shards().items():
        payload = tree["experts"][layer]
        row_of = {e: r for r, e in enumerate(payload["expert_ids"])}
        rows = [row_of[e] for e in shard.expert_ids]
        for w in ("w1", "w2"):
            slot, dest = payload[w], getattr(shard, w)
            if slot.dtype != str(dest.dtype).removeprefix("torch.") or tuple(slot.shape[1:]) != tuple(dest.shape[1:]):
                raise ValueError(f"layer {layer} {w}: packed {slot.dtype} {slot.shape}, shard {dest.dtype} "
                                 f"{tuple(dest.shape)}")
            row_bytes = dest[0].numel() * dest.element_size()
            flat = _bytes(dest)
            k = 0
            while k < len(rows):  # runs of consecutive source rows: one piece each
                run = 1
                while k + run < len(rows) and rows[k + run] == rows[k] + run:
                    run += 1
                pieces.append((slot.chunk, slot.offset + rows[k] * row_bytes,
                               flat[k * row_bytes:(k + run) * row_bytes]))
                k += run
    return pieces, conversions


@torch.no_grad()
def copy_pieces(data: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], chunk_bytes: int = CHUNK_BYTES,
                chunked: bool | None = None) -> None:
    """Copy data[offset:offset + n] into each (offset, destination) piece's destination (uint8 views, all on one
    device; `data`: one chunk of a packed state, uint8 on the host). Chunked (the
    default on CUDA): the bytes the pieces cover go over in chunks of chunk_bytes, staged in two reused host buffers
    (pinned on CUDA: the next chunk is staged while the last one transfers), and reach the destinations by
    device-to-device copies; else one copy per piece."""
    if not pieces:
        return
    device = pieces[0][1].device
    cuda = device.type == "cuda"
    if not (cuda if chunked is None else chunked):
        for offset, dest in pieces:
            dest.copy_(data[offset:offset + dest.numel()])
        return
    pieces = sorted(pieces, key=lambda p: p[0])
    spans = []  # [start, end) byte ranges of `data` that pieces cover, merged where they touch or overlap
    for offset, dest in pieces:
        end = offset + dest.numel()
        if spans and offset <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([offset, end])
    chunk_bytes = min(chunk_bytes, max(end - start for start, end in spans))
    staging = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    on_device = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
    sent = [None, None]  # per staging buffer: the event after its last transfer (then it may be written again)
    first, n = 0, 0  # pieces before `first` end before the current chunk
    for start, end in spans:
        for c0 in range(start, end, chunk_bytes):
            c1 = min(end, c0 + chunk_bytes)
            host = staging[n % 2]
            if sent[n % 2] is not None:
                sent[n % 2].synchronize()
            host[:c1 - c0].copy_(data[c0:c1])
            on_device[:c1 - c0].copy_(host[:c1 - c0], non_blocking=cuda)
            if cuda:
                sent[n % 2] = torch.cuda.current_stream(device).record_event()
            n += 1
            while first < len(pieces) and pieces[first][0] + pieces[first][1].numel() <= c0:
                first += 1
            for offset, dest in pieces[first:]:
                if offset >= c1:
                    break
                lo, hi = max(offset, c0), min(offset + dest.numel(), c1)
                if lo < hi:
                    dest[lo - offset:hi - offset].copy_(on_device[lo - c0:hi - c0])
    if cuda:
        torch.cuda.current_stream(device).synchronize()


def restore_weights(engine, packed: Packed) -> None:
    """Restore `engine`'s stage (a StageEngine whose stage was built for a restore) from serving's packed weights
    (`weights_only`) in bulk."""
    with warnings.catch_warnings():  # torch warns that the object store's arrays are read-only; they are only read
        warnings.simplefilter("ignore", UserWarning)
        data = [torch.from_numpy(d) for d in packed.data]
    pieces, conversions = weight_pieces(engine.stage, packed.tree)

    def write() -> None:
        for c, chunk in enumerate(data):
            copy_pieces(chunk, [(offset, dest) for i, offset, dest in pieces if i == c])
        for slot, dest in conversions:
            dest.copy_(view(data[slot.chunk], slot))

    engine.load_weights_only(write, packed.tree.get("opt_steps", 0), packed.tree.get("lr_scale", 1.0))
