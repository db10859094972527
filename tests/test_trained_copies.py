"""Copies of hot experts in training, Ray-free over gloo: tokens of a copied expert are split over its holders, the
copies' gradients go home (the optimizer state stays there) and the copies are fetched again after each optimizer
step, so float64 training with copies (and with the copy table switched at a step boundary) gives the losses and
weights of training without them."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from k3ray.config import load_config
from k3ray.control.local_nodes import free_port
from k3ray.parallel.engine import StageEngine

EP, STEPS = 2, 3
# step -> the copy table set at that step's boundary (R lists of expert ids held as copies; homes: 0-7 on rank 0)
TABLES = {0: [[9, 12], [0, 1]], 2: [[], [3]]}
# MoonEP off: without copies every expert is computed at home, so the copies visibly move load
TINY = {"parallel.pp": 1, "parallel.ep": EP, "model.dtype": "float64", "model.n_layers": 2, "data.seq_len": 32,
        "data.micro_batch_size": 2, "train.eval_every": 0, "train.steps": STEPS, "policies.moonep.enabled": False}

EXPERT_BYTES = (32 * 2 * 32 + 32 * 32) * 8 * 2  # w1 [d_latent, 2I] + w2 [I, d_latent], float64, 2 MoE layers


def _train(rank: int, ports: list[int], out: str) -> None:
    torch.set_num_threads(1)
    runs = [_run(rank, port, tables) for port, tables in zip(ports, ({}, TABLES))]
    torch.save(runs, f"{out}/{rank}.pt")


def _run(rank: int, port: int, tables: dict) -> dict:
    cfg = load_config("configs/tiny.yaml", TINY)
    home = [e * EP // cfg.model.n_experts for e in range(cfg.model.n_experts)]
    engine = StageEngine(cfg, 0, rank, home, EP)
    engine.init_process_groups(f"tcp://127.0.0.1:{port}", "gloo")
    try:
        losses, fetched, rank_load = [], [], []
        for step in range(STEPS):
            if step in tables:
                fetched.append(engine.copies.set_trained(tables[step]))
            report = engine.train_step(step, step)
            losses.append(report["loss"])
            rank_load.append(report["rank_load"])
        held = {layer: moe.experts.copies for layer, moe in engine.stage.moe_layers().items()}
        copies = {layer: None if c is None else (c.expert_ids, c.w1.detach().clone(), c.w2.detach().clone())
                  for layer, c in held.items()}
        state = engine.state_dict()
        return {"losses": losses, "state": state, "fetched": fetched, "copies": copies, "rank_load": rank_load,
                "opt_keys": sorted(engine.opt.state)}
    finally:
        dist.destroy_process_group()


def expert_rows(state: dict) -> dict:
    return {(layer, e, k): payload[k][row] for layer, payload in state["experts"].items()
            for row, e in enumerate(payload["expert_ids"]) for k in ("w1", "w2", "exp_avg_w1", "exp_avg_sq_w2")
            if k in payload}


def test_float64_training_with_copies_equals_training_without(tmp_path):
    torch.multiprocessing.spawn(_train, args=([free_port(), free_port()], str(tmp_path)), nprocs=EP, join=True)
    runs = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(EP)]
    plain, copied = [r[0] for r in runs], [r[1] for r in runs]
    assert plain[0]["losses"] == plain[1]["losses"]
    for rank in range(EP):
        assert copied[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-12, abs=0)
        a, b = expert_rows(plain[rank]["state"]), expert_rows(copied[rank]["state"])
        assert a.keys() == b.keys() and any(k[2] == "w1" for k in a)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-12, msg=str(key))
        for name, t in plain[rank]["state"]["dense"].items():
            torch.testing.assert_close(copied[rank]["state"]["dense"][name], t, rtol=0, atol=1e-12, msg=name)
        assert copied[rank]["opt_keys"] == plain[rank]["opt_keys"]  # no optimizer state for a copy
        assert copied[rank]["fetched"][0] > 0 and copied[rank]["fetched"][1] == (EXPERT_BYTES if rank else 0)
    # the copies were used: part of the hot experts' rows left their homes, which leveled the ranks' loads
    before, after = plain[0]["rank_load"][0], copied[0]["rank_load"][0]
    assert all(sum(after[layer]) == sum(before[layer]) for layer in before)
    assert sum(max(a) for a in after.values()) < sum(max(b) for b in before.values()), (before, after)
    # after the last optimizer step the copy on rank 1 equals its home's weights (fetched again)
    home_rows = expert_rows(copied[0]["state"])
    for layer, held in copied[1]["copies"].items():
        ids, w1, _ = held
        assert ids == [3]
        torch.testing.assert_close(w1[0], home_rows[(layer, 3, "w1")], rtol=0, atol=0)
    assert all(c is None for c in copied[0]["copies"].values())


class RecordingGroup:
    """The worker group's calls that placement makes, recorded (no workers: shards carry no layers here)."""

    def __init__(self):
        self.calls, self.home = [], None

    def call(self, method, *args):
        self.calls.append((method, args))
        return []

    def call_each(self, method, args):
        self.calls.append((method, args))
        return {rank: {} for rank in args}


def test_the_controllers_placement_puts_copies_of_hot_experts_in_spare_slots_and_forgets_them_on_reset():
    from k3ray.train.placement import Placement

    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 4,
                                            "policies.replication.spare_slots_per_rank": 2})
    placement = Placement(cfg)
    E = cfg.model.n_experts
    placement.load_history = torch.tensor([1.0 / (e + 1) ** 1.2 for e in range(E)], dtype=torch.float64)
    group = RecordingGroup()
    moved, table = placement.rebalance(group)
    assert any(table) and table == placement.copies
    assert all(len(c) <= 2 and all(placement.home[e] != r for e in c) for r, c in enumerate(table))
    assert group.calls[-1] == ("set_trained_copies", (table,))
    view = placement.view(None)
    assert view["copies"] == table and any(len(h) > 1 for h in view["holders"])
    calls = len(group.calls)
    assert placement.rebalance(group) == ([], table) and len(group.calls) == calls  # same load: nothing moves
    placement.reset(2, [e * 2 // E for e in range(E)])
    assert placement.copies == [[], []]  # a new grid holds none
