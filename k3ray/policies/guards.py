"""Blow-up guards: pure decisions over a step's merged report and running statistics.

Rules (thresholds from `GuardPolicy`): non-finite loss or gradient norm; per-layer activation max-abs over a limit
(routed-expert output or residual stream); loss spike (a z-score against an exponential moving mean/variance, or a
ratio to the largest loss seen, as Megatron's spiky-loss check); grad-norm spike (ratio to its moving mean). Spike
rules arm after `warmup_steps` accepted steps. The controller carries out the decision (roll back, skip the batch).
Serving checks each sequence of an iteration on its own (`check_sequences`): only those that blew up are stopped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from k3ray.config import GuardPolicy


@dataclass(frozen=True)
class Trip:
    rule: str  # nonfinite_loss | nonfinite_grad | activation | loss_spike | grad_norm_spike
    value: float
    layer: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class GuardState:
    accepted: int = 0
    loss_mean: float = 0.0
    loss_var: float = 0.0
    loss_max: float = 0.0
    grad_norm_mean: float = 0.0
    history: tuple = field(default=())


def check(report: dict, state: GuardState, policy: GuardPolicy) -> Trip | None:
    """The first rule the step breaks, or None."""
    loss, gnorm = report["loss"], report["grad_norm"]
    if not math.isfinite(loss):
        return Trip("nonfinite_loss", loss)
    if not math.isfinite(gnorm):
        return Trip("nonfinite_grad", gnorm)
    for layer, acts in sorted(report.get("activations", {}).items(), key=lambda kv: int(kv[0])):
        for key in ("routed_maxabs", "resid_maxabs"):
            value = acts[key]
            if not math.isfinite(value) or value > policy.max_abs_activation:
                return Trip("activation", value, int(layer), key)
    if state.accepted < policy.warmup_steps:
        return None
    std = math.sqrt(max(state.loss_var, 1e-12))
    z = (loss - state.loss_mean) / std
    if z > policy.loss_zscore and loss > state.loss_mean * 1.05:
        return Trip("loss_spike", loss, detail=f"z={z:.1f} against mean {state.loss_mean:.4f}")
    if loss > policy.loss_spike_ratio * state.loss_max:
        return Trip("loss_spike", loss, detail=f"{loss / state.loss_max:.1f}x the largest loss seen")
    if state.grad_norm_mean > 0 and gnorm > policy.grad_norm_spike_ratio * state.grad_norm_mean:
        return Trip("grad_norm_spike", gnorm, detail=f"{gnorm / state.grad_norm_mean:.1f}x its moving mean")
    return None


def check_sequences(maxabs: list[float], policy: GuardPolicy) -> dict[int, Trip]:
    """Serving: row -> trip for the sequences of an iteration whose largest activation (the residual stream, or
    their logits when not finite) is not finite or over the limit."""
    if not policy.enabled:
        return {}
    trips = {}
    for row, value in enumerate(maxabs):
        if not math.isfinite(value):
            trips[row] = Trip("activation", value, detail="not finite")
        elif value > policy.max_abs_activation:
            trips[row] = Trip("activation", value, detail=f"over {policy.max_abs_activation:g}")
    return trips


def accept(report: dict, state: GuardState, decay: float = 0.9) -> GuardState:
    """Fold an accepted step into the running statistics."""
    loss, gnorm = report["loss"], report["grad_norm"]
    if state.accepted == 0:
        return GuardState(1, loss, 0.0, loss, gnorm)
    delta = loss - state.loss_mean
    mean = state.loss_mean + (1 - decay) * delta
    var = decay * (state.loss_var + (1 - decay) * delta * delta)
    return replace(state, accepted=state.accepted + 1, loss_mean=mean, loss_var=var,
                   loss_max=max(state.loss_max, loss),
                   grad_norm_mean=decay * state.grad_norm_mean + (1 - decay) * gnorm)
