"""Device memory one training worker needs, from the config alone, and what to do when it does not fit the device.

`estimate` counts the peak of the heaviest worker (pipeline stage p, EP rank e) in bytes:
    static       parameters (model.dtype; router biases fp32) and their gradients (model.dtype), the optimizer's
                 fp32 master (parameters below fp32) and AdamW's two moments (optimizer.moments_dtype; float64 models'
                 float64): k3ray.optim. Exact.
    step peak    the larger of the two phases of a step:
                 - forward/backward: the saved activations of the micro-batches in flight (min(M, pp - p) under
                   1F1B), the MoonEP replica weights received per MoE layer (at most the slots per rank, saved for
                   backward), one MoE layer's dispatch buffers (send and receive) and one layer's backward working set;
                 - the optimizer step: with ep > 1 the flat fp32 all-reduce buffer of the dense gradients and their
                   fp32 copy, still held (the fused AdamW reads bf16 gradients as they are: no widened copies). Exact.
    overhead     CUDA context, cuBLAS/NCCL workspaces, and the caching allocator's fragmentation (an estimate).
The activations are an estimate: per token and layer, the widths of the tensors autograd keeps (and the fused kernels
keep: fla's chunk KDA, the grouped expert FFN, cuDNN attention), with execution.recompute's selective recompute
keeping only matmul and attention outputs of the attention sublayer. The snapshot stager needs nothing here: it
stages only into memory left free after a step (k3ray.grid.snapshot_stager).

`decide` keeps the configured setting if it fits; else turns on activation recompute, then splits micro-batches (the
same global batch in more, smaller micro-batches); else refuses, naming the grid that would fit. A setting that fits
is filled (execution.fill_memory, one pipeline stage): the same global batch in the fewest micro-batches that fit,
since each micro-batch costs its own launches and a gradient accumulation over every parameter, and larger GEMMs run
nearer the peak; with pipeline stages fewer micro-batches would widen the bubble, so the shape stays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from k3ray.config import JobConfig, ModelConfig

GiB = 2 ** 30
FIXED_OVERHEAD = int(1.5 * GiB)  # CUDA context (~0.5 GiB with lazy module loading), cuBLAS and NCCL workspaces
ALLOCATOR_SLACK = 0.05  # caching-allocator fragmentation, as a share of the tensors' bytes
KDA_CHUNK = 64  # fla's chunk size: chunk_kda keeps two [T, H, 64] fp32 intra-chunk matrices for backward
DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one worker needs; `peak` is what the device must hold."""
    params: int
    grads: int
    master: int
    moments: int
    activations: int  # estimate
    replica_weights: int  # MoonEP's received expert weights, worst case (every slot used)
    dispatch: int  # estimate
    optimizer_transient: int
    overhead: int  # estimate

    @property
    def static(self) -> int:
        return self.params + self.grads + self.master + self.moments

    @property
    def step_peak(self) -> int:
        return max(self.activations + self.replica_weights + self.dispatch, self.optimizer_transient)

    @property
    def peak(self) -> int:
        return self.static + self.step_peak + self.overhead

    def parts_gib(self) -> dict[str, float]:
        names = ("params", "grads", "master", "moments", "activations", "replica_weights", "dispatch",
                 "optimizer_transient", "overhead")
        return {n: getattr(self, n) / GiB for n in names}


@dataclass(frozen=True)
class MemoryDecision:
    outcome: Literal["fits", "filled", "adjusted", "refused"]
    estimate: MemoryEstimate  # of the setting chosen (the configured one when refused)
    configured: MemoryEstimate
    device_bytes: int
    changes: dict[str, Any] = field(default_factory=dict)  # filled, adjusted: dotted config keys set
    fitting_grids: dict[str, MemoryEstimate] = field(default_factory=dict)  # refused: settings that would fit


# -- parameters --------------------------------------------------------------------------------------------------
def layer_params(m: ModelConfig, layer: int, local_experts: int) -> tuple[int, int]:
    """(parameters, fp32 buffer elements) of one decoder layer holding `local_experts` routed experts."""
    d, H = m.d_model, m.n_heads
    n = 2 * d  # attn_norm, ffn_norm
    if m.layer_kind(layer) == "kda":
        K = m.kda_head_dim
        hd = H * K
        n += 3 * d * hd + 3 * hd * m.kda_conv_size + K * d + hd * K + H + hd + H * d + K + hd * d + d * hd
    else:
        h, p, r, q = m.head_dim, m.mla_rope_dim, m.kv_rank, m.q_lora_rank
        n += (d * q + q + q * H * (h + p)) if q else d * H * (h + p)
        n += d * (r + p) + r + r * H * 2 * h + d * H * h + H * h * d
    buffers = 0
    if m.is_moe_layer(layer):
        dl, I = m.d_latent, m.expert_inner
        n += d * dl + m.n_experts * d + dl + dl * d + m.n_shared * 3 * d * m.shared_inner
        n += local_experts * (dl * 2 * I + I * dl)
        buffers = m.n_experts  # the router bias
    else:
        n += 3 * d * m.dense_inner
    if m.attn_res_block_size:
        n += 2 * 2 * d  # attn_res and ffn_res: a pseudo-query and a key norm each
    return n, buffers


def stage_params(m: ModelConfig, layers: range, local_experts: int) -> tuple[int, int]:
    """(parameters, fp32 buffer elements) of the pipeline stage holding `layers`."""
    n = buffers = 0
    for layer in layers:
        p, b = layer_params(m, layer, local_experts)
        n, buffers = n + p, buffers + b
    if layers.start == 0:
        n += m.vocab_size * m.d_model  # embedding
    if layers.stop == m.n_layers:
        n += m.d_model + m.d_model * m.vocab_size + (2 * m.d_model if m.attn_res_block_size else 0)
    return n, buffers


# -- activations (estimate) --------------------------------------------------------------------------------------
def _attention_bytes(m: ModelConfig, layer: int, w: int, f: int, recompute: bool) -> int:
    """Bytes per token the attention sublayer keeps for backward (its input included)."""
    d, H = m.d_model, m.n_heads
    if m.layer_kind(layer) == "kda":
        K = m.kda_head_dim
        hd = H * K
        kept_matmuls = (3 * hd + K + hd + H + hd + d) * w  # q|k|v, gate down/up, beta, output gate, W_o
        if recompute:
            return d * w + kept_matmuls
        conv = 3 * hd * w if m.kda_conv_size else 0
        qk = 4 * hd * f + (hd * f if m.kda_scaled_read else 0)  # widened and L2-normalised q, k
        gate = hd * f + H * f  # log alpha, beta
        kernel = 2 * H * KDA_CHUNK * f
        out = 4 * hd * w  # o, its norm, sigmoid gate, gated product
        return 2 * d * w + kept_matmuls + conv + qk + gate + kernel + out
    h, p, r, q = m.head_dim, m.mla_rope_dim, m.kv_rank, m.q_lora_rank
    qw = H * (h + p)
    kept_matmuls = (q + qw + (r + p) + 2 * H * h + qw + H * h + d) * w  # q (LoRA), kv down/up, attention, gate, W_o
    if recompute:
        return d * w + kept_matmuls + H * f
    norms = (2 * q + 2 * r + (r + p)) * w  # q and kv norms, the latent [c | k_p]
    keys_values = 2 * qw * w  # keys with the shared slice, values padded to the query width (fused kernels)
    out = 3 * H * h * w  # o flattened, sigmoid gate, gated product
    return 2 * d * w + kept_matmuls + norms + keys_values + out + H * f


def _ffn_bytes(m: ModelConfig, layer: int, w: int, f: int) -> int:
    """Bytes per token the FFN sublayer keeps (its norm's input and output included)."""
    d = m.d_model
    if not m.is_moe_layer(layer):
        return 2 * d * w + 3 * m.dense_inner * w
    dl = m.d_latent
    router = d * f + m.n_experts * f + m.top_k * (8 + f)
    routed = m.top_k * (2 * dl + 2 * m.expert_inner) * w  # rows in, gate|up of the grouped FFN, rows out
    latent = 3 * dl * w  # down-projection, combined output, its norm
    shared = m.n_shared * 3 * m.shared_inner * w
    return 2 * d * w + router + routed + latent + shared


def _attn_res_bytes(values: int, d: int, w: int, f: int) -> int:
    """Bytes per token one Block AttnRes read over `values` tensors keeps: the stack, and in bf16 an fp32 norm, score
    and weight per value (model.layers._AttnResMix), in fp32 and wider the keys."""
    if values <= 1:
        return 0
    return values * (d * w + 3 * f) if w < 4 else values * 2 * d * w


def stage_activation_bytes(cfg: JobConfig, layers: range) -> tuple[int, int]:
    """(bytes per token the stage keeps for backward, the largest one layer keeps), for one micro-batch."""
    m = cfg.model
    w = DTYPE_BYTES[m.dtype]
    f = max(4, w)
    recompute = cfg.execution.recompute == "attention_elementwise"
    n = m.attn_res_block_size
    total = largest = 0
    for layer in layers:
        kept = _attention_bytes(m, layer, w, f, recompute) + _ffn_bytes(m, layer, w, f)
        if n:
            before = -(-layer // n)  # summaries committed before the layer
            after = before + (1 if layer % n == 0 else 0)
            kept += _attn_res_bytes(before + 1, m.d_model, w, f) + _attn_res_bytes(after + 1, m.d_model, w, f)
        total += kept
        largest = max(largest, kept)
    if layers.stop == m.n_layers:
        summaries = -(-m.n_layers // n) if n else 0
        total += _attn_res_bytes(summaries + 1, m.d_model, w, f) + 2 * m.d_model * w + m.vocab_size * (w + 2 * f)
    return total, largest


# -- the estimate --------------------------------------------------------------------------------------------------
def estimate(cfg: JobConfig) -> MemoryEstimate:
    """The peak of the heaviest worker of the configured grid (the largest estimate over its pipeline stages)."""
    return max((_stage_estimate(cfg, p) for p in range(cfg.parallel.pp)), key=lambda e: e.peak)


def _stage_estimate(cfg: JobConfig, stage: int) -> MemoryEstimate:
    m, par = cfg.model, cfg.parallel
    layers = m.stage_layers(par.pp, stage)
    w = DTYPE_BYTES[m.dtype]
    master = w < 4
    local = -(-m.n_experts // par.ep)
    n_params, n_buffers = stage_params(m, layers, local)
    dense_params = stage_params(m, layers, 0)[0]
    tokens = cfg.data.micro_batch_size * cfg.data.seq_len
    in_flight = min(par.micro_batches, par.pp - stage)
    per_token, largest_layer = stage_activation_bytes(cfg, layers)
    moe_layers = sum(m.is_moe_layer(i) for i in layers)
    slots = 0
    if par.ep > 1 and cfg.policies.moonep.enabled:
        slots = cfg.policies.moonep.slots_per_rank or m.n_experts // par.ep
    expert_bytes = 3 * m.d_latent * m.expert_inner * w
    replicas = in_flight * moe_layers * slots * expert_bytes + (slots * expert_bytes if moe_layers else 0)
    dispatch = 2 * tokens * m.top_k * m.d_latent * w if moe_layers else 0
    # the dense all-reduce's flat fp32 buffer is held while the gradients take their values from it
    flat = 4 * dense_params if par.ep > 1 else 0
    optimizer = flat + (4 * dense_params if master and par.ep > 1 else 0)
    activations = (in_flight * per_token + largest_layer) * tokens
    params, grads = n_params * w + n_buffers * 4, n_params * w
    moment_bytes = 8 if w == 8 else DTYPE_BYTES[cfg.optimizer.moments_dtype]
    master_bytes, moments = (4 * n_params if master else 0), 2 * moment_bytes * n_params
    tensors = params + grads + master_bytes + moments + max(activations + replicas + dispatch, optimizer)
    return MemoryEstimate(params=params, grads=grads, master=master_bytes, moments=moments, activations=activations,
                          replica_weights=replicas, dispatch=dispatch, optimizer_transient=optimizer,
                          overhead=FIXED_OVERHEAD + int(ALLOCATOR_SLACK * tensors))


# -- the decision --------------------------------------------------------------------------------------------------
def with_settings(cfg: JobConfig, changes: dict[str, Any]) -> JobConfig:
    """`cfg` with dotted keys ("execution.recompute") set, validated again."""
    data = cfg.model_dump()
    for key, value in changes.items():
        section, name = key.split(".")
        data[section][name] = value
    return JobConfig.model_validate(data)


def _adjustments(cfg: JobConfig) -> list[dict[str, Any]]:
    """Settings that keep the grid and the global batch, least change first: recompute, then micro-batches of fewer
    sequences (more of them), with recompute."""
    recompute = {} if cfg.execution.recompute == "attention_elementwise" else {
        "execution.recompute": "attention_elementwise"}
    out = [recompute] if recompute else []
    B, M = cfg.data.micro_batch_size, cfg.parallel.micro_batches
    for smaller in sorted((b for b in range(1, B) if B % b == 0), reverse=True):
        out.append({**recompute, "data.micro_batch_size": smaller, "parallel.micro_batches": M * B // smaller})
    return out


def _fuller(cfg: JobConfig) -> list[dict[str, Any]]:
    """The same global batch in fewer, larger micro-batches, fewest first (one pipeline stage, fill_memory on)."""
    if cfg.parallel.pp > 1 or not cfg.execution.fill_memory:
        return []
    B, M = cfg.data.micro_batch_size, cfg.parallel.micro_batches
    return [{"data.micro_batch_size": B * M // fewer, "parallel.micro_batches": fewer}
            for fewer in range(1, M) if B * M % fewer == 0]


def _grids(cfg: JobConfig) -> list[dict[str, Any]]:
    """Larger grids, fewest workers first: more EP ranks (dividing E; fewer micro-batches where that keeps the global
    batch), more pipeline stages; each with recompute where the config has none."""
    m, par = cfg.model, cfg.parallel
    out = []
    for ep in range(par.ep + 1, m.n_experts + 1):
        if m.n_experts % ep == 0:
            grid = {"parallel.ep": ep}
            if par.micro_batches * par.ep % ep == 0:
                grid["parallel.micro_batches"] = par.micro_batches * par.ep // ep
            out.append((ep * par.pp, grid))
    out += [(pp * par.ep, {"parallel.pp": pp}) for pp in range(par.pp + 1, m.n_layers + 1)]
    recompute = [{**g, "execution.recompute": "attention_elementwise"} for _, g in sorted(out, key=lambda t: t[0])] \
        if cfg.execution.recompute == "none" else []
    return [g for _, g in sorted(out, key=lambda t: t[0])] + recompute


def decide(cfg: JobConfig, device_bytes: int) -> MemoryDecision:
    configured = estimate(cfg)
    if configured.peak <= device_bytes:
        for changes in _fuller(cfg):
            est = estimate(with_settings(cfg, changes))
            if est.peak <= device_bytes:
                return MemoryDecision("filled", est, configured, device_bytes, changes)
        return MemoryDecision("fits", configured, configured, device_bytes)
    for changes in _adjustments(cfg):
        est = estimate(with_settings(cfg, changes))
        if est.peak <= device_bytes:
            return MemoryDecision("adjusted", est, configured, device_bytes, changes)
    fitting: dict[str, MemoryEstimate] = {}
    kinds = set()
    for grid in _grids(cfg):
        kind = "ep" if "parallel.ep" in grid else "pp"
        if kind in kinds:
            continue
        est = estimate(with_settings(cfg, grid))
        if est.peak <= device_bytes:
            fitting[" ".join(f"{k}={v}" for k, v in grid.items())] = est
            kinds.add(kind)
    return MemoryDecision("refused", configured, configured, device_bytes, fitting_grids=fitting)


def describe(decision: MemoryDecision) -> str:
    """One line for a person: what the worker needs, what the device has, and what was done or would fit."""
    est, dev = decision.estimate, decision.device_bytes / GiB
    if decision.outcome == "fits":
        return f"device memory: {est.peak / GiB:.1f} of {dev:.1f} GiB per worker ({parts(est)})"
    if decision.outcome == "filled":
        c = decision.changes
        return f"device memory: {est.peak / GiB:.1f} of {dev:.1f} GiB per worker with the global batch in " \
               f"{c['parallel.micro_batches']} micro-batch(es) of {c['data.micro_batch_size']} sequences " \
               f"(configured: {decision.configured.peak / GiB:.1f} GiB; the same samples per step, the " \
               f"per-micro-batch routing bias differs; execution.fill_memory=false keeps the configured shape)"
    need = f"{decision.configured.peak / GiB:.1f} GiB per worker, the device has {dev:.1f} GiB"
    if decision.outcome == "adjusted":
        settings = " ".join(f"{k}={v}" for k, v in decision.changes.items())
        what = "results unchanged" if set(decision.changes) == {"execution.recompute"} else \
            "the same global batch in smaller micro-batches: its samples and the per-micro-batch routing bias differ"
        return f"device memory: the configured setting needs {need}: training with {settings} " \
               f"({est.peak / GiB:.1f} GiB; {what})"
    fits = " or ".join(f"{g} ({e.peak / GiB:.1f} GiB)" for g, e in decision.fitting_grids.items()) or \
        "no larger grid of this model"
    return f"device memory: needs {need} ({parts(est)}), and no recompute or micro-batch split fits; " \
           f"fits with {fits}"


def parts(est: MemoryEstimate) -> str:
    return ", ".join(f"{name} {gib:.1f}" for name, gib in est.parts_gib().items() if gib >= 0.05)

