"""Typed job configuration. YAML files in configs/ load into `JobConfig`; unknown keys and out-of-range values are
errors that name the file and the field. Validation happens here once; components trust their section.

Notation used across k3ray: E experts, R EP ranks, K top-k, s tokens per rank, d model width (d_model),
d_latent routed-expert width, I expert inner width, L layers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from k3ray.faults import TRAINING_FAULTS


class ConfigError(ValueError):
    """A configuration problem, with the file and field it concerns."""


class _Strict(BaseModel):
    # inf and nan are never a setting (`optimizer.lr: .inf` would train to nothing but guard trips)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """YAML's `true` is not a number: pydantic would read it as 1."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and field.annotation is not bool \
                        and bool not in get_args(field.annotation):
                    raise ValueError(f"{name}: expected {_type_name(field.annotation)}, got {str(value).lower()}")
        return data


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


Beta = Annotated[float, Field(ge=0, lt=1)]


class ModelConfig(_Strict):
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


class ParallelConfig(_Strict):
    pp: int = Field(1, gt=0, description="pipeline stages")
    ep: int = Field(1, gt=0, description="expert-parallel ranks per stage (EP is carved out of DP)")
    micro_batches: int = Field(1, gt=0, description="micro-batches per step per EP rank")
    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    collective_timeout_s: float = Field(60.0, gt=0)

    @property
    def world_size(self) -> int:
        return self.pp * self.ep


class DataConfig(_Strict):
    source: str = Field("stdlib", description="'stdlib' (the Python standard library's .py sources), a directory of "
                                              "files (their bytes), or a folder of shards from `k3ray data prepare`")
    tokenizer: str = Field("bytes", description="'bytes', a tokenizer.json, a tiktoken BPE file, or a folder with one")
    seq_len: int = Field(gt=1)
    micro_batch_size: int = Field(gt=0, description="sequences per micro-batch")
    val_fraction: float = Field(0.02, gt=0, lt=0.5)
    max_bytes: int = Field(64 * 2**20, gt=0, description="corpus cap, read in a fixed file order")

    @field_validator("source")
    @classmethod
    def _source_exists(cls, source: str) -> str:
        # checked where the config is loaded, before any worker starts (a worker would fail in its constructor)
        if source != "stdlib" and not Path(source).is_dir():
            raise ValueError(f"{source!r} is neither 'stdlib' nor a directory")
        return source
    skip_batches: list[int] = Field(default_factory=list, description="batch indices never trained on")
    document_masking: bool = Field(False, description="attention, KDA's recurrence and its convolution restart at "
                                                      "every document packed into a row (after each end-of-text)")


class OptimizerConfig(_Strict):
    lr: float = Field(1e-3, gt=0)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="global grad-norm clip; 0 = off")


class ExecutionConfig(_Strict):
    """How the training step runs on the device; the math is the same whichever is chosen (float64 tests run eager)."""
    compile_blocks: bool = Field(False, description="regional torch.compile: each decoder block's forward (and so its "
                                                    "backward) through Inductor, which fuses its elementwise chains "
                                                    "(norms, gates, residual adds, KDA's L2 norms); kernels and the "
                                                    "routed experts stay outside the graphs. Shapes are static per "
                                                    "config; CUDA only (compile time is minutes on a CPU)")
    recompute: Literal["none", "attention_elementwise"] = Field(
        "none", description="selective activation recompute: 'attention_elementwise' keeps only the matmul and "
                            "attention outputs of each attention sublayer for backward and recomputes its "
                            "elementwise ops (norms, casts, L2 norms, gates; fla's KDA kernels run again), so "
                            "larger micro-batches fit")


class TrainConfig(_Strict):
    steps: int = Field(200, gt=0)
    seed: int = 0
    eval_every: int = Field(50, ge=0)
    eval_batches: int = Field(4, gt=0)
    log_every: int = Field(25, gt=0)  # steps between log lines (the progress bar shows every step)


class MoonEPPolicy(_Strict):
    """Per-micro-batch balance of expert work (k3ray.policies.moonep). With `cost_model`, a replica is made only where
    it shortens the modelled layer (k3ray.policies.expert_cost): rows taken off the busiest rank against the weight
    copy and, in training, its gradient going home. The figures are an H200's (benchmarks/RESULTS.md, K3_NOTES)."""
    enabled: bool = True
    slots_per_rank: int | None = Field(None, gt=0, description="replica slots per rank; default E/R")
    cost_model: bool = Field(True, description="replicas only where the modelled layer gets shorter; false: exact "
                                               "balance whatever the weight traffic")
    expert_tflops: float = Field(400.0, gt=0, description="expert FFN forward+backward TFLOP/s per GPU: Triton "
                                                          "grouped FFN at the K3 latent expert on an H200, 380-410")
    nvlink_gb_per_s: float = Field(330.0, gt=0, description="GB/s a rank sends (and receives) inside a node: NCCL "
                                                            "all_to_all between two H200s, measured")
    ib_gb_per_s: float = Field(50.0, gt=0, description="GB/s a rank sends (and receives) across nodes: one 400 Gb/s "
                                                       "NDR NIC per GPU, line rate (not measured here)")
    ranks_per_node: int = Field(8, gt=0, description="consecutive EP ranks that share a node's NVLink")


class ReplicationPolicy(_Strict):
    enabled: bool = False
    every_n_steps: int = Field(50, gt=0)
    spare_slots_per_rank: int = Field(1, ge=0)
    moved_budget: int | None = Field(None, ge=0)
    history_decay: float = Field(0.9, ge=0, le=1)


class SchedulingPolicy(_Strict):
    """Order of the local expert GEMMs: largest first (LPT), so the SM groups of the persistent kernel finish close
    together (k3ray.policies.scheduling)."""
    enabled: bool = True


class GuardPolicy(_Strict):
    enabled: bool = True
    max_abs_activation: float = Field(1e4, gt=0)
    loss_spike_ratio: float = Field(10.0, gt=1, description="loss over this many times the largest seen trips")
    loss_zscore: float = Field(6.0, gt=0)
    grad_norm_spike_ratio: float = Field(20.0, gt=1)
    warmup_steps: int = Field(10, ge=0, description="steps before spike rules arm")


class PoliciesConfig(_Strict):
    moonep: MoonEPPolicy = Field(default_factory=MoonEPPolicy)
    replication: ReplicationPolicy = Field(default_factory=ReplicationPolicy)
    scheduling: SchedulingPolicy = Field(default_factory=SchedulingPolicy)
    guards: GuardPolicy = Field(default_factory=GuardPolicy)


class FaultSpec(_Strict):
    kind: Literal[TRAINING_FAULTS]  # k3ray.faults.FAULT_KINDS: the training drills
    step: int = Field(ge=0)
    worker: int | None = Field(None, ge=0)
    workers: list[int] = Field(default_factory=list, description="kill_worker: these world ranks at once")
    layer: int | None = Field(None, ge=0)
    at: Literal["step", "boundary", "after_step", "relaunch"] = Field(
        "step", description="kill_worker: during the step, at its boundary (before the snapshot, checkpoint, policy "
                            "push, grow-back), after it (the next call meets it: an evaluation), or in the next grid "
                            "launched at or after the step (a recovery or grow-back under way)")


class FaultToleranceConfig(_Strict):
    snapshot_every: int = Field(5, gt=0)
    spares: int = Field(0, ge=0, description="hot spares: standby workers (each holding its own device) that take "
                                             "lost ranks' places without a process start; 0 = none")
    max_retries_per_step: int = Field(3, ge=0)
    skip_growth: int = Field(2, ge=1, description="batches skipped grow by this factor on a repeated trip")
    lr_backoff: float = Field(0.5, gt=0, le=1)
    grow_back: bool = True
    grow_back_after_steps: int = Field(1, ge=0, description="steps to run shrunk before trying to grow back")
    recovery_attempts: int = Field(4, ge=1, description="attempts to recover from lost workers (a loss during one "
                                                        "starts the next) before the job stops")
    grow_back_attempts: int = Field(3, ge=1, description="failed grow-backs in a row after which the job stays shrunk")
    retry_backoff_s: float = Field(0.5, ge=0, description="wait before a recovery's second attempt, doubled for each "
                                                          "further one (at most 30 s)")
    wait_timeout_s: float = Field(600.0, gt=0, description="longest wait on workers outside a step: evaluation, "
                                                           "checkpoint copy and commit, snapshot commit")
    incidents_file: str | None = Field(None, description="where the incident log is written as it grows (JSON "
                                                         "lines); default runs/<name>/incidents.jsonl")
    faults: list[FaultSpec] = Field(default_factory=list)


class CheckpointConfig(_Strict):
    dir: str = Field("", description="default runs/<name>/checkpoints: a checkpoint folder belongs to one job")
    every_n_steps: int = Field(0, ge=0, description="0 = only on request and at the end")
    keep: int = Field(3, gt=0)
    at_end: bool = Field(True, description="write a final checkpoint when the job stops")
    max_failures_in_a_row: int = Field(3, gt=0, description="failed checkpoint writes (read-only or full disk) the "
                                                            "job trains on through before it stops")


class ApiConfig(_Strict):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    token_file: str | None = None


# serving defaults by device: a GPU batches as vLLM / SGLang do on an H200 (8,192 tokens per iteration, pools from
# free memory); the CPU keeps iterations small (its tests and demos stay fast)
SERVE_DEFAULTS = {"cpu": {"token_budget": 128, "slots_per_rank": 16, "pages_per_rank": 256},
                  "gpu": {"token_budget": 8192, "slots_per_rank": 256, "pages_per_rank": None}}
DEFAULT_STEPWISE_PREFILL_MAX = 64


class ServeConfig(_Strict):
    """`k3ray serve`: cache pools per data-parallel rank (every EP rank of a stage serves its own requests), the
    iteration's token budget, and the limits the front door enforces. Unset sizes take the device's defaults
    (`resolved`)."""
    page_size: int = Field(16, gt=0, description="tokens per latent-KV page")
    pages_per_rank: int | None = Field(None, gt=0, description="latent-KV pages per data-parallel rank; default "
                                       "256 on CPU, on GPUs what serve.gpu_memory_fraction of the memory free at "
                                       "start holds (at most every slot's full context)")
    slots_per_rank: int | None = Field(None, gt=0, description="KDA state slots per rank: its running requests at "
                                       "most; default 16 on CPU, 256 on GPUs")
    token_budget: int | None = Field(None, gt=0, description="tokens per iteration and rank (every decode row plus "
                                     "prompt chunks); default 128 on CPU, 8192 on GPUs")
    gpu_memory_fraction: float = Field(0.8, gt=0, le=1, description="GPUs: the part of the memory free once the "
                                       "weights are loaded that the latent-KV pages may take (the rest: activations "
                                       "of a full iteration, CUDA graphs)")
    stepwise_prefill_max: int | None = Field(None, ge=0, description="prompts of at most this many tokens are fed "
                                             "one token per iteration as decode rows, so their iterations replay "
                                             "the decode CUDA graph instead of running a prefill chunk eagerly; "
                                             f"default {DEFAULT_STEPWISE_PREFILL_MAX} on GPUs where the grid starts "
                                             "with ep=1 (decode graphs), 0 (chunks only) elsewhere")
    overlap: bool | None = Field(None, description="schedule iteration n+1 while the workers run n (two "
                                 "iterations in flight; n+1 takes n's sampled tokens on the device): the engine's "
                                 "host time per iteration hidden behind the step; default on where parallel.pp=1, "
                                 "the only layout it supports (the last stage samples, the first reads the tokens)")
    graphs_at_start: bool = Field(True, description="GPU: capture every decode CUDA graph when a grid starts "
                                  "(seconds more per start and recovery) rather than on first use (an iteration "
                                  "then waits for its capture)")
    max_waiting: int = Field(64, ge=0, description="queued requests beyond which new ones get 429")
    max_tokens: int = Field(256, gt=0, description="largest max_tokens a request may ask for")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429 and of a 503 while no grid serves")
    stream_interval: int = Field(1, gt=0, description="new tokens a stream sends per event after its first token "
                                                     "(its last event may hold fewer): fewer, larger events when "
                                                     "the HTTP path, not the GPU, sets the pace")
    recovery_attempts: int = Field(2, ge=1, description="grid recoveries tried after a loss (each planning up to 3 "
                                                        "times) before the grid is relaunched from the weights")
    recovery_backoff_s: float = Field(1.0, ge=0, le=60, description="wait before the 2nd attempt, doubling after")
    unavailable_wait_s: float = Field(30.0, ge=0, description="while no grid serves, how long a new request waits "
                                                              "(then 503) and a stream in flight (then an error)")

    def resolved(self, device: str = "cpu", ep: int = 1) -> "ServeConfig":
        """This config with its unset sizes filled for `device` ('cpu', 'cuda') and a grid of `ep` EP ranks. On a
        GPU pages_per_rank stays unset: the grid measures it when it starts (k3ray.serve.grid)."""
        defaults = SERVE_DEFAULTS["cpu" if device == "cpu" else "gpu"]
        update = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        if self.stepwise_prefill_max is None:
            update["stepwise_prefill_max"] = DEFAULT_STEPWISE_PREFILL_MAX if device != "cpu" and ep == 1 else 0
        return self.model_copy(update=update)


POLICY_NAMES: tuple[str, ...] = tuple(PoliciesConfig.model_fields)  # the live policies, in one place


class JobConfig(_Strict):
    name: str = Field("k3ray", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
                      description="names runs/<name>/: letters, digits, '_', '.', '-', no path separators")
    model: ModelConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data: DataConfig
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    policies: PoliciesConfig = Field(default_factory=PoliciesConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="before")
    @classmethod
    def _own_checkpoint_dir(cls, data: Any) -> Any:
        """A job's checkpoints go to runs/<name>/checkpoints unless checkpoint.dir says otherwise."""
        if isinstance(data, dict):
            section = data.get("checkpoint")
            if section is None or (isinstance(section, dict) and not section.get("dir")):
                name = data.get("name", cls.model_fields["name"].default)
                data = {**data, "checkpoint": {**(section or {}), "dir": f"runs/{name}/checkpoints"}}
        return data

    @model_validator(mode="after")
    def _check_topology(self) -> "JobConfig":
        m, p = self.model, self.parallel
        if m.n_experts % p.ep:
            raise ValueError(f"parallel.ep={p.ep} does not divide model.n_experts={m.n_experts}")
        if p.pp > m.n_layers:
            raise ValueError(f"parallel.pp={p.pp} exceeds model.n_layers={m.n_layers}")
        if self.execution.compile_blocks and p.device != "cuda":
            raise ValueError("execution.compile_blocks: CUDA only (parallel.device is cpu)")
        if self.serve.overlap and p.pp > 1:
            raise ValueError(f"serve.overlap=true needs parallel.pp=1 (got {p.pp}): the sampled tokens stay on the "
                             f"last stage")
        if self.data.seq_len > m.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        for i, fault in enumerate(self.fault_tolerance.faults):
            for w in [fault.worker, *fault.workers]:
                if w is not None and not 0 <= w < p.world_size:
                    raise ValueError(f"fault_tolerance.faults[{i}].worker={w}: the job has world ranks "
                                     f"0..{p.world_size - 1}")
            if fault.layer is not None and fault.layer >= m.n_layers:
                raise ValueError(f"fault_tolerance.faults[{i}].layer={fault.layer}: the model has layers "
                                 f"0..{m.n_layers - 1}")
        return self

    def with_paths_from(self, cwd: Path) -> "JobConfig":
        """Relative paths made absolute against `cwd`, the directory the user ran the command in: the controller
        and workers run elsewhere (a Ray worker's directory), and must write where the user will look."""
        token_file = self.api.token_file or str(Path("runs") / self.name / "api_token")
        data = {k: str(cwd / v) for k, v, keep in (("source", self.data.source, "stdlib"),
                                                  ("tokenizer", self.data.tokenizer, "bytes")) if v != keep}
        incidents = self.fault_tolerance.incidents_file or str(Path("runs") / self.name / "incidents.jsonl")
        return self.model_copy(update={
            "data": self.data.model_copy(update=data),
            "checkpoint": self.checkpoint.model_copy(update={"dir": str(cwd / self.checkpoint.dir)}),
            "fault_tolerance": self.fault_tolerance.model_copy(update={"incidents_file": str(cwd / incidents)}),
            "api": self.api.model_copy(update={"token_file": str(cwd / token_file)})})

    @property
    def global_batch_sequences(self) -> int:
        return self.parallel.ep * self.parallel.micro_batches * self.data.micro_batch_size

    def step_tokens(self, ep: int | None = None) -> int:
        """Tokens one step trains on with `ep` EP ranks (default: the configured size; fewer while shrunk)."""
        ep = self.parallel.ep if ep is None else ep
        return ep * self.parallel.micro_batches * self.data.micro_batch_size * self.data.seq_len


def serving_config(train_config: dict, pp: int, ep: int, overrides: dict | None = None, spares: int = 0) -> JobConfig:
    """The training job's config on the serving grid (pp x ep, `spares` hot spares), with `serve.*` overrides (a
    `serve` section the checkpoint carries is the training job's default, not a serving choice: it is dropped; so
    are its spares)."""
    cfg = JobConfig.model_validate({k: v for k, v in train_config.items() if k != "serve"})
    par = cfg.parallel.model_copy(update={"pp": pp, "ep": ep})
    serve = cfg.serve.model_copy(update=overrides or {})
    ft = cfg.fault_tolerance.model_copy(update={"spares": spares})
    return JobConfig.model_validate({**cfg.model_dump(), "parallel": par.model_dump(), "serve": serve.model_dump(),
                                     "fault_tolerance": ft.model_dump()})


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        name, sep, rest = msg.partition(": ")
        if sep and name.isidentifier() and e["loc"] and name in _section_fields(e["loc"]):  # a section's own check
            field, msg = f"{field}.{name}", rest
        lines.append(f"  {field}: {msg}")
    return "\n".join(lines)


def _section_fields(loc: tuple) -> set[str]:
    """The field names of the config section at `loc` (empty where loc is not a section)."""
    model: Any = JobConfig
    for part in loc:
        annotation = getattr(model, "model_fields", {}).get(part)
        model = getattr(annotation, "annotation", None)
    return set(getattr(model, "model_fields", {}))


def parse_config(data: dict[str, Any], source: str = "<config>") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def parse_assignments(pairs: list[str], example: str = "parallel.ep=2") -> dict[str, Any]:
    """['a.b=1', 'c=x'] -> {'a.b': 1, 'c': 'x'}, values parsed as YAML (true, 2, 1e-3, [1, 2])."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{pair!r}: expected KEY=VALUE, e.g. {example}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"{pair!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
    return out


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data['a']['b'] = value for dotted='a.b' (overrides from the command line)."""
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    node[leaf] = value


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config ({err.strerror})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    return parse_config(data, str(path))
