"""The model's section: the K3 architecture's shape and its released features (K3_NOTES)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from k3ray.config.base import Section


class ModelConfig(Section):
    vocab_size: int = Field(256, gt=0)
    d_model: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    kv_rank: int = Field(gt=0, description="MLA latent KV width")
    d_latent: int = Field(gt=0, description="routed-expert (latent) width; d_model/2 in K3")
    n_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    expert_inner: int = Field(gt=0, description="inner width I of one routed expert's FFN")
    n_shared: int = Field(1, ge=0)
    shared_inner: int = Field(gt=0, description="inner width of one shared expert")
    attention_pattern: list[Literal["mla", "kda"]] = Field(
        default_factory=lambda: ["mla"], description="repeated over the layers, aligned to the end of the stack; "
                                                     "K3 uses kda, kda, kda, mla")
    mla_layers: list[int] | None = Field(None, description="0-based layers that are MLA, all others KDA (overrides "
                                                          "attention_pattern; released K3: 3, 7, ..., 91 and 92)")
    max_seq_len: int = Field(gt=0)
    kda_head_dim: int = Field(128, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-6, gt=0, description="every RMSNorm's eps; released K3 1e-5")
    # -- the released K3's features (K3_NOTES, "The K3 model as released"); 0 / false / null turns one off --------
    q_lora_rank: int = Field(0, ge=0, description="MLA queries through a rank-r bottleneck with an RMSNorm between "
                                                  "(HF q_lora_rank; K3 1536); 0 = one full-rank W_q")
    mla_rope_dim: int = Field(0, ge=0, description="width of MLA's decoupled key slice of the compressed input, "
                                                   "shared by all heads (HF qk_rope_head_dim; K3 64)")
    mla_rope: bool = Field(False, description="rotate the decoupled slice with RoPE (rope_theta); K3: false, no "
                                              "position encoding in MLA (KDA's recurrence carries position)")
    first_dense_layers: int = Field(0, ge=0, description="the first layers carry a dense SiTU-GLU FFN instead of "
                                                         "the MoE (HF first_k_dense_replace; K3 1)")
    dense_inner: int = Field(0, ge=0, description="inner width of the dense FFN (HF intermediate_size; K3 33792)")
    kda_conv_size: int = Field(0, ge=0, description="KDA's causal short convolution over q, k, v, each followed "
                                                    "by SiLU (HF short_conv_kernel_size; K3 4); 0 = none")
    kda_gate_lower_bound: float | None = Field(
        None, lt=0, ge=-5, description="KDA forget gate log a = lb * sigmoid(exp(A_log) (W_b W_a x + dt_bias)) "
                                       "(fla's lower-bound gate; K3 -5); null: -exp(A_log) softplus(...)")
    kda_scaled_read: bool = Field(False, description="KDA reads o = S^T q / sqrt(kda_head_dim) (K3: true)")
    attn_res_block_size: int = Field(0, ge=0, description="Block Attention Residuals over blocks of this many "
                                                          "layers (HF attn_res_block_size; K3 12); 0 = plain "
                                                          "residual stream")
    balancing: Literal["quantile", "sign", "none"] = "quantile"
    sign_update_rate: float = Field(1e-3, gt=0)
    quantile_bins: int = Field(1000, ge=10)
    quantile_window: float = Field(2.0, gt=0, description="half-width of the histogram range of the margins "
                                                          "s - alpha + b (one update moves a bias at most this far)")
    quantile_step: float = Field(1.0, gt=0, le=1, description="b <- b + step (b_hat - b); 1 is Quantile Balancing "
                                                              "as released (no step size); below 1 averages one "
                                                              "batch's quantile noise over ~(2 - step)/step steps")
    quantile_bias_from: Literal["previous_step", "micro_batch"] = Field(
        "previous_step", description="where a training micro-batch's routing bias comes from: the previous step's "
                                     "global histogram (as released: one step of lag), or one quantile pass over "
                                     "the micro-batch's own scores from the step's bias (no lag; model/balancing.py)")
    quantile_eval_bias_from: Literal["step", "batch"] = Field(
        "step", description="where a batch routed without gradients and without an inference cache (evaluation) "
                            "takes its bias: the step's (as released; serving always does), or its own, as "
                            "micro_batch routes training, so evaluation routes as training did (the step's bias "
                            "cannot balance a held-out split unlike the training batches; model/balancing.py). "
                            "'batch' also reroutes every plain forward, serving's cache-free reference among them")
    quantile_resolution: float = Field(1e-5, gt=0, description="the histogram's bins are log-spaced around the "
                                                               "decision boundary: about this wide there, wider in "
                                                               "proportion to the distance (model/balancing.py)")
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.top_k >= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be smaller than n_experts={self.n_experts}")
        if self.mla_layers is not None:
            bad = [i for i in self.mla_layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(f"mla_layers: {bad} outside the model's layers 0..{self.n_layers - 1}")
        if self.mla_rope and self.mla_rope_dim == 0:
            raise ValueError("mla_rope: RoPE rotates the decoupled slice, so it needs mla_rope_dim > 0")
        if self.mla_rope_dim % 2:
            raise ValueError(f"mla_rope_dim: {self.mla_rope_dim} must be even (RoPE rotates pairs)")
        if self.first_dense_layers > self.n_layers:
            raise ValueError(f"first_dense_layers: {self.first_dense_layers} exceeds n_layers={self.n_layers}")
        if self.first_dense_layers and not self.dense_inner:
            raise ValueError("dense_inner: the dense layers (first_dense_layers > 0) need their FFN width")
        return self

    def layer_kind(self, layer: int) -> str:
        """"mla" or "kda". With `mla_layers` those layers are MLA; otherwise the pattern is aligned to the end of
        the stack, so the last layer closes a full pattern (93 layers of kda, kda, kda, mla: 69 KDA + 24 MLA)."""
        if self.mla_layers is not None:
            return "mla" if layer in self.mla_layers else "kda"
        n = len(self.attention_pattern)
        return self.attention_pattern[(layer - self.n_layers) % n]

    def is_moe_layer(self, layer: int) -> bool:
        """The first `first_dense_layers` layers carry a dense FFN, the rest the routed MoE."""
        return layer >= self.first_dense_layers

    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def stage_layers(self, pp: int, stage: int) -> range:
        """The layers of pipeline stage `stage` of `pp`: a contiguous split (the first stages take one more when it
        does not divide)."""
        base, extra = divmod(self.n_layers, pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))
