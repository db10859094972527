"""Precision helpers: "compute in fp32" means at least fp32, so a float64 model (used to check equivalence
without rounding noise) is never rounded down."""
import torch


def up32(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or unchanged if it is already fp32 or wider."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()
