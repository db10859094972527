"""How many prompt tokens a serving iteration may hold (`IterationPacer`, owned by the Scheduler).

Every decoding stream gets one token per iteration, so an iteration's length is the gap between two tokens of every
stream (ITL). An iteration that holds prompt chunks costs a fixed part (it runs eagerly, decode rows included) plus a
part per prompt token, whatever the model; a token budget in tokens fits one model and one device only. The pacer
measures instead: over the iterations with prompt chunks done so far (recent ones weigh more), it fits their step
seconds as `fixed_s + per_token_s * prompt tokens` and lets an iteration hold as many prompt tokens as keep it near
`target_s` (serve.iteration_target_ms): at least `floor` (prompts always progress), at most the token budget. Where
the fixed part alone reaches the target, no allowance meets it, and the budget is used whole (the iterations are
that long anyway: fewer of them serve more). Without a target every iteration may fill the budget."""
from __future__ import annotations


class IterationPacer:
    def __init__(self, target_s: float | None, budget: int, floor: int, memory: float = 0.9):
        self.target_s, self.budget, self.floor, self.memory = target_s, budget, min(floor, budget), memory
        # exponentially weighted sums over iterations with prompt tokens n and step seconds t: 1, n, n^2, t, n t
        self.sums = [0.0] * 5

    def fit(self) -> tuple[float, float] | None:
        """(fixed_s, per_token_s) of an iteration with prompt chunks, from the iterations seen; None before any."""
        w, n, nn, t, nt = self.sums
        if w == 0:
            return None
        spread = w * nn - n * n
        if spread <= 1e-9 * max(w * nn, 1e-30):  # one prompt size seen so far: all of the time per token
            return 0.0, t / n
        per_token = max((w * nt - n * t) / spread, 0.0)
        return max((t - per_token * n) / w, 0.0), per_token

    def prompt_allowance(self) -> int:
        """Prompt tokens (chunks of more than one token) the next iteration may hold on each rank."""
        fit = None if self.target_s is None else self.fit()
        if fit is None:
            return self.budget
        fixed, per_token = fit
        if fixed + per_token * self.floor >= self.target_s:
            return self.budget
        return int(min(self.budget, max(self.floor, (self.target_s - fixed) / max(per_token, 1e-12))))

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """An iteration done: the most prompt tokens any rank held, and the slowest rank's step seconds."""
        if prompt_tokens == 0:  # decode rows alone replay CUDA graphs: another cost, not this fit's
            return
        n = float(prompt_tokens)
        self.sums = [self.memory * s + x for s, x in zip(self.sums, (1.0, n, n * n, seconds, n * seconds))]


def paced_chunk(n: int, prompt_tokens_left: int) -> int:
    """A prompt chunk of n > 1 tokens cut to the iteration's prompt tokens left; 0 (no row) where fewer than two
    are left and it was the pacing that cut it (a one-token chunk would cost a decode row for one prompt token)."""
    return n if n <= prompt_tokens_left else (prompt_tokens_left if prompt_tokens_left > 1 else 0)
