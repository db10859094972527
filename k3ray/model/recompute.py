"""Selective activation recompute (execution.recompute): a region's matmul and attention outputs are kept for
backward, everything else it computed (norms, casts, L2 norms, gates) is recomputed from them when backward needs
it, through torch's selective checkpointing (non-reentrant). Kernels outside aten (fla's KDA, k3ray's Triton) are
recomputed too: they are not ops the policy can keep."""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
KEPT_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective-checkpoint policy: keep what costs FLOPs to redo, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_elementwise(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args), with only its matmul and attention outputs saved for backward."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, keep_matmuls))
