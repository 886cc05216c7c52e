"""``python -m pycomm.bench.ft`` in small: three replica groups as processes under a torchft
lighthouse, a small charlm model, H=10; one replica group killed in the middle of a window and
again during a sync, restarted each time. Every replica group must finish, end with the same
outer parameters, and the survivors must never have waited longer than the manager's
timeout and a margin. The same with ``--ddp`` (per-step int8 DDP across the replica groups,
one kill in the middle of a step). Speed itself is not asserted."""

from __future__ import annotations

import pytest

from pycomm.bench import ft

# the survivors' slowest step may exceed the manager's timeout (and the lighthouse's wait for
# a straggler, the same) by this much (seconds): a healthy step, and a loaded machine's
# scheduling
MARGIN_S = 3.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_group_killed_twice_heals_and_every_one_ends_bitwise_equal(tmp_path):
    pytest.importorskip("torchft.manager")
    plan = ft.Plan(
        run="kill", outer="diloco", codec="int4", replicas=3, steps=300, sync_every=10,
        seed=0, d_model=32, layers=1, lr=3e-3, timeout_s=10.0, quorum_timeout_s=60.0,
    )  # fmt: skip
    doc = ft.run_bench(plan, ["kill"], run_timeout=200, log_dir=str(tmp_path))
    run = doc["runs"]["kill"]
    replicas = run["replicas"]
    assert all(r["digest"] and r["loss"] is not None for r in replicas), replicas  # all finished
    assert run["digests_equal"], [r["digest"] for r in replicas]
    assert [k["kind"] for k in run["kills"]] == ["mid-window", "in-sync"], run["kills"]
    assert all(k["healed"] for k in run["kills"]), run["kills"]
    victim = replicas[1]
    assert victim["processes"] == 3 and victim["heals"] >= 1, victim
    assert run["survivors"] == [0, 2]
    slowest = run["steps"]["slowest_s"]
    assert slowest <= plan.timeout_s + MARGIN_S, run["steps"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_a_replica_group_killed_mid_step_heals_and_every_one_ends_bitwise_equal(tmp_path):
    pytest.importorskip("torchft.manager")
    plan = ft.Plan(
        run="kill", outer=ft.DDP, codec="int8", replicas=3, steps=60, sync_every=1, seed=0,
        d_model=32, layers=1, lr=3e-3, timeout_s=10.0, quorum_timeout_s=60.0,
    )  # fmt: skip
    doc = ft.run_bench(plan, ["kill"], run_timeout=150, log_dir=str(tmp_path))
    run = doc["runs"]["kill"]
    replicas = run["replicas"]
    assert all(r["digest"] and r["loss"] is not None for r in replicas), replicas  # all finished
    assert all(r["manager_step"] == plan.steps for r in replicas), replicas
    assert run["digests_equal"], [r["digest"] for r in replicas]
    assert [k["kind"] for k in run["kills"]] == ["in-step"], run["kills"]
    assert run["kills"][0]["step"] == ft.ddp_kill_step(plan.steps), run["kills"]
    assert run["kills"][0]["healed"], run["kills"]
    victim = replicas[1]
    assert victim["processes"] == 2 and victim["heals"] >= 1, victim
    assert run["survivors"] == [0, 2]
    slowest = run["steps"]["slowest_s"]
    assert slowest <= plan.timeout_s + MARGIN_S, run["steps"]


def test_the_kills_are_refused_where_they_cannot_happen(capsys):
    for argv, message in [
        (["--runs", "kill"], "--runs kill: give --kill too"),
        (["--kill", "--replicas", "2"], "expected --replicas >= 3"),
        (["--kill", "--steps", "100", "--sync-every", "50"], "--steps >= 8 x --sync-every"),
        (["--steps", "120", "--sync-every", "50"], "expected a multiple of --sync-every"),
        (["--ddp", "--kill", "--steps", "10"], "expected --steps >= 20 with --ddp"),
        (["--ddp", "--sync-every", "5"], "--sync-every with --ddp: expected none"),
        (["--ddp", "--outer", "localsgd"], "--outer with --ddp: expected none"),
    ]:
        with pytest.raises(SystemExit) as info:
            ft.main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_the_kill_steps_fall_mid_window_and_on_a_sync():
    mid, sync = ft.kill_steps(1000, 50)
    assert mid % 50 == 25 and sync % 50 == 0 and mid < sync < 1000
    assert ft.kill_steps(300, 10) == (75, 170)
