"""HSDP through pycomm.fsdp: a model sharded on pycomm.fsdp.node_mesh() (4 gloo ranks as 2
nodes of 2), each shard's gradient all-reduced across the nodes through the hook, against
FSDP2 sharded over all 4 ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
from fsdp_harness import data as _data
from fsdp_harness import model as _model
from fsdp_harness import set_divide_factor, shard, straight_and_resumed, train
from harness import error_text, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import pycomm
import pycomm.fsdp
from pycomm.topology import set_nodes


def _shard(m, mesh=None):
    return shard(m, mesh=mesh)


def _rank_hsdp(hook, steps, k=1, options=None, all_gather=None):
    """FSDP2 over every rank, and HSDP on 2 nodes with ``hook`` across them: each run's
    parameters, gradients of every step, and pycomm's stats."""
    set_nodes(2)
    try:
        ref = train(_shard(_model()), None, steps, k)
        m = _shard(_model(), pycomm.fsdp.node_mesh())
        comm = pycomm.fsdp.compress(m, hook=hook, hook_options=options, all_gather=all_gather)
        assert comm.hsdp
        return ref, train(m, comm, steps, k)
    finally:
        set_nodes(None)


def test_allreduce_across_nodes_is_fsdp_over_every_rank():
    for ref, (p, grads, stats) in run_ranks(_rank_hsdp, 4, "allreduce", 3, timeout=120):
        for a, b in zip(grads, ref[1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, ref[0], rtol=1e-6, atol=1e-7)
        last = stats[-1]
        assert last["calls"] == 3 * 3  # one all-reduce per block per step; the root holds none
        assert last["all_reduce"]["bytes_sent"] == last["all_reduce"]["bytes_fp32"] > 0
        assert last["reduce_scatter"]["bytes_sent"] == last["reduce_scatter"]["bytes_fp32"] > 0


def test_int8_across_nodes_ranks_agree_and_sends_under_a_third():
    ranks = run_ranks(_rank_hsdp, 4, "int8", 6, timeout=120)
    for r in range(1, 4):
        assert torch.equal(ranks[0][1][0], ranks[r][1][0])  # every rank's parameters
    ref, (p, grads, stats) = ranks[0]
    torch.testing.assert_close(grads[0], ref[1][0], rtol=1e-6, atol=1e-7)  # warm-up: exact
    for a, b in zip(grads[2:], ref[1][2:]):  # compressed across the nodes: close, not equal
        assert not torch.equal(a, b)
        assert (a - b).norm() / b.norm() < 0.02
    # the cross-node bytes of the compressed steps against an fp32 all-reduce of the shards
    ar = [s["all_reduce"] for s in stats]
    sent = ar[-1]["bytes_sent"] - ar[1]["bytes_sent"]
    fp32 = ar[-1]["bytes_fp32"] - ar[1]["bytes_fp32"]
    assert sent / fp32 <= 0.3, sent / fp32
    assert stats[-1]["residual_bytes"] > 0  # error feedback on by default across nodes


def test_int8_weights_inside_the_node_and_gradients_across():
    ranks = run_ranks(_rank_hsdp, 4, "int8", 3, 1, None, "int8", timeout=120)
    for r in range(1, 4):
        assert torch.equal(ranks[0][1][0], ranks[r][1][0])
    ref, (p, _, stats) = ranks[0]
    assert (p - ref[0]).norm() / ref[0].norm() < 0.02  # int8 weights and gradients: close
    last = stats[-1]
    assert last["all_gather"]["calls"] > 0 and last["all_reduce"]["calls"] == 3 * 3
    ag = last["all_gather"]
    assert ag["bytes_sent"] < 0.3 * ag["bytes_fp32"]


def _rank_divided(hook, factor):
    """HSDP with ``set_gradient_divide_factor(factor)`` on every module: the first step's
    gradients, and FSDP2's own over every rank (its mean)."""
    set_nodes(2)
    try:
        ref = train(_shard(_model()), None, 1)
        m = _shard(_model(), pycomm.fsdp.node_mesh())
        set_divide_factor(m, factor)
        comm = pycomm.fsdp.compress(m, hook=hook)
        return ref[1][0], train(m, comm, 1)[1][0]
    finally:
        set_nodes(None)


@pytest.mark.parametrize("hook", ["allreduce", "int8"])
def test_a_gradient_divide_factor_sums_across_the_nodes(hook):
    # factor 2 (gloo's in-node reduce-scatter takes AVG, not PREMUL_SUM): the sum over the 4
    # ranks / 2, twice FSDP2's mean (the nodes' mean of it was half of that)
    for ref, ours in run_ranks(_rank_divided, 4, hook, 2.0, timeout=120):
        torch.testing.assert_close(ours, ref * 2, rtol=1e-6, atol=1e-7)


def test_accumulation_with_fsdp_no_sync():
    for ref, (p, _, stats) in run_ranks(_rank_hsdp, 4, "allreduce", 2, 3, timeout=120):
        assert stats[-1]["calls"] == 2 * 3  # one all-reduce per block per window
        torch.testing.assert_close(p, ref[0], rtol=1e-6, atol=1e-7)
    int8 = run_ranks(_rank_hsdp, 4, "int8", 3, 3, timeout=120)
    assert all(torch.equal(int8[0][1][0], r[1][0]) for r in int8[1:])


def _rank_resume():
    set_nodes(2)
    try:
        mesh = pycomm.fsdp.node_mesh()

        def build():
            m = _shard(_model(), mesh)
            comm = pycomm.fsdp.compress(m, hook="int8")
            return m, comm, torch.optim.Adam(m.parameters(), lr=1e-2)

        straight, resumed, comm, saved, _ = straight_and_resumed(build, _data(6, seed=3), 3)
        other = copy.deepcopy(saved)
        other["fingerprint"]["options"]["hook"] = "fp8"
        refused = error_text(lambda: comm.load_state_dict(other))
        return straight, resumed, comm.stats, refused
    finally:
        set_nodes(None)


def test_resume_is_bitwise():
    for straight, resumed, stats, refused in run_ranks(_rank_resume, 4, timeout=120):
        assert torch.equal(straight, resumed)
        assert stats["residual_bytes"] > 0
        assert "options['hook'] is 'fp8' in the checkpoint but 'int8' here" in refused


def _rank_refusals():
    set_nodes(2)
    out = {}
    try:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        native = fully_shard(_model(), mesh=mesh2d)
        out["native"] = error_text(lambda: pycomm.fsdp.compress(native, hook="int8"))
        node = pycomm.fsdp.node_mesh()
        mixed = _model()
        fully_shard(mixed[0], mesh=node)
        fully_shard(mixed)
        out["mixed"] = error_text(lambda: pycomm.fsdp.compress(mixed, hook="int8"))
        hsdp = _shard(_model(), node)
        out["hierarchy"] = error_text(
            lambda: pycomm.fsdp.compress(hsdp, hook="int8", hook_options={"hierarchy": "node"})
        )
        one = _shard(_model(), node)  # start_iter given on rank 1 alone: named on every rank
        opts = {"start_iter": 0} if dist.get_rank() == 1 else {}
        out["start_iter"] = error_text(
            lambda: pycomm.fsdp.compress(one, hook="int8", hook_options=opts)
        )
        set_nodes(3)
        out["nodes"] = error_text(lambda: pycomm.fsdp.node_mesh())
    finally:
        set_nodes(None)
    return out


def test_refusals_are_clear_and_the_same_on_every_rank():
    ranks = run_ranks(_rank_refusals, 4, timeout=120)
    assert all(r == ranks[0] for r in ranks[1:])
    out = ranks[0]
    assert "2-D device mesh (FSDP2's native HSDP" in out["native"]
    assert "shard on pycomm.fsdp.node_mesh()" in out["native"]
    assert "expected every module on one mesh" in out["mixed"]
    assert "option hierarchy='node'" in out["hierarchy"]
    assert "pycomm.fsdp.node_mesh: cannot read the topology" in out["nodes"]
    assert (
        "ranks disagree on option 'start_iter': rank 0 has 2, rank 1 has 0" in (out["start_iter"])
    )


def _rank_replicate():
    from torch.distributed._composable.replicate_with_fsdp import replicate

    m = replicate(_model())
    return error_text(lambda: pycomm.fsdp.compress(m, hook="int8"))


def test_a_replicated_module_is_refused():
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no FSDP2-based replicate()")
    for text in run_ranks(_rank_replicate, 2, timeout=60):
        assert "is replicate()-ed" in text
        assert "fully_shard(module, reshard_after_forward=False)" in text


@pytest.mark.slow
def test_bench_fsdp_on_simulated_nodes_counts_each_uplink(tmp_path, capfd):
    """python -m pycomm.bench --fsdp --nodes 2: 4 ranks in 2 network namespaces joined by
    shaped veths; the bytes each node sends across its uplink: HSDP's all-reduce of the shards
    against FSDP2 over every rank, and int8's against the exact one."""
    import json

    from pycomm.bench import link
    from pycomm.bench.__main__ import main

    path = tmp_path / "hsdp.json"
    args = ["--nodes", "2", "--nprocs", "4", "--link", "10gbit", "--steps", "3", "--warmup", "2"]
    args += ["--layers", "2", "--width", "256", "--batch", "8", "--json", str(path)]
    args += ["--hooks", "fsdp,allreduce,int8"]
    if link.cannot_shape() is not None:  # the refusal then, naming what is missing
        with pytest.raises(SystemExit):
            main(["--fsdp", *args])
        assert "--link 10gbit" in capfd.readouterr().err
        return
    assert main(["--fsdp", *args]) == 0, capfd.readouterr().err
    rows = json.loads(path.read_text())["hooks"]
    assert rows["allreduce"]["uplink_vs_fsdp"] < 0.5
    assert rows["int8"]["uplink_bytes_per_step"] < 0.3 * rows["allreduce"]["uplink_bytes_per_step"]


def _rank_sub_mesh():
    """A 1-D mesh of 2 of the 4 ranks made by init_device_mesh (not node_mesh): sharded and
    reduced within those ranks, as FSDP2 does, against FSDP2's own on the same mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))["shard"]
    ref = train(_shard(_model(), mesh), None, 2, 1)
    m = _shard(_model(), mesh)
    comm = pycomm.fsdp.compress(m, hook="allreduce")
    out = train(m, comm, 2, 1)
    # each rank's state its own (the mesh numbers its 2 ranks 0 and 1 again): its own file,
    # and another rank's state refused
    everyone = [None] * 4
    dist.all_gather_object(everyone, comm.state_dict())
    owner = everyone[dist.get_rank() ^ 2]  # the rank at this rank's place in the other mesh
    return ref, out, comm.hsdp, (comm.rank, error_text(lambda: comm.load_state_dict(owner)))


def test_a_mesh_of_some_ranks_not_from_node_mesh_is_reduced_within_them():
    results = run_ranks(_rank_sub_mesh, 4, timeout=120)
    for rank, (ref, (p, grads, stats), hsdp, (owner, refused)) in enumerate(results):
        assert owner == rank
        assert f"cannot load the hook state of rank {rank ^ 2} on rank {rank}" in refused
        assert not hsdp and "all_reduce" not in stats[-1]
        for a, b in zip(grads, ref[1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, ref[0], rtol=1e-6, atol=1e-7)
