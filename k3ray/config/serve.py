"""`k3ray serve`'s section: cache pools, the iteration's token budget and the front door's limits, with the
device's defaults."""
from __future__ import annotations

from pydantic import Field

from k3ray.config.base import Section


# serving defaults by device: a GPU batches as vLLM / SGLang do on an H200 (8,192 tokens per iteration, pools from
# free memory); the CPU keeps iterations small (its tests and demos stay fast)
SERVE_DEFAULTS = {"cpu": {"token_budget": 128, "slots_per_rank": 16, "pages_per_rank": 256},
                  "gpu": {"token_budget": 8192, "slots_per_rank": 256, "pages_per_rank": None}}
PROMPT_TOKENS_FLOOR = 256  # prompt tokens an iteration may always hold, however long its decode rows take
DEFAULT_STEPWISE_PREFILL_MAX = 64
# KDA's chunk: fla's on GPUs, the torch reference's on CPU (k3ray.kernels.kda.CHUNK); the prefix cache checkpoints
# the states at multiples of it by default
KDA_CHUNK = {"cpu": 16, "gpu": 64}


class ServeConfig(Section):
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
    iteration_target_ms: float | None = Field(None, gt=0, description="the length an iteration aims at (every "
                                              "decoding stream waits one iteration per token): it holds as many "
                                              "prompt tokens as keep it near this, fitted on the iterations before; "
                                              "default none (the token budget alone: while an iteration with prompt "
                                              "chunks costs a fixed ~15 ms on an H200, pacing costs throughput)")
    gpu_memory_fraction: float = Field(0.8, gt=0, le=1, description="GPUs: the part of the memory free once the "
                                       "weights are loaded that the latent-KV pages may take (the rest: activations "
                                       "of a full iteration, CUDA graphs)")
    stepwise_prefill_max: int | None = Field(None, ge=0, description="prompts of at most this many tokens are fed "
                                             "one token per iteration as decode rows, so their iterations replay "
                                             "the decode CUDA graph instead of running a prefill chunk eagerly (and, "
                                             "where it is > 0, so are runs of forced output no longer than the "
                                             "rank's rows in an iteration that decodes only); "
                                             f"default {DEFAULT_STEPWISE_PREFILL_MAX} on GPUs where the grid starts "
                                             "with ep=1 (decode graphs), 0 (chunks only) elsewhere")
    overlap: bool | None = Field(None, description="schedule iteration n+1 while the workers run n (two "
                                 "iterations in flight; n+1 takes n's sampled tokens on the device): the engine's "
                                 "host time per iteration hidden behind the step; default on where parallel.pp=1, "
                                 "the only layout it supports (the last stage samples, the first reads the tokens)")
    graphs_at_start_s: float = Field(3.0, ge=0, description="GPU: seconds a grid's start may spend capturing "
                                     "decode CUDA graphs, greedy before sampled, short contexts and small batches "
                                     "first (a grid started after traffic, as a recovery's: those of the shapes "
                                     "traffic used, most used first, and no others; else then as long again for "
                                     "the prompt graphs' token buckets, smallest first); the rest are captured on "
                                     "first use (that iteration waits for its capture, ~70 ms)")
    max_waiting: int = Field(64, ge=0, description="queued requests beyond which new ones get 429")
    max_tokens: int = Field(256, gt=0, description="largest max_tokens a request may ask for")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429 and of a 503 while no grid serves")
    stream_interval: int = Field(1, gt=0, description="new tokens a stream sends per event after its first token "
                                                     "(its last event may hold fewer): fewer, larger events when "
                                                     "the HTTP path, not the GPU, sets the pace")
    recovery_attempts: int = Field(2, ge=1, description="grid recoveries tried after a loss (each planning up to 3 "
                                                        "times) before the grid is relaunched from the weights")
    recovery_backoff_s: float = Field(1.0, ge=0, le=60, description="wait before the 2nd attempt, doubling after")
    grammar_compile_s: float = Field(10.0, gt=0, description="how long a request's grammar (response_format, a "
                                     "required tool call) may take to compile; longer, the request is refused (400)")
    prefix_cache: bool = Field(True, description="share the caches of common prompt prefixes between requests: "
                               "latent pages by block, KDA states checkpointed every prefix_state_every tokens; a "
                               "request starts its prefill at the deepest boundary it shares with a cached prefix")
    prefix_cache_bytes: int | None = Field(None, gt=0, description="bytes per data-parallel rank the prefix cache "
                                           "may keep (all stages): KDA state checkpoints, each with the latent pages "
                                           "of the prefix_state_every tokens before it; default as many "
                                           "checkpoints as serve.slots_per_rank (the checkpoints are allocated "
                                           "beside the state slots; cached pages live in the page pool and are "
                                           "evicted, least recently used first, when requests need them)")
    prefix_state_every: int | None = Field(None, gt=0, description="tokens between the prefix cache's KDA state "
                                           "checkpoints, a multiple of serve.page_size; default KDA's chunk: 64 on "
                                           "GPUs (fla's), 16 on CPU (the torch reference's), rounded up to whole pages")
    unavailable_wait_s: float = Field(30.0, ge=0, description="while no grid serves, how long a new request waits "
                                                              "(then 503) and a stream in flight (then an error), "
                                                              "for a stream counted from the recovery's last phase")

    def resolved(self, device: str = "cpu", ep: int = 1) -> "ServeConfig":
        """This config with its unset sizes filled for `device` ('cpu', 'cuda') and a grid of `ep` EP ranks. On a
        GPU pages_per_rank stays unset: the grid measures it when it starts (k3ray.serve.grid)."""
        kind = "cpu" if device == "cpu" else "gpu"
        defaults = SERVE_DEFAULTS[kind]
        update = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        if self.prefix_state_every is None:
            update["prefix_state_every"] = -(-KDA_CHUNK[kind] // self.page_size) * self.page_size
        elif self.prefix_state_every % self.page_size:
            raise ValueError(f"serve.prefix_state_every={self.prefix_state_every} is not a multiple of "
                             f"serve.page_size={self.page_size}: checkpoints sit on page boundaries")
        if self.stepwise_prefill_max is None:
            update["stepwise_prefill_max"] = DEFAULT_STEPWISE_PREFILL_MAX if device != "cpu" and ep == 1 else 0
        return self.model_copy(update=update)
