"""pycomm.LocalSGD and pycomm.DiLoCo: the average they sync, ranks bitwise equal after a sync,
training, bitwise resume with a sync in flight, non-finite pseudo-gradients, bad input on
every rank, and 2 nodes of 2 ranks with DDP inside each node."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from harness import error_text, run_ranks

import pycomm
from pycomm.topology import set_nodes


def _model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_everywhere(t: torch.Tensor, group=None) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, t, group=group)
    return all(torch.equal(everyone[0], e) for e in everyone)


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 8, generator=g)
    w = torch.linspace(-1, 1, 8).unsqueeze(1)
    return x, x @ w


def _train(model, opt, outer, g, steps, losses=None):
    for _ in range(steps):
        x, y = _batch(g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        outer.step()
        if losses is not None:
            losses.append(loss.item())


def _rank_average_and_training():
    rank, out = dist.get_rank(), {}
    # exact: a sync sets every rank's parameters to the ranks' mean
    model = _model(rank)  # different replicas: the outer copy starts from rank 0's
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = pycomm.LocalSGD(model, sync_every=3, codec="allreduce")
    out["broadcast"] = _same_everywhere(_flat(model))
    g = torch.Generator().manual_seed(rank)
    _train(model, opt, outer, g, 2)
    x, y = _batch(g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    mean = _flat(model)
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    outer.step()  # step 3: the sync
    out["mean"] = float((_flat(model) - mean).abs().max())
    out["equal"] = _same_everywhere(_flat(model))
    # int4, 2 fragments, delay 1: the loss falls, every sync leaves ranks equal in it
    model = _model(0, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = pycomm.LocalSGD(model, sync_every=8, fragments=2, delay=1)
    losses = []
    _train(model, opt, outer, g, 64, losses)
    outer.sync()
    out["falls"] = sum(losses[-8:]) < 0.3 * sum(losses[:8])
    out["synced"] = _same_everywhere(_flat(model))
    out["stats"] = outer.stats
    # the context manager and the optimizer's hook: the same bits as calling step()
    runs = []
    for hooked in (False, True):
        model = _model(0, 64)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        g.manual_seed(rank)
        with pycomm.LocalSGD(model, sync_every=4, fragments=2, delay=1) as outer:
            if hooked:
                outer.hook(opt)
            for _ in range(10):
                x, y = _batch(g)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if not hooked:
                    outer.step()
        runs.append(_flat(model))
    out["hooked"] = torch.equal(*runs) and _same_everywhere(runs[1])
    # DiLoCo with its default outer Nesterov step also trains
    model = _model(0, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = pycomm.DiLoCo(model, sync_every=8)
    losses = []
    _train(model, opt, outer, g, 64, losses)
    out["diloco falls"] = sum(losses[-8:]) < 0.3 * sum(losses[:8])
    return out


def test_local_sgd_averages_and_trains_with_fragments_and_delay():
    for out in run_ranks(_rank_average_and_training, 2, timeout=90):
        assert out["broadcast"] and out["equal"] and out["synced"]
        assert out["mean"] < 1e-6
        assert out["falls"] and out["diloco falls"] and out["hooked"]
        s = out["stats"]
        assert s["syncs"] == 2 * 64 // 8 + 2 and s["skipped"] == 0  # and sync()'s two
        assert s["bytes_ddp"] > 20 * s["bytes_sent"] > 0
        assert s["bytes_fp32"] > 4 * s["bytes_sent"]
        assert 0 < s["peak_sync_bytes"] < 0.8 * s["bytes_sent"] / (s["syncs"] / 2)  # one of 2


def _run(steps, load=None, save=None, folder=None, order="built first"):
    """``order``: the model's state loaded after DiLoCo is built ("built first"), before it
    ("model first"), or after DiLoCo's own state ("outer first")."""
    rank = dist.get_rank()
    model = _model(0, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = None if load is None else copy.deepcopy(load[rank])  # (an optimizer keeps tensors)
    if state is not None and order == "model first":
        model.load_state_dict(state["model"])
    outer = pycomm.DiLoCo(model, sync_every=6, fragments=2, delay=1)
    start = 0
    if state is not None:
        if order == "built first":
            model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        if folder is None:
            outer.load_state_dict(state["outer"])
        else:  # through pycomm.checkpoint, one file per rank
            assert pycomm.checkpoint.load_rank_state(outer, folder)
        if order == "outer first":
            model.load_state_dict(state["model"])
        start = state["step"]
    g = torch.Generator().manual_seed(rank)
    for step in range(start, steps):
        g.manual_seed(1000 * step + rank)
        _train(model, opt, outer, g, 1)
    saved = None
    if save:
        saved = {"model": model.state_dict(), "opt": opt.state_dict(),
                 "outer": outer.state_dict(), "step": steps}  # fmt: skip
        if folder is not None:
            pycomm.checkpoint.save_rank_state(outer, folder)
    return _flat(model), saved


def _rank_resume(folder):
    straight, _ = _run(13)
    _, mine = _run(6, save=True, folder=folder)  # fragment 1 issued at 6 lands at 7: in flight
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    resumed, _ = _run(13, load=everyone)
    through_checkpoint, _ = _run(13, load=everyone, folder=folder)
    orders = {o: torch.equal(straight, _run(13, load=everyone, order=o)[0])
              for o in ("model first", "outer first")}  # fmt: skip
    other = pycomm.LocalSGD(_model(0, 32), sync_every=6)  # another schedule: refused
    refused = error_text(lambda: other.load_state_dict(mine["outer"]))
    mid = not torch.equal(*_gathered(_run(6)[0]))  # at the save, the ranks differ
    return (torch.equal(straight, resumed), torch.equal(straight, through_checkpoint), orders,
            len(mine["outer"]["pending"]), refused, mid)  # fmt: skip


def _gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def test_diloco_resumes_bitwise_with_a_sync_in_flight(tmp_path):
    for same, through, orders, pending, refused, mid in run_ranks(_rank_resume, 2, str(tmp_path)):
        assert same and through and pending == 1
        # the ranks' parameters differ at the save (mid-window), and any order of loading
        # the model and building DiLoCo resumes bitwise
        assert mid and orders == {"model first": True, "outer first": True}, orders
        assert "the state has class='DiLoCo', this pycomm.LocalSGD 'LocalSGD'" in refused


def _rank_nonfinite():
    rank = dist.get_rank()
    model = _model(0)
    outer = pycomm.LocalSGD(model, sync_every=2)
    before = _flat(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
        if rank == 1:
            model[0].weight[0, 0] = float("nan")
    outer.step()
    outer.step()  # the sync: skipped on every rank, the parameters back at the outer copy
    after = _flat(model)
    return outer.stats["skipped"], torch.equal(after, before), _same_everywhere(after)


def test_a_non_finite_pseudo_gradient_skips_the_sync_on_every_rank():
    assert run_ranks(_rank_nonfinite, 2, timeout=60) == [(1, True, True)] * 2


class _Other(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))


def _rank_refusals():
    rank, out = dist.get_rank(), {}
    model = _model(0)
    out["h"] = error_text(lambda: pycomm.LocalSGD(model, sync_every=0))
    out["fragments"] = error_text(lambda: pycomm.LocalSGD(model, sync_every=8, fragments=5))
    out["delay"] = error_text(lambda: pycomm.LocalSGD(model, sync_every=8, fragments=2, delay=4))
    out["shape"] = error_text(lambda: pycomm.LocalSGD(_model(0, 16 + rank), sync_every=4))
    out["one rank"] = error_text(lambda: pycomm.LocalSGD(model, sync_every=4 + rank))
    other = _Other()
    out["optimizer"] = error_text(
        lambda: pycomm.DiLoCo(
            model, 4, outer_optimizer=lambda ps: torch.optim.SGD(other.parameters(), lr=1)
        )
    )
    ddp = torch.nn.parallel.DistributedDataParallel(_model(0))
    out["ddp"] = error_text(lambda: pycomm.LocalSGD(ddp, sync_every=4))
    return out


def test_bad_input_is_refused_on_every_rank():
    a, b = run_ranks(_rank_refusals, 2, timeout=60)
    assert a == b
    assert "sync_every=0" in a["h"]
    assert "fragments=5, expected at most the model's 4 parameter tensors" in a["fragments"]
    assert "delay=4, expected 0 <= delay < sync_every // fragments = 4" in a["delay"]
    assert "parameter shapes" in a["shape"] and "rank 1" in a["shape"]
    assert "sync_every" in a["one rank"]
    assert "expected one over exactly its params argument" in a["optimizer"]
    assert "inner model is DDP over ranks [0, 1]" in a["ddp"]


def _rank_two_nodes():
    set_nodes(2)
    try:
        rank = dist.get_rank()
        inner = pycomm.node_group()
        cross = pycomm.cross_node_group()
        ddp = pycomm.wrap(_model(0, 32), process_group=inner)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        outer = pycomm.LocalSGD(ddp, sync_every=4, process_group=cross)
        g = torch.Generator().manual_seed(rank // 2)  # one data stream a node
        losses = []
        _train(ddp, opt, outer, g, 16, losses)
        outer.sync()
        ranks = (dist.get_process_group_ranks(inner), dist.get_process_group_ranks(cross))
        return ranks, _same_everywhere(_flat(ddp)), sum(losses[-4:]) < sum(losses[:4])
    finally:
        set_nodes(None)


def test_two_nodes_ddp_inside_local_sgd_across():
    out = run_ranks(_rank_two_nodes, 4, timeout=90)
    assert [o[0] for o in out] == [([0, 1], [0, 2]), ([0, 1], [1, 3]),
                                   ([2, 3], [0, 2]), ([2, 3], [1, 3])]  # fmt: skip
    assert all(o[1] and o[2] for o in out)


def _rank_fsdp_inside():
    """FSDP2 inside each node, LocalSGD across the nodes on each rank's local shards."""
    from torch.distributed.fsdp import fully_shard

    from pycomm.fsdp import node_mesh

    set_nodes(2)
    try:
        rank = dist.get_rank()
        model = _model(0, 32)
        mesh = node_mesh()
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        outer = pycomm.LocalSGD(model, sync_every=4, process_group=pycomm.cross_node_group())
        g = torch.Generator().manual_seed(rank // 2)
        losses = []
        _train(model, opt, outer, g, 16, losses)
        outer.sync()
        shard = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
        # each shard the same on the 2 nodes: the cross-node group's ranks hold the same one
        return _same_everywhere(shard, pycomm.cross_node_group()), outer.stats["syncs"]
    finally:
        set_nodes(None)


def test_fsdp2_inside_the_node_local_sgd_across():
    assert run_ranks(_rank_fsdp_inside, 4, timeout=90) == [(True, 5)] * 4
