"""hierarchy="node": 4 gloo ranks seen as 2 nodes x 2 ranks through torchrun's variables
(GROUP_RANK, GROUP_WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), set inside each rank for one
job and restored after it. Every hook with node, flat and auto side by side on the same data."""

import contextlib
import copy
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_harness import model as _model
from ddp_harness import nodes as _nodes
from harness import errors_of, run_ranks

import pycomm
from pycomm.codec.groups import group_timeout
from pycomm.topology import set_nodes

HOOKS = ["allreduce", "fp16", "bf16", "int8", "onebit"]


def _grads(module):
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def _rank_compare(hook, steps):
    """Per step and hierarchy: the reduced gradient, its relative error against the exact
    fp32 mean of the ranks' gradients, and the state's stats."""
    with _nodes([0, 0, 1, 1]):
        g = torch.Generator().manual_seed(dist.get_rank())
        data = [
            (torch.randn(16, 40, generator=g), torch.randn(16, 3, generator=g))
            for _ in range(steps)
        ]
        plain = _model()
        models = {
            h: pycomm.wrap(_model(), hook=hook, hook_options={"hierarchy": h}, bucket_cap_mb=0.003)
            for h in ("node", "flat", "auto")
        }
        ddp_ref = torch.nn.parallel.DistributedDataParallel(_model())
        out = {h: [] for h in (*models, "ddp")}
        for x, y in data:
            plain.zero_grad()
            torch.nn.functional.mse_loss(plain(x), y).backward()
            local = _grads(plain).double()
            everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, local)
            exact = torch.stack(everyone).mean(0)
            for h, m in [*models.items(), ("ddp", ddp_ref)]:
                m.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                got = _grads(m.module)
                err = float((got.double() - exact).norm() / exact.norm())
                out[h].append((got, err))
        states = {h: pycomm.hook_state(m) for h, m in models.items()}
        return (
            out,
            {h: dict(s.stats) for h, s in states.items()},
            {h: s.node_plan is not None for h, s in states.items()},
            {h: s.fingerprint()["topology"] for h, s in states.items()},
        )


@pytest.mark.parametrize("hook", HOOKS)
def test_node_flat_auto(hook):
    steps = 5
    results = run_ranks(_rank_compare, 4, hook, steps, timeout=180)
    out, stats, resolved, topo = results[0]
    assert resolved == {"node": True, "flat": False, "auto": True}
    assert topo["node"] == topo["auto"] == "node: 2 nodes x 2 ranks" and topo["flat"] == "flat"
    for r in results[1:]:  # every rank holds the same bits
        for h in out:
            for (a, _), (b, _) in zip(out[h], r[0][h]):
                assert torch.equal(a, b), (h, r)
    for (node, _), (auto, _) in zip(out["node"], out["auto"]):
        assert torch.equal(node, auto)
    ddp = [got for got, _ in out["ddp"]]
    if hook == "allreduce":
        for h in ("node", "flat"):
            for (got, _), ref in zip(out[h], ddp):
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
        return
    # Compressed steps (after the 2 exact warm-up steps). Across 2 nodes the exchange averages
    # 2 node means instead of 4 gradients, each quantized once: the expected error is the
    # same; on 40-wide layers it lands within a few % either way (onebit's is large by nature).
    node_err = [e for _, e in out["node"][2:]]
    flat_err = [e for _, e in out["flat"][2:]]
    assert all(0 < e < 1.5 * f for e, f in zip(node_err, flat_err)), (node_err, flat_err)
    # warm-up steps are exact up to fp32 rounding
    for (got, _), ref in zip(out["node"][:2], ddp[:2]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    s_node, s_flat = stats["node"], stats["flat"]
    assert s_node["bytes_intra"] + s_node["bytes_inter"] == s_node["bytes_sent"]
    assert s_node["bytes_fp32"] == s_flat["bytes_fp32"]
    assert s_node["steps"] == s_flat["steps"] == steps
    # the codec's own ratio: the cross-node exchange alone under the hierarchy, against an
    # fp32 ring across the nodes; the format's ratio either way (padding apart)
    if hook == "onebit":  # still warming up (start_iter=20): no compressed exchange yet
        assert s_node["codec_bytes_sent"] == s_flat["codec_bytes_sent"] == 0
        return
    assert 0 < s_node["codec_bytes_sent"] < s_node["bytes_inter"]
    assert s_node["codec_compression"] > 1.5 * s_node["compression"]
    assert abs(s_node["codec_compression"] / s_flat["codec_compression"] - 1) < 0.1


def _rank_resume(hook, k, m, accumulate, path):
    with _nodes([0, 0, 1, 1]):
        g = torch.Generator().manual_seed(dist.get_rank())
        data = [
            (torch.randn(8, 40, generator=g), torch.randn(8, 3, generator=g)) for _ in range(k + m)
        ]

        def build(hierarchy="auto"):  # auto: node on 2 nodes x 2 ranks
            ddp = pycomm.wrap(
                _model(), hook=hook, hook_options={"hierarchy": hierarchy},
                accumulate_steps=accumulate, bucket_cap_mb=0.004,
            )  # fmt: skip
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            return ddp, opt, pycomm.TrainLoop(ddp, opt, max_grad_norm=0.5)

        def train(loop, ddp, batches):
            for x, y in batches:
                for _ in range(accumulate):
                    loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))

        ddp, opt, loop = build()
        train(loop, ddp, data)
        straight = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
        norm = loop.last_grad_norm

        ddp, opt, loop = build()
        train(loop, ddp, data[:k])
        pycomm.checkpoint.save(path, ddp, opt)  # every rank's hook state, rank 0 writes
        ddp, opt, loop = build()
        pycomm.checkpoint.load(path, ddp, opt)
        train(loop, ddp, data[k:])
        resumed = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
        saved = pycomm.checkpoint.gather_hook_state(ddp)

        with _nodes([0, 0, 0, 0]):  # the same job seen as one node: auto runs flat
            flat, _, _ = build()
        try:
            pycomm.checkpoint.load_hook_state(flat, saved)
            refused = None
        except ValueError as e:
            refused = str(e)
        return straight, resumed, norm, loop.last_grad_norm, refused


@pytest.mark.parametrize("hook, accumulate", [("int8", 1), ("onebit", 2), ("allreduce", 1)])
def test_resume_bitwise(hook, accumulate, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    results = run_ranks(_rank_resume, 4, hook, 4, 3, accumulate, path, timeout=180)
    for straight, resumed, norm, norm2, refused in results:
        assert torch.equal(straight, resumed)
        assert torch.equal(straight, results[0][0])
        assert math.isfinite(norm) and norm == norm2 == results[0][2]
        assert (
            "topology" in refused and "node: 2 nodes x 2 ranks" in refused and "'flat'" in refused
        )


def _rank_errors(layout, hierarchy, hook, nodes=None, launcher="torchrun"):
    with _nodes(layout, launcher):
        try:
            if nodes is not None:
                pycomm.init(nodes=nodes)
            ddp = pycomm.wrap(_model(), hook=hook, hook_options={"hierarchy": hierarchy})
        except ValueError as e:
            return "error: " + str(e)
        finally:
            set_nodes(None)
        state = pycomm.hook_state(ddp)
        x = torch.randn(4, 40)
        for _ in range(3):
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        return state.node_plan is not None, _grads(ddp.module)


@pytest.mark.parametrize(
    "layout, hierarchy, hook, nodes, message",
    [
        ([0, 0, 0, 1], "node", "int8", None, "hierarchy='node' needs the same number of ranks"),
        ([0, 0, 0, 0], "node", "allreduce", None, "more than one node"),
        ([0, 1, 2, 3], "node", "bf16", None, "1 rank(s)"),
        ([0, 0, 1, 1], "tree", "int8", None, "hierarchy='tree', expected one of"),
        ([0, 0, 1, 1], "node", "powersgd", None, "hierarchy='node', expected 'auto' or 'flat'"),
        ([0, 0, 1, 1], "auto", "int8", 3, "nodes=3 (argument) cannot split world_size=4"),
    ],
    ids=["uneven", "one-node", "one-rank-per-node", "bad-value", "powersgd", "bad-nodes"],
)
def test_clear_errors_on_every_rank(layout, hierarchy, hook, nodes, message):
    results = run_ranks(_rank_errors, 4, layout, hierarchy, hook, nodes, timeout=120)
    for r in results:
        assert isinstance(r, str) and message in r, results


def _rank_disagree(case, hook):
    """Ranks that read another topology than the others: under hierarchy='auto' too (where a
    rank alone would see one node and run flat), the same error on every rank."""
    rank = dist.get_rank()
    if case == "one rank without the launcher's node variables":
        where = _nodes([0, 0, 1, 1]) if rank != 3 else contextlib.nullcontext()
    else:
        where = contextlib.nullcontext()
    with where:
        try:
            if case == "init(nodes=...) differs":
                pycomm.init(nodes=2 if rank < 2 else 4)
            pycomm.wrap(_model(), hook=hook)
            return "no error"
        except ValueError as e:
            return str(e)
        finally:
            set_nodes(None)


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "one rank without the launcher's node variables",
            "ranks disagree on the number of nodes: rank 0 has 2 (from torchrun), rank 3 has 1",
        ),
        ("init(nodes=...) differs", "ranks disagree on the number of nodes: rank 0 has 2"),
    ],
)
@pytest.mark.parametrize("hook", ["int8", "allreduce"])
def test_ranks_reading_another_topology_are_an_error_on_every_rank(case, message, hook):
    for r in run_ranks(_rank_disagree, 4, case, hook, timeout=120):
        assert message in r, r


_FAKE_GROUP = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from pycomm import hooks
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
for name in ("allreduce", "int8", "onebit"):
    assert hooks.hook_spec(name).state(None).node_plan is None, name
print("flat")
"""


def test_ranks_reading_one_node_without_local_ranks_run_flat():
    """Ranks with no launcher variable (init by hand, or torch's fake group, whose gather
    hands every rank rank 0's topology): every rank reads one node, so 'auto' runs flat
    rather than checking local ranks no variable gave."""
    env = {k: v for k, v in os.environ.items() if "LOCAL_" not in k and "GROUP_" not in k}
    out = subprocess.run(
        [sys.executable, "-c", _FAKE_GROUP], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0 and out.stdout.strip() == "flat", out.stderr[-2000:]


def _rank_bad_env():
    env = {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    if dist.get_rank() >= 2:
        env["GROUP_RANK"] = "1"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # every rank claims local rank 0: impossible
    try:
        pycomm.wrap(_model(), hook="int8", hook_options={"hierarchy": "auto"})
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_impossible_launcher_topology():
    for r in run_ranks(_rank_bad_env, 4, timeout=120):
        assert "impossible topology" in r and "local ranks [0, 0]" in r, r


def test_uneven_auto_runs_flat():
    results = run_ranks(_rank_errors, 4, [0, 0, 0, 1], "auto", "int8", None, timeout=120)
    for hier, grads in results:
        assert hier is False
        assert torch.equal(grads, results[0][1])


def _rank_slurm_topology(layout):
    with _nodes(layout, "slurm"):
        return pycomm.topology()


@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 0, 0, 1]], ids=["2x2", "3+1"])
def test_slurm_variables_give_the_topology_and_auto_follows_it(layout):
    """Under SLURM alone (no torchrun variable) the topology comes from SLURM_NODEID,
    SLURM_NNODES, SLURM_LOCALID and SLURM_TASKS_PER_NODE, and hierarchy='auto' runs node on
    even nodes (the same gradients as under torchrun's variables, bit for bit) and flat on
    uneven ones."""
    topos = run_ranks(_rank_slurm_topology, 4, layout, timeout=120)
    for rank, t in enumerate(topos):
        members = [r for r, n in enumerate(layout) if n == layout[rank]]
        assert (t.nodes, t.node_rank, t.local_rank, t.local_world_size, t.source) == (
            2,
            layout[rank],
            members.index(rank),
            len(members),
            "SLURM",
        ), (rank, t)
    slurm = run_ranks(_rank_errors, 4, layout, "auto", "int8", None, "slurm", timeout=120)
    torchrun = run_ranks(_rank_errors, 4, layout, "auto", "int8", None, "torchrun", timeout=120)
    even = layout == [0, 0, 1, 1]
    for (hier_s, grads_s), (hier_t, grads_t) in zip(slurm, torchrun):
        assert hier_s is even and hier_t is even
        assert torch.equal(grads_s, slurm[0][1]) and torch.equal(grads_s, grads_t)


def _rank_init_nodes():
    try:
        pycomm.init(nodes=2)
        topo = pycomm.topology()
        ddp = pycomm.wrap(_model(), hook="allreduce")
        state = pycomm.hook_state(ddp)
        plan = state.node_plan
        timeouts = {group_timeout(g) for g in (*plan.intra.groups, *plan.cross.groups)}
        return topo, timeouts, group_timeout(dist.group.WORLD)
    finally:
        set_nodes(None)


def test_init_nodes_topology_and_group_timeouts():
    results = run_ranks(_rank_init_nodes, 4, timeout=120)
    for rank, (topo, timeouts, parent) in enumerate(results):
        assert (topo.nodes, topo.node_rank, topo.local_rank, topo.local_world_size) == (
            2,
            rank // 2,
            rank % 2,
            2,
        )
        assert timeouts == {parent} and parent is not None


def _rank_nan_in_one_shard(hook):
    """A NaN in one element of rank 0's gradient lands in one local rank's shard: only that
    rank (and its peers across nodes) decodes it. The step must still be skipped on every rank
    and, with strict_skip, leave every rank's residuals bitwise as they were."""
    rank = dist.get_rank()
    with _nodes([0, 0, 1, 1]):
        opts = {"hierarchy": "node", "start_iter": 2, "strict_skip": True}
        ddp = pycomm.wrap(_model(), hook=hook, hook_options=opts)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        loop = pycomm.TrainLoop(ddp, opt)
        state = pycomm.hook_state(ddp)
        poison = {"on": False}
        first = next(ddp.module.parameters())

        def inject(g):
            if not (poison["on"] and rank == 0):
                return g
            g = g.clone()
            g.view(-1)[0] = float("nan")
            return g

        first.register_hook(inject)
        gen = torch.Generator().manual_seed(rank)
        snaps, nan_step = [], 4
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for i in range(nan_step + 2):
                snaps.append(copy.deepcopy(state.state_dict()["residuals"]))
                poison["on"] = i == nan_step
                x, y = torch.randn(8, 40, generator=gen), torch.randn(8, 3, generator=gen)
                loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))
        before, after = snaps[nan_step], snaps[nan_step + 1]
        return {
            "skipped": loop.skipped_steps,
            "residuals": bool(before) and before.keys() == after.keys(),
            "same": all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k]),
            "moved": any(
                not torch.equal(snaps[nan_step - 1][k][n], before[k][n])
                for k in before
                for n in before[k]
            ),
        }


@pytest.mark.parametrize("hook", ["int8", "onebit"])
def test_nan_in_one_shard_keeps_every_ranks_residuals(hook):
    for rank, r in enumerate(run_ranks(_rank_nan_in_one_shard, 4, hook, timeout=120)):
        assert r["skipped"] == 1 and r["residuals"] and r["moved"], (rank, r)
        assert r["same"], (rank, r)


def _rank_node_on_one_rank():
    return errors_of(
        {
            "int8": lambda: pycomm.wrap(_model(), hook="int8", hook_options={"hierarchy": "node"}),
            "exchange": lambda: pycomm.Exchange("int8", hierarchy="node"),
        }
    )


def test_node_on_a_group_of_one_rank_is_refused():
    for name, (kind, text) in run_ranks(_rank_node_on_one_rank, 1, timeout=60)[0].items():
        assert kind == "ValueError", name
        assert "hierarchy='node' needs more than one node with more than one rank each" in text
