"""Train k steps, checkpoint (model, optimizer, hook state), resume in a freshly built DDP and
train m more: the parameters are bitwise those of an uninterrupted k + m steps, for every
compression hook. The fresh DDP buckets its first iteration differently from the rebuilt
layout the state was saved with; the hook re-buckets into its own layout."""

import copy

import pytest
import torch
import torch.distributed as dist
from ddp_harness import model as _model
from ddp_harness import straight_and_resumed
from harness import error_message as error
from harness import run_ranks

import pycomm


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _rank_resume(hook, options, k, m, accumulate):
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [(torch.randn(8, 40, generator=g), torch.randn(8, 3, generator=g)) for _ in range(k + m)]

    def build():
        ddp = pycomm.wrap(
            _model(), hook=hook, hook_options=options, accumulate_steps=accumulate,
            bucket_cap_mb=0.004,
        )  # fmt: skip
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        return ddp, opt, pycomm.TrainLoop(ddp, opt)

    def train(loop, ddp, batches):
        for x, y in batches:
            for _ in range(accumulate):  # the same micro-batch k times: simple, deterministic
                loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))

    ddp, opt, loop = build()
    train(loop, ddp, data)
    straight = _flat(ddp.module)

    ddp, opt, loop = build()
    train(loop, ddp, data[:k])
    saved = copy.deepcopy(
        {
            "model": ddp.module.state_dict(),
            "opt": opt.state_dict(),
            "hook": pycomm.hook_state(ddp).state_dict(),
        }
    )
    del ddp, opt, loop
    ddp, opt, loop = build()
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    pycomm.hook_state(ddp).load_state_dict(saved["hook"])
    train(loop, ddp, data[k:])
    state = pycomm.hook_state(ddp)
    stats = state.stats
    return straight, _flat(ddp.module), len(state.bucket_layout.buckets or []), stats


_PSGD = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}


@pytest.mark.parametrize(
    "hook, options, accumulate, rebucketed",
    [
        ("int8", {}, 1, 1),
        ("onebit", {"start_iter": 2}, 1, 1),  # compressed on both sides of the checkpoint
        ("bf16", {"error_feedback": True}, 1, 1),
        ("fp16", {"two_phase": True, "error_feedback": True}, 1, 1),
        # with accumulation the fresh DDP's first step does not communicate, and DDP has
        # re-bucketed before the window's last micro-step
        ("int8", {}, 2, 0),
        ("onebit", {"residual_dtype": "bfloat16", "start_iter": 2}, 1, 1),
        ("onebit", {"local_feedback": True, "start_iter": 2}, 1, 1),
        ("int4", {}, 1, 1),
        ("fp8", {"residual_dtype": "bfloat16"}, 2, 0),
        # the checkpoint just before the first compressed step, and in the exact warm-up: the
        # layout saved is DDP's rebuilt one, the one the uninterrupted run compresses with
        ("int8", {"start_iter": 4}, 1, 1),
        ("onebit", {"start_iter": 6}, 1, 1),  # its first step exact, on the saved layout
        # torch's PowerSGD keys its memories by bucket: it runs on the hook's layout too
        ("powersgd", _PSGD, 1, 1),
        ("powersgd", {**_PSGD, "warm_start": False}, 2, 0),
        ("powersgd", {**_PSGD, "start_powerSGD_iter": 4}, 1, 1),
    ],
    ids=lambda v: str(v),
)
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(hook, options, accumulate, rebucketed):
    for straight, resumed, buckets, stats in run_ranks(
        _rank_resume, 2, hook, options, 4, 3, accumulate, timeout=120
    ):
        assert buckets >= 3  # several buckets
        # the fresh DDP's first compressed step is in another layout
        assert stats["rebucketed_steps"] == rebucketed
        assert stats["compression"] > 1.0  # compressed steps after the checkpoint
        assert torch.equal(straight, resumed)


@pytest.mark.parametrize(
    "hook, options",
    [
        ("int8", {"start_iter": 6}),
        ("powersgd", {**_PSGD, "start_powerSGD_iter": 6}),
        ("allreduce", {}),  # exact throughout: the checkpoint's buckets for the fresh DDP's step
    ],
    ids=["int8", "powersgd", "allreduce"],
)
def test_resume_in_the_warm_up_is_bitwise_on_three_ranks(hook, options):
    """With 3 ranks an exact all-reduce's sums depend on where an element sits in the bucket:
    the resumed DDP's first step, bucketed as a fresh DDP buckets it, runs on the saved
    layout, so its exact steps sum as the uninterrupted run's do."""
    for straight, resumed, _, stats in run_ranks(
        _rank_resume, 3, hook, options, 4, 3, 1, timeout=120
    ):
        assert stats["rebucketed_steps"] == 1  # the fresh DDP's first step, in the warm-up
        assert torch.equal(straight, resumed)


def _rank_resume_mid_window(hook, cut):
    """accumulate_steps=2, the checkpoint after micro-step ``cut`` (odd: inside a window)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [(torch.randn(8, 40, generator=g), torch.randn(8, 3, generator=g)) for _ in range(8)]

    def build():
        ddp = pycomm.wrap(_model(), hook=hook, accumulate_steps=2, bucket_cap_mb=0.004)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def train(ddp, opt, batches):  # the loop built after a load: it reads the stage's count
        loop = pycomm.TrainLoop(ddp, opt)
        for x, y in batches:
            loop.step(lambda x=x, y=y: torch.nn.functional.mse_loss(ddp(x), y))

    straight, resumed, _, _ = straight_and_resumed(build, train, data, cut)
    return torch.equal(straight, resumed)


@pytest.mark.parametrize("hook", ["int8", "allreduce"])
def test_resume_in_the_middle_of_a_window_is_bitwise_on_three_ranks(hook):
    # cut 3: the inner hook saw one window (DDP's second iteration, its buckets rebuilt), whose
    # layout the checkpoint records; the resumed DDP's first iteration is the window's last
    assert run_ranks(_rank_resume_mid_window, 3, hook, 3, timeout=120) == [True] * 3


# --- a checkpoint of another world size, and mixed parameter dtypes ----------------------


def _rank_save_state():
    ddp = pycomm.wrap(_model(), hook="int8", bucket_cap_mb=0.004)
    for _ in range(3):
        ddp.zero_grad()
        ddp(torch.randn(4, 40)).square().mean().backward()
    return pycomm.hook_state(ddp).state_dict()


def _rank_load_state(saved):
    ddp = pycomm.wrap(_model(), hook="int8", bucket_cap_mb=0.004)
    try:
        pycomm.hook_state(ddp).load_state_dict(saved)
    except ValueError as e:
        return str(e)
    return None


def test_loading_another_world_size_names_it():
    saved = run_ranks(_rank_save_state, 2, timeout=60)[0]
    for err in run_ranks(_rank_load_state, 3, saved, timeout=60):
        assert err is not None and "world_size is 2 in the checkpoint but 3 here" in err, err


def _rank_load_other_block(saved):
    ddp = pycomm.wrap(_model(), hook="int8", bucket_cap_mb=0.004, hook_options={"block": 32})
    try:
        pycomm.hook_state(ddp).load_state_dict(saved[dist.get_rank()])
    except ValueError as e:
        return str(e)
    return None


def _rank_load_older(saved):
    """A checkpoint of the version before strict_skip (its fingerprint lacks the option, and
    it kept two copies, whose kept one it saved): loads, as either way."""
    older = {**saved[dist.get_rank()]}
    fingerprint = {**older["fingerprint"]}
    fingerprint["options"] = {k: v for k, v in fingerprint["options"].items() if k != "strict_skip"}
    older["fingerprint"] = fingerprint
    out = []
    for strict in (False, True):
        opts = {"strict_skip": strict}
        ddp = pycomm.wrap(_model(), hook="int8", bucket_cap_mb=0.004, hook_options=opts)
        pycomm.hook_state(ddp).load_state_dict(older)
        ddp(torch.randn(4, 40)).square().mean().backward()  # the loaded residuals placed
        placed = pycomm.hook_state(ddp).state_dict()["residuals"]
        out.append(placed.keys() == older["residuals"].keys())
    return out


def test_a_checkpoint_without_strict_skip_loads():
    saved = run_ranks(_rank_save_state, 2, timeout=60)
    for loaded in run_ranks(_rank_load_older, 2, saved, timeout=60):
        assert loaded == [True, True]


def test_loading_other_options_names_the_option():
    """The message names the differing option and its two values, not both whole dicts."""
    saved = run_ranks(_rank_save_state, 2, timeout=60)
    for err in run_ranks(_rank_load_other_block, 2, saved, timeout=60):
        assert err == (
            "pycomm: cannot load hook state: options['block'] is 64 in the checkpoint but 32 here"
        ), err


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(40, 40)
        self.b = torch.nn.Linear(40, 40).to(torch.bfloat16)
        self.c = torch.nn.Linear(40, 3).to(torch.float16)

    def forward(self, x):
        h = torch.tanh(self.a(x)).to(torch.bfloat16)
        h = torch.tanh(self.b(h)).to(torch.float16)
        return self.c(h).float()


def _rank_mixed(hook):
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(dist.get_rank())
    ddp = pycomm.wrap(Mixed(), hook=hook, bucket_cap_mb=0.004)
    ref = DDP(Mixed(), bucket_cap_mb=0.004)
    errors, dtypes = [], set()
    for _ in range(4):
        x = torch.randn(8, 40, generator=g)
        for m in (ddp, ref):
            m.zero_grad()
            m(x).square().mean().backward()
        for p, q in zip(ddp.module.parameters(), ref.module.parameters()):
            assert p.grad.dtype == p.dtype == q.grad.dtype
            dtypes.add(str(p.grad.dtype))
            errors.append(((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm()).item())
    return max(errors), sorted(dtypes), pycomm.hook_state(ddp).stats["buckets"]


@pytest.mark.parametrize("hook, bound", [("allreduce", 0.0), ("bf16", 1e-2), ("int8", 5e-2)])
def test_mixed_dtypes_keep_each_bucket_dtype(hook, bound):
    for err, dtypes, buckets in run_ranks(_rank_mixed, 2, hook, timeout=60):
        assert dtypes == ["torch.bfloat16", "torch.float16", "torch.float32"]
        assert buckets >= 3 * 4  # one bucket per dtype at least, every step
        assert err <= bound, err


# ------------------------------------- one file per rank in a folder (save/load_rank_state)


def _rank_state_files(tmp):
    """save_rank_state/load_rank_state round trip, and every way a folder can be wrong: the
    same error on every rank, the state unchanged."""
    import os

    from pycomm.checkpoint import load_rank_state, rank_state_file, save_rank_state

    rank = dist.get_rank()

    def trained(hook="int8"):
        ddp = pycomm.wrap(_model(), hook=hook)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ddp(torch.randn(8, 40, generator=g)).square().mean().backward()
        return ddp

    out = {}
    ddp = trained()
    path = save_rank_state(ddp, f"{tmp}/ok")
    out["path"] = path == rank_state_file(f"{tmp}/ok", rank) and os.path.exists(path)
    fresh = pycomm.wrap(_model(), hook="int8")
    out["loaded"] = load_rank_state(fresh, f"{tmp}/ok")
    out["empty"] = error(lambda: load_rank_state(fresh, f"{tmp}/none"))
    out["ignored"] = load_rank_state(fresh, f"{tmp}/none", missing="ignore")
    out["bad_missing"] = error(lambda: load_rank_state(fresh, f"{tmp}/ok", missing="warn"))
    if rank == 1:  # one rank's file lost
        save_rank_state(ddp, f"{tmp}/half")
    dist.barrier()
    out["half"] = error(lambda: load_rank_state(fresh, f"{tmp}/half", missing="ignore"))
    out["other_hook"] = error(
        lambda: load_rank_state(pycomm.wrap(_model(), hook="onebit"), f"{tmp}/ok")
    )
    if rank == 0:  # another rank's file under this rank's name
        os.makedirs(f"{tmp}/swapped", exist_ok=True)
        os.replace(rank_state_file(f"{tmp}/ok", 1), rank_state_file(f"{tmp}/swapped", 0))
    dist.barrier()
    out["swapped"] = error(lambda: load_rank_state(fresh, f"{tmp}/swapped", missing="ignore"))
    # the loaded state, untouched by the refused loads, communicates as the saved one does:
    # the same next gradients bit for bit (error feedback included)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(10 + rank))
    grads = []
    for model in (ddp, fresh):
        model.zero_grad()
        model(x).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.module.parameters()]))
    out["same"] = torch.equal(*grads)
    afresh = pycomm.wrap(_model(), hook="int8")
    afresh(x).square().mean().backward()
    out["differs_afresh"] = not torch.equal(
        grads[0], torch.cat([p.grad.flatten() for p in afresh.module.parameters()])
    )
    return out


def test_rank_state_files_round_trip_and_refuse_on_every_rank(tmp_path):
    for r in run_ranks(_rank_state_files, 2, str(tmp_path), timeout=120):
        assert r["path"] and r["loaded"] is True and r["same"]
        assert "holds no pycomm hook state" in r["empty"]
        assert r["ignored"] is False
        assert "missing='warn', expected 'error' or 'ignore'" in r["bad_missing"]
        assert "holds the hook state of ranks [1] but not of ranks [0]" in r["half"]
        assert "hook is 'int8' in the checkpoint but 'onebit' here" in r["other_hook"]
        assert "cannot load the hook state of rank 1 on rank 0" in r["swapped"]
        assert r["differs_afresh"]  # the residuals matter: the check can fail


def _rank_powersgd_file(folder):
    """powersgd through pycomm.checkpoint (torch.load with weights_only=True): the state
    loads, its numpy RNG state and P/Q memories as saved, and the ranks agree after it."""
    ddp = pycomm.wrap(_model(), hook="powersgd", hook_options={"start_powerSGD_iter": 2})
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 40, generator=g)).square().mean().backward()
        opt.step()
    path = f"{folder}/ckpt.pt"
    pycomm.checkpoint.save(path, ddp, opt)
    saved = pycomm.hook_state(ddp).torch_state
    fresh = pycomm.wrap(_model(), hook="powersgd", hook_options={"start_powerSGD_iter": 2})
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    pycomm.checkpoint.load(path, fresh, opt)
    loaded = pycomm.hook_state(fresh).torch_state
    a, b = saved.rng.get_state(), loaded.rng.get_state()
    same_rng = a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:]
    same_q = all(torch.equal(saved.q_memory_dict[k], loaded.q_memory_dict[k])
                 for k in saved.q_memory_dict)  # fmt: skip
    opt.zero_grad()
    fresh(torch.randn(8, 40, generator=g)).square().mean().backward()
    opt.step()
    flat = _flat(fresh.module)
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return (
        bool(same_rng),
        same_q,
        len(saved.q_memory_dict),
        all(torch.equal(flat, o) for o in everyone),
    )


def test_powersgd_loads_from_a_checkpoint_file(tmp_path):
    for same_rng, same_q, memories, agree in run_ranks(
        _rank_powersgd_file, 2, str(tmp_path), timeout=90
    ):
        assert same_rng and same_q and memories > 0 and agree


# ------------------------------- ranks that load different saves, or load out of step


def _rank_loads_out_of_step(tmp):
    """Ranks that load different saves, or one rank a state and the other none: a ValueError
    on every rank, before any collective of the hook pairs a warm-up's all-reduce with a
    compressed step's (which hung until the group's timeout) or the ranks train apart."""
    import os
    import shutil

    from pycomm import checkpoint

    rank = dist.get_rank()

    def trained(steps):
        ddp = pycomm.wrap(_model(), hook="int8", hook_options={"start_iter": 2})
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            opt.zero_grad()
            ddp(torch.randn(8, 40, generator=g)).square().mean().backward()
            opt.step()
        return ddp, opt

    def step(ddp):
        ddp(torch.randn(8, 40)).square().mean().backward()

    out = {}
    ddp, opt = trained(1)
    checkpoint.save(f"{tmp}/a.pt", ddp, opt)
    checkpoint.save_rank_state(ddp, f"{tmp}/older")
    blob_a = checkpoint.gather_hook_state(ddp)
    ddp, opt = trained(4)
    checkpoint.save(f"{tmp}/b.pt", ddp, opt)
    if rank == 0:  # rank 1's file in the folder is of the older save
        checkpoint.save_rank_state(ddp, f"{tmp}/mixed")
    else:
        os.makedirs(f"{tmp}/mixed", exist_ok=True)
        shutil.copy(checkpoint.rank_state_file(f"{tmp}/older", 1), f"{tmp}/mixed")
    blob_b = checkpoint.gather_hook_state(ddp)
    fresh, fopt = trained(0)
    path = f"{tmp}/b.pt" if rank == 0 else f"{tmp}/a.pt"
    out["paths"] = error(lambda: checkpoint.load(path, fresh, fopt))
    out["folder"] = error(lambda: checkpoint.load_rank_state(fresh, f"{tmp}/mixed"))
    local = trained(0)[0]
    checkpoint.load_hook_state(local, blob_b if rank == 0 else blob_a)
    out["local"] = error(lambda: step(local))
    one = trained(0)[0]
    if rank == 0:
        checkpoint.load_hook_state(one, blob_b)
    out["one rank"] = error(lambda: step(one))
    same = trained(0)[0]
    checkpoint.load_hook_state(same, blob_b)
    out["same"] = error(lambda: step(same))
    # one rank in checkpoint.load while the other is in TrainLoop's checks
    late = trained(0)
    if rank == 0:
        out["calls"] = error(lambda: checkpoint.load(f"{tmp}/b.pt", *late))
    else:
        out["calls"] = error(lambda: pycomm.TrainLoop(late[0], late[1]))
    return out


def test_ranks_loading_out_of_step_are_refused_on_every_rank(tmp_path):
    a, b = run_ranks(_rank_loads_out_of_step, 2, str(tmp_path), timeout=120)
    assert a == b
    assert (
        "the ranks read different checkpoints; expected every rank to load the same" in (a["paths"])
    )
    assert f"rank 0: {tmp_path}/b.pt, save " in a["paths"]
    assert f"rank 1: {tmp_path}/a.pt, save " in a["paths"]
    assert "saved after different steps (rank 0: step 4; rank 1: step 1)" in a["folder"]
    for name, (low, high) in {"local": (1, 4), "one rank": (0, 4)}.items():
        assert f"states have run different numbers of steps (from {low} to {high})" in (a[name]), (
            name
        )
    assert a["same"] is None
    assert (
        "ranks are in different collective calls (rank 0 in pycomm.checkpoint.load; "
        in (a["calls"])
    )
    assert "rank 1 in pycomm.TrainLoop)" in a["calls"]
