"""Typed job configuration. YAML files in configs/ load into `JobConfig`; unknown keys and out-of-range values are
errors that name the file and the field. Validation happens here once; components trust their section.

One module per concept: `model` (the architecture), `train` (parallelism, data, optimizer, execution, fault
tolerance, checkpoints, control API), `policies` (the live policies), `serve` (`k3ray serve`), `job` (the whole job,
its sections checked against each other), `load` (YAML files and command-line assignments). Every name is imported
from here: `from k3ray.config import JobConfig`.

Notation used across k3ray: E experts, R EP ranks, K top-k, s tokens per rank, d model width (d_model),
d_latent routed-expert width, I expert inner width, L layers.
"""
from k3ray.config.base import ConfigError
from k3ray.config.job import JobConfig, serving_config
from k3ray.config.load import load_config, parse_assignments, parse_config, set_dotted
from k3ray.config.model import ModelConfig
from k3ray.config.policies import (POLICY_NAMES, GuardPolicy, MoonEPPolicy, PoliciesConfig, ReplicationPolicy,
                                   SchedulingPolicy)
from k3ray.config.serve import DEFAULT_STEPWISE_PREFILL_MAX, SERVE_DEFAULTS, ServeConfig
from k3ray.config.train import (ApiConfig, CheckpointConfig, DataConfig, ExecutionConfig, FaultSpec,
                                FaultToleranceConfig, OptimizerConfig, ParallelConfig, TrainConfig)

__all__ = ["ApiConfig", "CheckpointConfig", "ConfigError", "DataConfig", "DEFAULT_STEPWISE_PREFILL_MAX",
           "ExecutionConfig", "FaultSpec", "FaultToleranceConfig", "GuardPolicy", "JobConfig", "ModelConfig",
           "MoonEPPolicy", "OptimizerConfig", "ParallelConfig", "POLICY_NAMES", "PoliciesConfig", "ReplicationPolicy",
           "SchedulingPolicy", "SERVE_DEFAULTS", "ServeConfig", "TrainConfig", "load_config", "parse_assignments",
           "parse_config", "serving_config", "set_dotted"]
