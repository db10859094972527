"""Training micro-batches as CUDA graphs: the forward, the loss and the backward of one micro-batch captured once and
replayed for every micro-batch of every step after.

A step of the released layout on one GPU launches ~6,000 kernels, many small (norms, gates, gradient sums between
the compiled regions), and the host's launches run behind the device: the profile shows the GPU idle between them.
A replay launches the whole micro-batch at once.

Two graphs share one memory pool: `first` runs a step's first micro-batch, which makes the gradients and the step's
statistics (the routing statistics, the residual max-abs, the experts' accounting: the engine's step-state slots),
`rest` every later one, which adds into them in place (`k3ray.model.moe.add_into`; autograd adds into an existing
`.grad` in place; the routed experts' weight-gradient kernel adds into it with `adding_into_grads`). After capture
the slots hold tensors of the pool; each step puts them back (`install`), whatever cleared them between steps.

What a replay cannot see is kept out: a micro-batch is captured again when its key changes (the token shape, the loss
scale, any parameter's storage: a restore or a new placement may replace one), and a step whose stage has forward
hooks (the fault drills inject through them) runs eagerly. The first step captures: two warm-up micro-batches on
a side stream (compiling the blocks, autotuning the kernels, for either kind), their state cleared, then the two
captures, then the step's replays. Where a capture fails the stage runs eagerly from then on (logged once).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("k3ray.train")

Slots = Callable[[], list[tuple[object, str]]]
"""() -> the (object, attribute) pairs a step accumulates into across its micro-batches."""


def hooked(stage: torch.nn.Module) -> bool:
    """Whether any module of the stage has a forward hook, which a graph's replay would skip. nn.Module has no
    public query for it."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in stage.modules())


class MicroBatchGraphs:
    """The stage's micro-batch graphs. `run(m, tokens, key, micro_batch)` -> the micro-batch's loss (0-d, on the
    device): `micro_batch(tokens)` runs forward, loss and backward eagerly and returns the loss; `key` names
    everything the captured graphs depend on besides the tokens' values."""

    def __init__(self, slots: Slots):
        self.slots = slots
        self.off = False  # a capture failed: eager from then on
        self.key: tuple | None = None
        self.tokens: torch.Tensor | None = None  # the graphs' input [B, S + 1]
        self.graphs: list[torch.cuda.CUDAGraph] = []  # first, rest
        self.losses: list[torch.Tensor] = []
        self.state: list[tuple[object, str, torch.Tensor | None]] = []

    def usable(self, stage: torch.nn.Module) -> bool:
        return not self.off and not hooked(stage)

    def ready(self, key: tuple) -> bool:
        """Whether a step of `key` (`run`'s key without the tokens' shape) runs without a capture first: captured
        for it, or eager for good (a capture failed)."""
        return self.off or (self.key is not None and self.key[1:] == key)

    def run(self, m: int, tokens: torch.Tensor, key: tuple, micro_batch: Callable[[torch.Tensor], torch.Tensor]
            ) -> torch.Tensor:
        if m == 0 and key != self.key and not self.off:
            self._capture(tokens, key, micro_batch)
        if self.off or tokens.shape != self.tokens.shape:  # eager, adding into the same tensors as a replay would
            return micro_batch(tokens)
        if m == 0:
            self.install()
        self.tokens.copy_(tokens)
        which = min(m, 1)
        self.graphs[which].replay()
        return self.losses[which]

    def install(self) -> None:
        """Point the step-state slots at the tensors the graphs write."""
        for obj, name, value in self.state:
            setattr(obj, name, value)

    def release(self) -> None:
        self.graphs, self.losses, self.state, self.tokens, self.key = [], [], [], None, None

    def _clear(self) -> None:
        for obj, name in self.slots():
            setattr(obj, name, None)

    def _capture(self, tokens: torch.Tensor, key: tuple, micro_batch) -> None:
        self.release()
        self._clear()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):  # the warm-up a capture needs, on the stream it captures on
                for _ in range(2):  # a first micro-batch and a later one: each kind compiled and autotuned
                    micro_batch(tokens)
            torch.cuda.current_stream().wait_stream(side)
            self._clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the warm-up's cached blocks: the graphs' pool takes their place
            self.tokens = tokens.clone()
            first, rest = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            # thread-local: a snapshot's copies may run on another thread of the worker meanwhile
            with torch.cuda.graph(first, stream=side, capture_error_mode="thread_local"):
                first_loss = micro_batch(self.tokens)
            with torch.cuda.graph(rest, pool=first.pool(), stream=side, capture_error_mode="thread_local"):
                rest_loss = micro_batch(self.tokens)
        except Exception as err:  # noqa: BLE001  (any op a capture refuses: the step goes on eagerly)
            torch.cuda.current_stream().wait_stream(side)
            self.off = True
            self.release()
            self._clear()
            log.warning("training CUDA graphs off for this stage: the capture failed: %s",
                        (str(err).splitlines() or [type(err).__name__])[0])
            return
        self.graphs, self.losses, self.key = [first, rest], [first_loss, rest_loss], key
        self.state = [(obj, name, getattr(obj, name)) for obj, name in self.slots()]
