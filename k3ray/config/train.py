"""The training job's sections: parallelism, data, optimizer, execution, the run's length, fault tolerance,
checkpoints and the control API."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from k3ray.config.base import Beta, Section
from k3ray.faults import KILL_AT, TRAINING_FAULTS


class ParallelConfig(Section):
    pp: int = Field(1, gt=0, description="pipeline stages")
    ep: int = Field(1, gt=0, description="expert-parallel ranks per stage (EP is carved out of DP)")
    micro_batches: int = Field(1, gt=0, description="micro-batches per step per EP rank")
    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    collective_timeout_s: float = Field(60.0, gt=0)

    @property
    def world_size(self) -> int:
        return self.pp * self.ep


class DataConfig(Section):
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


class OptimizerConfig(Section):
    lr: float = Field(1e-3, gt=0)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="global grad-norm clip; 0 = off")
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the dtype AdamW keeps its two moments in (float64 models keep float64). bfloat16 "
                               "(as DeepSeek-V3 trains) moves 20 bytes a parameter in the step instead of 28 and holds "
                               "4 bytes a parameter less; the arithmetic stays fp32, each moment rounded once a step")


class ExecutionConfig(Section):
    """How the training step runs on the device; the math is the same whichever is chosen (float64 tests run eager)."""
    compile_blocks: bool | None = Field(
        None, description="regional torch.compile: each decoder block's forward (and so its backward) through "
                          "Inductor, which fuses its elementwise chains (norms, gates, residual adds, KDA's L2 "
                          "norms); kernels and the routed experts stay outside the graphs. Shapes are static per "
                          "config. null (the default): on where the workers run CUDA (a warm kernel cache makes "
                          "it seconds, `k3ray warmup`), off on a CPU (minutes to compile there); true: CUDA only")
    graph_micro_batches: bool | None = Field(
        None, description="each training micro-batch (forward, loss, backward) replayed as a CUDA graph, captured "
                          "at the first step (k3ray.parallel.micro_batch_graphs): the step's launches cost the host "
                          "nothing and the GPU no longer waits between them. Where a micro-batch can be one graph: "
                          "one pipeline stage, one EP rank, no document masking; elsewhere the step runs eagerly. "
                          "null (the default): on where the workers run CUDA; true: CUDA only")
    step_ahead: bool | None = Field(
        None, description="where a stage holds the whole model (one stage, one EP rank, no document masking), queue "
                          "the next step's micro-batches behind this step's optimizer before its report is read, so "
                          "that the device works while the report goes to the controller and the next call comes "
                          "back (redone when the data order or anything else changes meanwhile: the results are the "
                          "same). null (the default): on where the workers run CUDA; on a CPU the work is "
                          "synchronous and running ahead would only delay each report")
    recompute: Literal["none", "attention_elementwise"] = Field(
        "none", description="selective activation recompute: 'attention_elementwise' keeps only the matmul and "
                            "attention outputs of each attention sublayer for backward and recomputes its "
                            "elementwise ops (norms, casts, L2 norms, gates; fla's KDA kernels run again), so "
                            "larger micro-batches fit")
    fill_memory: bool = Field(True, description="with one pipeline stage, run the global batch in the fewest "
                                                "micro-batches whose pre-flight estimate fits the device (the same "
                                                "samples per step; fewer launches and gradient accumulations); "
                                                "false: the configured micro-batches (still split if they do not fit)")
    device_memory_gib: float | None = Field(
        None, gt=0, description="one worker's device memory for the pre-flight check (k3ray.policies.memory); null: "
                                "the device's own, read on a GPU of the cluster (CUDA), or no check (CPU)")

    def compiles_blocks(self, device: str) -> bool:
        """Whether the blocks run compiled on `device` ("cuda" | "cpu")."""
        return device == "cuda" if self.compile_blocks is None else self.compile_blocks

    def steps_ahead(self, device: str) -> bool:
        """Whether steps run their successor's micro-batches ahead on `device` where the topology allows it."""
        return device == "cuda" if self.step_ahead is None else self.step_ahead

    def graphs_micro_batches(self, device: str) -> bool:
        """Whether micro-batches replay as CUDA graphs on `device` where the topology allows it."""
        return device == "cuda" if self.graph_micro_batches is None else self.graph_micro_batches


class TrainConfig(Section):
    steps: int = Field(200, gt=0)
    seed: int = 0
    eval_every: int = Field(50, ge=0)
    eval_batches: int = Field(4, gt=0)
    log_every: int = Field(25, gt=0)  # steps between log lines (the progress bar shows every step)


class FaultSpec(Section):
    kind: Literal[TRAINING_FAULTS]  # k3ray.faults.FAULT_KINDS: the training drills
    step: int = Field(ge=0)
    worker: int | None = Field(None, ge=0)
    workers: list[int] = Field(default_factory=list, description="kill_worker: these world ranks at once")
    layer: int | None = Field(None, ge=0)
    at: Literal[KILL_AT] = Field(
        "step", description="kill_worker: during the step, at its boundary (before the snapshot, checkpoint, policy "
                            "push, grow-back), after it (the next call meets it: an evaluation), in the next grid "
                            "launched at or after the step (a recovery or grow-back under way), or in a phase of the "
                            "snapshot taken at the step's boundary: entering its staging, after streaming its first "
                            "value, after streaming all of it (before the commit), or mapping a neighbour's copy")


class FaultToleranceConfig(Section):
    snapshot_every: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="steps between in-memory snapshots (multiples of it), or auto: as close as "
                            "snapshot_budget allows, from what the job's snapshots and steps cost "
                            "(k3ray.policies.snapshot_cadence)")
    snapshot_budget: float = Field(0.02, gt=0, le=1, description="snapshot_every auto: the share of training time "
                                                                 "snapshots may cost (stall and optimizer wait)")
    spares: int = Field(0, ge=0, description="hot spares: standby workers (each holding its own device) that take "
                                             "lost ranks' places without a process start; 0 = none")
    standbys: bool | Literal["auto"] = Field(
        "auto", description="a standby process beside each worker, sharing its device and holding none of Ray's "
                            "resources (process up, torch and the model code imported, no CUDA context): when the "
                            "worker's process dies it takes the place, no process start; auto: on GPU jobs")
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


class CheckpointConfig(Section):
    dir: str = Field("", description="default runs/<name>/checkpoints: a checkpoint folder belongs to one job")
    every_n_steps: int = Field(0, ge=0, description="0 = only on request and at the end")
    keep: int = Field(3, gt=0)
    at_end: bool = Field(True, description="write a final checkpoint when the job stops")
    max_failures_in_a_row: int = Field(3, gt=0, description="failed checkpoint writes (read-only or full disk) the "
                                                            "job trains on through before it stops")


class ApiConfig(Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    token_file: str | None = None
