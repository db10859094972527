"""How many prompt tokens a serving iteration may hold (`IterationPacer`, owned by the Scheduler).

Every decoding stream gets one token per iteration, so an iteration's length is the gap between two tokens of every
stream (ITL). A prompt chunk makes its iteration longer by about the same time per token, whatever the model; a
token budget in tokens fits one model and one device only. The pacer measures instead: from the workers' step
seconds of the iterations done, it keeps the time of an iteration without prompt tokens (`base_s`) and the time
each prompt token adds (`per_token_s`), both smoothed, and lets an iteration hold as many prompt tokens as keep it
near `target_s` (serve.iteration_target_ms): at least `floor` (prompts always progress), at most the token budget.
Without a target (CPU by default) every iteration may fill the budget, as before."""
from __future__ import annotations


class IterationPacer:
    def __init__(self, target_s: float | None, budget: int, floor: int, smoothing: float = 0.25):
        self.target_s, self.budget, self.floor, self.smoothing = target_s, budget, min(floor, budget), smoothing
        self.base_s: float | None = None  # an iteration's seconds without prompt tokens
        self.per_token_s: float | None = None  # seconds each prompt token adds

    def prompt_allowance(self) -> int:
        """Prompt tokens (chunks of more than one token) the next iteration may hold on each rank."""
        if self.target_s is None or self.per_token_s is None:
            return self.budget
        room = (self.target_s - (self.base_s or 0.0)) / max(self.per_token_s, 1e-9)
        return int(min(self.budget, max(self.floor, room)))

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """An iteration done: the most prompt tokens any rank held, and the slowest rank's step seconds."""
        if prompt_tokens == 0:
            self.base_s = self._smooth(self.base_s, seconds)
        else:  # before any iteration without prompts, all of it counts against the prompt (an upper bound)
            self.per_token_s = self._smooth(self.per_token_s, max(seconds - (self.base_s or 0.0), 0.0) / prompt_tokens)

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
