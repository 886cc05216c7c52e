"""pycomm's exchange and outer loops under torchft's Manager: replica groups as threads under
an in-process lighthouse (as torchft's integration tests run them), each with a manager of
its own; failures injected and replica groups restarted."""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
from ft_harness import Injected, Replica, run_replicas

import pycomm

pytestmark = pytest.mark.timeout(120)


# --- the exchange ---------------------------------------------------------------------------


def _exchange_means(codec: str, n: int) -> list:
    def fn(replica: Replica) -> tuple:
        replica.user_state(dict, lambda s: None)
        options = {} if codec == "allreduce" else {"block": 64}
        ex = pycomm.Exchange(codec, manager=replica.manager, **options)
        g = torch.Generator().manual_seed(replica.replica_id)
        got = []
        for _ in range(3):
            replica.manager.start_quorum()
            x = torch.randn(1000, generator=g)
            mine = x.clone()
            ex.all_reduce(x, key="x").wait()
            assert ex.should_commit()
            got.append((mine, x))
        return got, ex.stats

    return run_replicas(fn, n, min_replicas=n)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("codec", ["allreduce", "int4"])
def test_the_exchange_averages_across_the_replica_groups(codec: str, n: int) -> None:
    results = _exchange_means(codec, n)
    for step in range(3):
        mean = sum(r[0][step][0] for r in results) / n
        outs = [r[0][step][1] for r in results]
        for out in outs[1:]:
            assert torch.equal(out, outs[0])  # the same bits on every replica group
        if codec == "allreduce":
            torch.testing.assert_close(outs[0], mean)
        else:  # int4 of a unit normal, block 64: about 1/7 of the block's range per element
            err = (outs[0] - mean).abs().max().item()
            assert 0 < err < 0.6
    stats = results[0][1]
    assert stats["commits"] == (3 if codec == "int4" else 0)
    if codec == "int4":
        assert stats["compression"] > 6


def test_a_torchft_group_given_as_process_group_is_refused_naming_manager() -> None:
    def fn(replica: Replica) -> str:
        replica.user_state(dict, lambda s: None)
        with pytest.raises(ValueError, match="manager=manager"):
            pycomm.Exchange("int4", process_group=replica.manager._pg)
        # the same group registered with torch.distributed (one rank to torch): refused too,
        # where it would otherwise run on one rank and average nothing
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            registered = replica.manager._pg.register("pycomm_test")
            with pytest.raises(ValueError, match="manager=manager"):
                pycomm.Exchange("int4", process_group=registered)
        finally:
            torch.distributed.destroy_process_group()
        with pytest.raises(ValueError, match="manager= and process_group="):
            pycomm.Exchange("int4", process_group=object(), manager=replica.manager)
        return "ok"

    assert run_replicas(fn, 1) == ["ok"]


def test_options_that_differ_between_replica_groups_are_refused_on_every_one() -> None:
    def fn(replica: Replica) -> tuple:
        replica.user_state(dict, lambda s: None)
        block = 64 if replica.replica_id == 0 else 32
        ex = pycomm.Exchange("int4", manager=replica.manager, block=block)
        replica.manager.start_quorum()
        x = torch.ones(256) * (replica.replica_id + 1)
        before = x.clone()
        with pytest.raises(ValueError, match=r"different options: option 'block' is (64|32)"):
            ex.all_reduce(x, key="x")
        return torch.equal(x, before), ex.stats.get("residual_bytes", 0)

    assert run_replicas(fn, 2, min_replicas=2) == [(True, 0), (True, 0)]


def test_a_call_that_does_not_commit_leaves_the_residuals_as_they_were() -> None:
    def fn(replica: Replica) -> list:
        replica.user_state(dict, lambda s: None)
        ex = pycomm.Exchange("int4", manager=replica.manager, block=32)
        g = torch.Generator().manual_seed(replica.replica_id)
        seen = []
        for step in range(4):
            replica.manager.start_quorum()
            before = {k: {n: t.clone() for n, t in r.items()}
                      for k, r in ex.state_dict()["residuals"].items()}  # fmt: skip
            ex.all_reduce(torch.randn(300, generator=g), key="x").wait()
            if step == 2:  # the collective's failure, as torchft reports it
                replica.manager.report_error(RuntimeError("injected"))
            ok = ex.should_commit()
            after = ex.state_dict()["residuals"]
            same = before.keys() == after.keys() and all(
                torch.equal(before[k][n], after[k][n]) for k in before for n in before[k]
            )
            seen.append((ok, same))
        return seen

    for seen in run_replicas(fn, 2, min_replicas=2):
        # step 0 starts the residuals; step 2 did not commit: they are as before it
        assert seen == [(True, False), (True, False), (False, True), (True, False)]


def test_a_replica_group_lost_between_calls_changes_the_world_size_and_the_residuals_fit() -> None:
    def fn(replica: Replica) -> tuple:
        replica.user_state(dict, lambda s: None)
        ex = pycomm.Exchange("int4", manager=replica.manager, block=32)
        sizes = []
        for step in range(4):
            if replica.replica_id == 2 and step == 2:
                return sizes, ex.stats["resized"]  # lost: its manager shuts down
            replica.manager.start_quorum()
            sizes.append(replica.manager.num_participants())
            x = torch.full((1000,), float(replica.replica_id))
            ex.all_reduce(x, key="x").wait()
            assert ex.should_commit()
            assert (x - x.mean()).abs().max() < 0.1, x[:4]
        return sizes, ex.stats["resized"]

    results = run_replicas(fn, 3, min_replicas=2)
    assert results[0] == ([3, 3, 2, 2], 1)  # r1 refitted to 2 ranks' chunks once
    assert results[2] == ([3, 3], 0)


# --- the outer loops ------------------------------------------------------------------------


def _build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


_INIT = _build().state_dict()


def _model() -> torch.nn.Module:
    model = _build()
    model.load_state_dict(_INIT)
    return model


def _train(replica: Replica, cls: type, syncs: int, *, fail_at=None, codec="int4",
           fragments=1, commit_fail_at=None, at_step=None, delay=0) -> dict:  # fmt: skip
    """A small model trained under the manager until its step reaches ``syncs``: the
    outer state returned. ``fail_at``: the first attempt raises when the manager's step
    reaches it (between syncs)."""
    # the same start on every replica group (init_sync=False): built from one state, as
    # torch's global seed is shared by the replica groups' threads
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replica.user_state(
        lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
    )
    manager = replica.manager
    if commit_fail_at is not None:  # every replica group's collective fails at that step
        should_commit = manager.should_commit

        def failing(timeout=None):
            if manager.current_step() == commit_fail_at and not failing.done:
                failing.done = True
                manager.report_error(RuntimeError("injected all-reduce failure"))
            return should_commit(timeout)

        failing.done = False
        manager.should_commit = failing
    outer = cls(model, sync_every=4, codec=codec, fragments=fragments, manager=manager,
                delay=delay)  # fmt: skip
    g = torch.Generator().manual_seed(100 + 10 * replica.replica_id + replica.attempt)
    while manager.current_step() < syncs:
        x = torch.randn(16, 8, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        outer.step()
        if fail_at is not None and replica.attempt == 0 and manager.current_step() >= fail_at:
            raise Injected()
        (at_step or {}).get(manager.current_step(), lambda: None)()
    state = outer.state_dict()
    return {"outer": state["outer"], "opt": state["outer_optimizer"], "step": state["step"],
            "stats": outer.stats, "exchange": outer.exchange.stats}  # fmt: skip


def _same_outer(results: list) -> None:
    first = results[0]
    for r in results[1:]:
        for a, b in zip(first["outer"], r["outer"]):
            assert torch.equal(a, b)
        for i, st in first["opt"]["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, r["opt"]["state"][i][k]), (i, k)
        assert r["step"] == first["step"]


@pytest.mark.parametrize(
    "cls,n,fragments",
    [(pycomm.LocalSGD, 3, 1), (pycomm.DiLoCo, 2, 1), (pycomm.DiLoCo, 2, 2)],
)
def test_healthy_outer_loops_under_the_manager_end_bitwise_equal(cls, n, fragments) -> None:
    results = run_replicas(lambda r: _train(r, cls, 4, fragments=fragments), n, min_replicas=n)
    _same_outer(results)
    assert results[0]["stats"]["syncs"] == 4 and results[0]["stats"]["rollbacks"] == 0
    assert results[0]["exchange"]["compression"] > (3 if fragments == 1 else 2.5)


@pytest.mark.parametrize("cls", [pycomm.LocalSGD, pycomm.DiLoCo])
def test_a_replica_group_that_fails_and_rejoins_heals_to_the_peers_outer_state(cls) -> None:
    results = run_replicas(lambda r: _train(r, cls, 6, fail_at=2 if r.replica_id == 1 else None), 2)
    _same_outer(results)
    assert results[1]["exchange"]["heals"] == 1  # the restarted one, from its peer


def test_a_replica_group_that_joins_mid_run_heals_and_ends_bitwise_equal() -> None:
    started = threading.Event()  # replica group 2 starts once the others have synced 3 times
    results = run_replicas(
        lambda r: _train(r, pycomm.DiLoCo, 10, at_step={3: started.set}),
        3,
        start_when={2: started},
    )
    _same_outer(results)
    assert results[2]["exchange"]["heals"] == 1


@pytest.mark.parametrize("delay", [0, 1])
def test_a_commit_failure_on_every_replica_group_rolls_back_and_retries_the_fragment(delay) -> None:
    results = run_replicas(
        lambda r: _train(r, pycomm.DiLoCo, 5, fragments=2, commit_fail_at=2, delay=delay),
        2,
        min_replicas=2,
    )
    _same_outer(results)
    for r in results:
        assert r["stats"]["rollbacks"] == 1 and r["stats"]["syncs"] == 5
        assert r["exchange"]["rollbacks"] == 1


# --- bad input ------------------------------------------------------------------------------


def test_a_manager_with_an_asynchronous_quorum_is_refused_by_the_outer_loops() -> None:
    def fn(replica: Replica) -> str:
        replica.user_state(dict, lambda s: None)
        model = torch.nn.Linear(4, 4)
        with pytest.raises(ValueError, match="use_async_quorum=True"):
            pycomm.DiLoCo(model, sync_every=4, manager=replica.manager)
        return "ok"

    assert run_replicas(fn, 1, use_async_quorum=True) == ["ok"]


def test_the_outer_loops_refuse_a_manager_with_a_process_group_and_a_second_loop() -> None:
    def fn(replica: Replica) -> str:
        replica.user_state(dict, lambda s: None)
        model = torch.nn.Linear(4, 4)
        with pytest.raises(ValueError, match="manager= and process_group="):
            pycomm.LocalSGD(model, sync_every=4, manager=replica.manager, process_group=object())
        with pytest.raises(TypeError, match="expected a torchft.manager.Manager"):
            pycomm.LocalSGD(model, sync_every=4, manager="manager")
        pycomm.LocalSGD(model, sync_every=4, manager=replica.manager)
        with pytest.raises(ValueError, match="one outer loop per manager"):
            pycomm.LocalSGD(model, sync_every=4, manager=replica.manager)
        return "ok"

    assert run_replicas(fn, 1) == ["ok"]


def test_without_torchft_manager_is_an_import_error_naming_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)
    monkeypatch.setitem(sys.modules, "torchft.manager", None)
    with pytest.raises(ImportError, match=r"pycomm\[ft\]"):
        pycomm.Exchange("int4", manager=object())


def test_the_ft_extra_pins_the_torchft_that_make_test_installs_and_runs() -> None:
    import importlib.metadata
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pyproject = open(os.path.join(root, "pyproject.toml")).read()
    pin = re.search(r'^ft = \["torchft==([\d.]+)"\]', pyproject, re.M).group(1)
    assert f'"torchft=={pin}"' in open(os.path.join(root, "Makefile")).read()
    assert importlib.metadata.version("torchft") == pin


def _resumable(replica: Replica, until: int, saved: dict, order: str) -> dict:
    """DiLoCo (H=4, int4) to inner step ``until``; from ``saved[replica_id]`` when given
    (loaded in ``order``), saved there at the end."""
    manager = replica.manager
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replica.user_state(lambda: {}, lambda s: None)
    mine = saved.get(replica.replica_id)
    if mine is not None and order == "model first":
        model.load_state_dict(mine["model"])
    outer = pycomm.DiLoCo(model, sync_every=4, manager=manager)
    if mine is not None:
        if order == "model after":
            model.load_state_dict(mine["model"])
        opt.load_state_dict(mine["opt"])
        manager.load_state_dict(mine["manager"])
        outer.load_state_dict(mine["outer"])
    while outer.step_count < until:
        g = torch.Generator().manual_seed(1000 * replica.replica_id + outer.step_count)
        model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        outer.step()
    saved[replica.replica_id] = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),
        "manager": manager.state_dict(),
        "outer": outer.state_dict(),
    }
    return saved[replica.replica_id]


@pytest.mark.parametrize("order", ["model first", "model after"])
def test_a_replica_group_resumed_mid_window_from_its_checkpoint_is_bitwise(order: str) -> None:
    straight: dict = {}
    run_replicas(lambda r: _resumable(r, 14, straight, order), 2, min_replicas=2)
    halves: dict = {}
    run_replicas(lambda r: _resumable(r, 6, halves, order), 2, min_replicas=2)  # mid-window
    run_replicas(lambda r: _resumable(r, 14, halves, order), 2, min_replicas=2)
    for i in range(2):
        for k, v in straight[i]["model"].items():
            assert torch.equal(v, halves[i]["model"][k]), (i, k)
        for a, b in zip(straight[i]["outer"]["outer"], halves[i]["outer"]["outer"]):
            assert torch.equal(a, b)


def test_outer_loops_that_differ_between_replica_groups_are_refused_on_every_one() -> None:
    def fn(replica: Replica) -> str:
        replica.user_state(dict, lambda s: None)
        model = _model()
        lr = 0.7 if replica.replica_id == 0 else 0.5  # the outer optimizer's lr differs
        outer = pycomm.DiLoCo(
            model, sync_every=2, manager=replica.manager,
            outer_optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True),
        )  # fmt: skip
        before = [p.detach().clone() for p in outer.outer]
        outer.step()
        with pytest.raises(ValueError, match="outer optimizer's options") as err:
            outer.step()
        assert all(torch.equal(a, b) for a, b in zip(before, outer.outer))
        return str(err.value)

    for message in run_replicas(fn, 2, min_replicas=2):
        assert "'lr': 0.7" in message or "'lr': 0.5" in message
