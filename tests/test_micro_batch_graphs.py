"""Training micro-batches as CUDA graphs (k3ray.parallel.micro_batch_graphs): what a replay needs of the step (its
later micro-batches add into the tensors its first made), where they are used, and on a GPU that replayed steps
train exactly as eager ones, a drill's hook included. And a step's micro-batches run ahead, behind the step before
(k3ray.parallel.engine.StepAhead): used when the next call asks for them, redone otherwise, the same either way."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from k3ray.config import ConfigError, ExecutionConfig, load_config
from k3ray.control.local_nodes import free_port
from k3ray.parallel.engine import StageEngine, _clear_step_state, step_state_slots
from k3ray.parallel.micro_batch_graphs import hooked

from conftest import RELEASED, REPO

TINY = REPO / "configs" / "tiny.yaml"
GENERATIONS = itertools.count(1)


@contextlib.contextmanager
def _engine(overrides: dict, device: str = "cpu", backend: str = "gloo"):
    """A one-worker engine of the tiny model with the released features, in its own grid generation (one process
    holds one default group at a time: it leaves before the next engine joins)."""
    cfg = load_config(TINY, {"parallel.pp": 1, "parallel.ep": 1, "train.eval_batches": 1, **RELEASED, **overrides})
    engine = StageEngine(cfg, 0, 0, [0] * cfg.model.n_experts, 1, device)
    engine.init_process_groups(f"tcp://127.0.0.1:{free_port()}", backend, next(GENERATIONS))
    try:
        yield engine
    finally:
        engine.leave_process_groups()


def test_a_steps_later_micro_batches_add_into_the_tensors_its_first_made():
    """A graph of a later micro-batch replays its writes to the addresses it was captured with: every statistic and
    gradient the step accumulates must stay the tensor the first micro-batch made, updated in place."""
    with _engine({"parallel.micro_batches": 2}) as engine:
        _check_in_place(engine)


def _check_in_place(engine: StageEngine) -> None:
    _clear_step_state(engine.stage, engine.params.values())
    engine._micro_batch(engine.batches.micro_batch(0, 0), 0.5)
    slots = step_state_slots(engine.stage, engine.params.values())
    first = [getattr(obj, name) for obj, name in slots]
    # the statistics all, the gradients but the first AttnRes read's (one value to mix: its weights get none)
    assert all(t is not None for (obj, name), t in zip(slots, first) if name != "grad")
    assert sum(t is None for t in first) == 2
    values = [None if t is None else t.clone() for t in first]
    engine._micro_batch(engine.batches.micro_batch(0, 1), 0.5)
    after = [getattr(obj, name) for obj, name in slots]
    for (obj, name), a, b in zip(slots, first, after):
        assert b is a and (a is None or b.data_ptr() == a.data_ptr()), f"{type(obj).__name__}.{name}"
    counts = [i for i, (obj, name) in enumerate(slots) if name == "routed_count"]
    assert counts and all(float(after[i]) == 2 * float(values[i]) for i in counts)
    # (AttnRes norms start with zero gradients: their pseudo-queries are zero at init)
    grads = [i for i, (obj, name) in enumerate(slots) if name == "grad" and after[i] is not None and after[i].any()]
    assert len(grads) > 20 and all(not torch.equal(values[i], after[i]) for i in grads)


def test_micro_batches_replay_as_graphs_by_default_on_cuda_only():
    assert load_config(TINY).execution.graph_micro_batches is None
    assert ExecutionConfig().graphs_micro_batches("cuda") and not ExecutionConfig().graphs_micro_batches("cpu")
    assert not ExecutionConfig(graph_micro_batches=False).graphs_micro_batches("cuda")
    with pytest.raises(ConfigError, match=r"execution.graph_micro_batches: CUDA only"):
        load_config(TINY, {"execution.graph_micro_batches": True})
    with _engine({}) as engine:
        assert engine.graphs is None  # a CPU worker steps eagerly


def test_a_drills_forward_hook_keeps_the_step_eager():
    """Fault drills inject through forward hooks, which a replay would skip."""
    with _engine({}) as engine:
        assert not hooked(engine.stage)
        moe = next(iter(engine.stage.moe_layers().values()))
        handle = moe.experts.register_forward_hook(lambda mod, args, out: out)
        assert hooked(engine.stage)
        handle.remove()
        assert not hooked(engine.stage)


def _run(overrides: dict, ahead: bool = False) -> tuple[list[dict], dict[str, torch.Tensor], bool]:
    """Six steps (a drill's hook on the embedding in step 3; new storage for the embedding before step 4, as a
    restore may give), each announcing the next batch with `ahead` -> the reports, the weights, whether the graphs
    were captured again after the new storage."""
    with _engine(overrides, "cuda", "nccl") as engine:
        def step_(step: int) -> dict:
            return engine.train_step(step, step, step + 1 if ahead and step < 5 else None)

        reports = [step_(step) for step in range(3)]
        handle = engine.stage.embed.register_forward_hook(lambda mod, args, out: out)
        reports.append(step_(3))  # the step ahead queued without the hook is redone with it
        handle.remove()
        key = engine.graphs.key if engine.graphs else None
        with torch.no_grad():
            engine.stage.embed.weight = torch.nn.Parameter(engine.stage.embed.weight.clone())
        engine._refresh_params()
        reports += [step_(step) for step in range(4, 6)]
        recaptured = engine.graphs is not None and not engine.graphs.off and engine.graphs.key not in (None, key)
        weights = {n: p.detach().cpu() for n, p in engine.params.items()}
    return [{k: v for k, v in r.items() if k != "timings"} for r in reports], weights, recaptured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replayed_micro_batches_train_exactly_as_eager_steps():
    """Three micro-batches a step (the later-micro-batch graph replayed twice), the released features, MLA layers
    (KDA's kernels would autotune for the tiny heads first): reports and weights equal bit for bit, including a step
    a drill's hook makes eager and a capture again after the parameters' storage changed; and so with each step's
    micro-batches replayed a step ahead, behind the optimizer of the step before."""
    common = {"parallel.device": "cuda", "parallel.micro_batches": 3, "execution.compile_blocks": False,
              "model.mla_layers": [0, 1, 2, 3]}
    eager, eager_weights, _ = _run({**common, "execution.graph_micro_batches": False, "execution.step_ahead": False})
    graphed, graphed_weights, recaptured = _run({**common, "execution.step_ahead": False})
    ahead, ahead_weights, _ = _run(common, ahead=True)  # replayed, each step's micro-batches queued a step ahead
    assert recaptured
    assert graphed == eager and ahead == eager
    for name, w in eager_weights.items():
        assert torch.equal(graphed_weights[name], w), name
        assert torch.equal(ahead_weights[name], w), name


def _steps_with_changes(engine: StageEngine, ahead: bool) -> list[dict]:
    """Six steps as a controller would call them, announcing the next batch (`ahead`) or not: step 2 runs another
    batch than announced (a skip), an evaluation comes before step 3 (any other call discards the step ahead, as
    the Worker does), step 4 runs with a drill's hook (eager, never ahead), step 5 is the last."""
    plan = [(0, 0, 1), (1, 1, 2), (2, 5, 6), (3, 6, 7), (4, 7, 8), (5, 8, None)]
    reports = []
    for step, batch, next_batch in plan:
        handle = None
        if step == 3:
            engine.discard_ahead()
            engine.evaluate()
        if step == 4:
            engine.discard_ahead()
            handle = engine.stage.embed.register_forward_hook(lambda mod, args, out: out)
        reports.append(engine.train_step(step, batch, next_batch if ahead else None))
        if handle is not None:
            handle.remove()
    return reports


def test_steps_run_ahead_train_exactly_as_steps_that_do_not():
    """The step ahead is the same work queued earlier: the same reports and weights bit for bit, however the calls
    change between steps; it is used when the next call asks for it, and only then."""
    common = {"parallel.micro_batches": 2}
    with _engine({**common, "execution.step_ahead": False}) as engine:
        want = _steps_with_changes(engine, ahead=False)
        want_weights = {n: p.detach().clone() for n, p in engine.params.items()}
    with _engine({**common, "execution.step_ahead": True}) as engine:
        runs = []
        micro_batches = engine._micro_batches
        engine._micro_batches = lambda batch, *args: runs.append(batch) or micro_batches(batch, *args)
        got = _steps_with_changes(engine, ahead=True)
        assert engine.ahead is None  # the last step announces none
        weights = {n: p.detach() for n, p in engine.params.items()}
    # the steps whose micro-batches ran ahead say so (their host seconds there)
    assert [r["timings"]["run_ahead"] > 0 for r in got] == [False, True, False, False, False, False]
    assert all(r["timings"]["run_ahead"] == 0 for r in want)
    assert [{k: v for k, v in r.items() if k != "timings"} for r in got] == \
        [{k: v for k, v in r.items() if k != "timings"} for r in want]
    for name, w in want_weights.items():
        assert torch.equal(weights[name], w), name
    # step 0, then ahead: 1 (used), 2 (step 2 ran batch 5 instead), 5 (used), 6 (discarded: the evaluation), 6
    # again, 7 (discarded: the hook), 7 eagerly with the hook (which runs nothing ahead), 8 by step 5 itself
    assert runs == [0, 1, 2, 5, 6, 6, 7, 7, 8]


def test_steps_run_ahead_by_default_on_cuda_only():
    assert load_config(TINY).execution.step_ahead is None
    assert ExecutionConfig().steps_ahead("cuda") and not ExecutionConfig().steps_ahead("cpu")
    assert not ExecutionConfig(step_ahead=False).steps_ahead("cuda")
    with _engine({}) as engine:
        engine.train_step(0, 0, 1)
        assert engine.ahead is None  # a CPU worker does not run ahead
