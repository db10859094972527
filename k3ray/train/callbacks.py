"""Hooks into the controller's life. What the job shows to the outside (the control API, metrics) are callbacks that
the control layer hands to the controller when it starts it (k3ray.control), so the controller never imports them;
`notify` calls a hook on each. The console's share (`ConsoleWarnings`) rides back on the controller's answers."""
from __future__ import annotations


class Callback:
    """Every hook is optional; the controller calls them in the order the callbacks were given."""

    def on_start(self, ctrl) -> None:
        """The workers are up and the job is running."""

    def on_step(self, ctrl, report: dict, wall_s: float) -> None:
        """A step was accepted (after any rollback or recovery); wall_s is the controller's time for it."""

    def on_snapshot(self, stall_s: float) -> None:
        """An in-memory snapshot was committed; training stalled stall_s for it."""

    def on_checkpoint(self, step: int, path, parts: list, seconds: float) -> None:
        """A durable checkpoint was committed."""

    def on_shutdown(self, ctrl) -> None:
        """The job is stopping (before the workers are closed)."""

    def status(self) -> dict:
        """Fields this callback adds to the controller's status view."""
        return {}


def notify(callbacks: list[Callback], hook: str, *args) -> None:
    """Call `hook` on every callback, in order."""
    for callback in callbacks:
        getattr(callback, hook)(*args)


class ConsoleWarnings:
    """Warnings not yet handed to the driver, which shows them on the user's console: what was appended since the
    last `new` to lists that only grow (the checkpoints' and the snapshots' warnings)."""

    def __init__(self, *sources: list[str]):
        self.sources, self.shown = sources, [0] * len(sources)

    def new(self) -> list[str]:
        out = []
        for i, source in enumerate(self.sources):
            out += source[self.shown[i]:]
            self.shown[i] = len(source)
        return out
