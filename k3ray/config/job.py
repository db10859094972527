"""The whole job's config (every section, checked against each other) and the serving grid's variant of it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from k3ray.config.base import Section
from k3ray.config.model import ModelConfig
from k3ray.config.policies import PoliciesConfig
from k3ray.config.serve import ServeConfig
from k3ray.config.train import (ApiConfig, CheckpointConfig, DataConfig, ExecutionConfig, FaultToleranceConfig,
                                OptimizerConfig, ParallelConfig, TrainConfig)


class JobConfig(Section):
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
        for key in ("compile_blocks", "graph_micro_batches"):
            if getattr(self.execution, key) and p.device != "cuda":
                raise ValueError(f"execution.{key}: CUDA only (parallel.device is cpu)")
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


def serving_config(train_config: dict, pp: int, ep: int, overrides: dict | None = None, spares: int = 0,
                   standbys: bool | str = "auto") -> JobConfig:
    """The training job's config on the serving grid (pp x ep, `spares` hot spares, `standbys`: the standby processes,
    fault_tolerance.standbys), with `serve.*` overrides (a `serve` section the checkpoint carries is the training
    job's default, not a serving choice: it is dropped; so are its spares and standbys). Its blocks run eagerly:
    execution.compile_blocks is the training step's (static shapes per config), where a serving iteration's token
    count changes every time and the GPU's serving iterations replay CUDA graphs instead."""
    cfg = JobConfig.model_validate({k: v for k, v in train_config.items() if k != "serve"})
    par = cfg.parallel.model_copy(update={"pp": pp, "ep": ep})
    serve = cfg.serve.model_copy(update=overrides or {})
    ft = cfg.fault_tolerance.model_copy(update={"spares": spares, "standbys": standbys})
    execution = cfg.execution.model_copy(update={"compile_blocks": False})
    return JobConfig.model_validate({**cfg.model_dump(), "parallel": par.model_dump(), "serve": serve.model_dump(),
                                     "fault_tolerance": ft.model_dump(), "execution": execution.model_dump()})
