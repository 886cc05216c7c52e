"""Real clients (PyTorch Lightning, Hugging Face Accelerate) and DDP's own options, on 2 gloo
ranks: every scenario gives bitwise the parameters of the reference run (the same training
without pycomm's part, or without the interruption) on every rank, or a clear error on every
rank. One spawned run per client holds several scenarios, to keep the suite short."""

import datetime
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from harness import error_message as _error
from harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm

lightning = pytest.importorskip("lightning")
accelerate = pytest.importorskip("accelerate")


def _flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def _data(n=40):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g)
    )


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _quiet():
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


# --------------------------------------------------------------------------- no process group


def test_states_are_built_before_the_process_group():
    assert not dist.is_initialized()
    states = [
        pycomm.hooks.hook_spec("allreduce").state(None),
        pycomm.hooks.hook_spec("bf16").state(None),
        pycomm.hooks.hook_spec("int8").state(None, block=128),
        pycomm.hooks.hook_spec("onebit").state(None),
        pycomm.hooks.hook_spec("powersgd").state(None),
    ]
    stage = pycomm.hooks.accumulate.Accumulate(states[2], pycomm.hooks.compressed_hook, 2, [])
    assert states[2].accumulate is stage
    for s in states:
        assert s._world_size is None
    with pytest.raises(RuntimeError, match="before the process group exists"):
        _ = states[2].world_size
    # what a framework does at construction time
    from lightning.pytorch.strategies import DDPStrategy

    DDPStrategy(ddp_comm_state=states[2], ddp_comm_hook=pycomm.hooks.compressed_hook)


def test_lightning_strategy_refuses_what_would_go_wrong():
    from pycomm.lightning import DDPStrategy

    with pytest.raises(
        ValueError, match=r"accumulate_steps=4, expected 1.*accumulate_grad_batches"
    ):
        DDPStrategy(hook="int8", accumulate_steps=4)
    with pytest.raises(ValueError, match=r"ddp_comm_hook=.*pass hook="):
        DDPStrategy(ddp_comm_hook=pycomm.hooks.compressed_hook)
    with pytest.raises(ValueError, match="hook='int9' is not one of"):
        DDPStrategy(hook="int9")


# ---------------------------------------------------------------------------------- Lightning


def _lightning_module():
    """A LightningModule over ``_net()``: MSE loss, SGD with momentum (built in a rank, where
    Lightning is imported)."""
    import lightning.pytorch as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, i):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Module()


def _rank_lightning(tmp):
    import lightning.pytorch as L

    from pycomm.lightning import CHECKPOINT_KEY, DDPStrategy

    _quiet()

    def fit(strategy, epochs, ckpt=None, save=None):
        m = _lightning_module()
        t = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=epochs,
            accumulate_grad_batches=2,  # 5 batches a rank: the window ends at the epoch's end
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        t.fit(m, torch.utils.data.DataLoader(_data(), batch_size=4), ckpt_path=ckpt)
        if save:
            t.save_checkpoint(save)
        return _flat(m)

    out = {}
    plain = fit(L.strategies.DDPStrategy(), 2)
    strategy = DDPStrategy(hook="allreduce")
    out["allreduce"] = torch.equal(plain, fit(strategy, 2))
    out["registered_on_cpu"] = strategy.pycomm_state.stats["steps"]
    for hook in ("int8", "onebit"):
        full = fit(DDPStrategy(hook=hook), 4)
        fit(DDPStrategy(hook=hook), 2, save=f"{tmp}/{hook}.ckpt")
        resumed = fit(DDPStrategy(hook=hook), 4, ckpt=f"{tmp}/{hook}.ckpt")
        out[hook] = (torch.equal(full, resumed), (full - resumed).abs().max().item())
    saved = torch.load(f"{tmp}/int8.ckpt", weights_only=False)[CHECKPOINT_KEY]
    out["saved_ranks"] = [s["rank"] for s in saved["states"]]
    return out


def test_lightning_strategy_registers_on_cpu_and_resumes_bitwise(tmp_path):
    for r in run_ranks(_rank_lightning, 2, str(tmp_path), timeout=240):
        assert r["allreduce"], "pycomm's allreduce under Lightning differs from Lightning's DDP"
        assert r["registered_on_cpu"] > 0  # the hook ran: Lightning itself registers none on CPU
        assert r["int8"] == (True, 0.0)
        assert r["onebit"] == (True, 0.0)
        assert r["saved_ranks"] == [0, 1]


class _SteppingScaler(torch.amp.GradScaler):
    """A GradScaler whose update() moves the scale between 2^8, 2^9 and 2^10 (powers of two:
    the scaled gradients, codes and residuals are exact multiples of the unscaled)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates = 0

    def update(self, new_scale=None):
        self.updates += 1
        super().update(2.0 ** (8 + self.updates % 3))


def _rank_lightning_loss_scale():
    """Lightning's 16-mixed precision plugin, its GradScaler's scale constant or changing every
    step: the same parameters bit for bit (the residuals follow the scale)."""
    import lightning.pytorch as L
    from lightning.pytorch.plugins import MixedPrecision

    from pycomm.lightning import DDPStrategy

    _quiet()

    def fit(scaler):
        m = _lightning_module()
        t = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=DDPStrategy(hook="int8", hook_options={"start_iter": 2}),
            max_epochs=2,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        t.fit(m, torch.utils.data.DataLoader(_data(), batch_size=4))
        return _flat(m)

    constant = fit(torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=10**6))
    stepping = _SteppingScaler("cpu", init_scale=2.0**8, growth_interval=10**6)
    changing = fit(stepping)
    return torch.equal(constant, changing), stepping.updates


def test_lightning_mixed_precision_residuals_follow_the_loss_scale():
    for same, updates in run_ranks(_rank_lightning_loss_scale, 2, timeout=240):
        assert updates >= 4 and same


# --------------------------------------------------------------------------------- Accelerate


def _accelerate_run(acc, hook=None, epochs=1, register=None, save=None, load=None):
    import pycomm.accelerate as pa

    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    m, opt, loader = acc.prepare(m, opt, loader)
    if hook is not None:
        pa.register(acc, m, hook=hook)
        acc.register_for_checkpointing(pa.HookStateCheckpoint(m))
    if register is not None:
        register(m)
    if load is not None:
        acc.load_state(load)
    for epoch in range(epochs):
        for x, y in loader:
            with acc.accumulate(m):
                acc.backward(((m(x) - y) ** 2).mean())
                opt.step()
                opt.zero_grad()
        if save is not None and epoch == 0:
            acc.save_state(save)
    return m


def _rank_accelerate(tmp):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin

    import pycomm.accelerate as pa

    _quiet()
    out = {}
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)  # 5 batches a rank
    plain = _flat(_accelerate_run(acc, epochs=2))
    out["allreduce"] = torch.equal(
        plain,
        _flat(
            _accelerate_run(Accelerator(cpu=True, gradient_accumulation_steps=2), "allreduce", 2)
        ),
    )
    full = _flat(
        _accelerate_run(
            Accelerator(cpu=True, gradient_accumulation_steps=2), "int8", 3, save=f"{tmp}/ckpt"
        )
    )
    resumed = _accelerate_run(
        Accelerator(cpu=True, gradient_accumulation_steps=2), "int8", 2, load=f"{tmp}/ckpt"
    )
    out["int8_resume"] = torch.equal(full, _flat(resumed))
    state = pycomm.hook_state(resumed)

    # the hook state itself, registered for checkpointing: rank 0 writes it for everyone
    acc = Accelerator(cpu=True)
    m = _accelerate_run(acc, register=lambda m: pycomm.register(m, hook="int8"), epochs=1)
    acc.register_for_checkpointing(pycomm.hook_state(m))
    acc.save_state(f"{tmp}/raw")
    acc.wait_for_everyone()  # rank 0 writes the files every rank reads
    out["raw_load"] = _error(lambda: acc.load_state(f"{tmp}/raw"))

    # two accumulators
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    m = acc.prepare(_net())
    out["helper_k"] = _error(lambda: pa.register(acc, m, hook="int8", accumulate_steps=2))
    out["no_sync"] = _error(
        lambda: _accelerate_run(acc, register=lambda m: pycomm.register(m, accumulate_steps=2))
    )
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    out["tail"] = _error(
        lambda: _accelerate_run(acc, register=lambda m: pycomm.register(m, accumulate_steps=2))
    )
    # nested DDP, and a pycomm hook handed to Accelerate's kwargs (which drops it)
    acc = Accelerator(cpu=True)
    nested = acc.prepare(pycomm.wrap(_net(), hook="int8"))
    out["nested"] = _error(lambda: nested(torch.randn(2, 16)))
    kwargs = DistributedDataParallelKwargs(comm_hook=pycomm.hooks.compressed_hook)
    acc = Accelerator(cpu=True, kwargs_handlers=[kwargs])
    out["comm_hook"] = _error(lambda: pa.register(acc, acc.prepare(_net()), hook="int8"))
    out["steps"] = state.stats["steps"]
    return out


def test_accelerate_helpers_match_plain_runs_and_refuse_the_rest(tmp_path):
    results = run_ranks(_rank_accelerate, 2, str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        assert r["allreduce"], "pycomm's allreduce under Accelerate differs from Accelerate's DDP"
        assert r["int8_resume"]
        assert r["steps"] == 9  # 3 optimizer steps before the save (restored), 6 after
        if rank == 0:
            assert r["raw_load"] is None  # its own state
        else:
            assert "cannot load the hook state of rank 0 on rank 1" in r["raw_load"]
        assert (
            "accumulate_steps=2 with the accelerator's gradient_accumulation_steps=2"
            in r["helper_k"]
        )
        assert "two gradient accumulators" in r["no_sync"]
        assert "Pass accumulate_steps=1" in r["no_sync"]
        assert "optimizer.step() after micro-step 1 of a window of accumulate_steps=2" in r["tail"]
        assert "inside a second DistributedDataParallel" in r["nested"]
        assert "comm_hook=<function compressed_hook" in r["comm_hook"]


# ------------------------------------------------------------------------- DDP's own options


class _Kitchen(torch.nn.Module):
    """Tied weights, a buffer (BatchNorm), activation checkpointing, an unused branch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(16, 16, bias=False)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 16, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.unused = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, self.embed(x), use_reentrant=False)
        return self.head(self.norm(h))


def _train_loop(ddp, steps, k, **loop_kw):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loop = pycomm.TrainLoop(ddp, opt, accumulate_steps=k, **loop_kw)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(steps * k):
        x = torch.randn(6, 16, generator=g)
        loop.step(lambda x=x: ddp(x).square().mean())
    return loop, opt


def _rank_ddp(tmp):
    out = {}
    rank = dist.get_rank()
    # a state built before the group, bound at the first hook call
    dist.destroy_process_group()
    early = pycomm.hooks.hook_spec("int8").state(None)
    out["unbound"] = early._world_size is None
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/pg",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=20),
    )
    ddp = DDP(_net())
    ddp.register_comm_hook(early, pycomm.hooks.compressed_hook)
    for _ in range(4):
        ddp(torch.randn(4, 16)).sum().backward()
    out["early"] = (
        early.rank,
        early.world_size,
        early.stats["steps"],
        early.stats["compression"] > 1,
    )

    # rank-safe state: another rank's is refused, the gathered one hands each rank its own
    sd = early.state_dict()
    theirs = [None, None]
    dist.all_gather_object(theirs, sd)
    out["other_rank"] = _error(lambda: early.load_state_dict(theirs[1 - rank]))
    blob = pycomm.checkpoint.gather_hook_state(early)
    fresh = pycomm.hooks.hook_spec("int8").state(None)
    pycomm.checkpoint.load_hook_state(fresh, blob)
    out["gathered"] = fresh.state_dict()["rank"] == rank and all(
        torch.equal(a["r1"], b["r1"])
        for a, b in zip(fresh.store.pending.values(), early.residuals.values())
    )

    # static_graph: no no_sync accumulation; pycomm's stage accumulates there, bit for bit
    static = DDP(_net(), static_graph=True)
    out["static_plain"] = _error(
        lambda: pycomm.TrainLoop(static, torch.optim.SGD(static.parameters()), accumulate_steps=2)
    )
    ref, _ = _train_loop(DDP(_net(), gradient_as_bucket_view=True), 3, 2)
    stage, _ = _train_loop(pycomm.wrap(_net(), accumulate_steps=2, static_graph=True), 3, 2)
    out["static_stage"] = torch.equal(_flat(ref.ddp.module), _flat(stage.ddp.module))

    # tied weights, a buffer, activation checkpointing, an unused branch; views either way.
    # Buffers: DDP broadcasts rank 0's at every synchronized forward, which no_sync() skips
    # and pycomm's stage does not, so with broadcast_buffers=True rank 1's running stats
    # differ inside a window (the parameters do not): compared where buffers stay local.
    for view, bcast in ((False, True), (True, False)):
        kw = dict(
            find_unused_parameters=True, gradient_as_bucket_view=view, broadcast_buffers=bcast
        )
        ref, _ = _train_loop(DDP(_Kitchen(), **kw), 3, 2)
        ours, _ = _train_loop(pycomm.wrap(_Kitchen(), accumulate_steps=2, **kw), 3, 2)
        same = [
            torch.equal(a, b)
            for a, b in zip(ref.ddp.module.parameters(), ours.ddp.module.parameters())
        ]
        if not bcast or rank == 0:
            same += [
                torch.equal(a, b)
                for a, b in zip(ref.ddp.module.buffers(), ours.ddp.module.buffers())
            ]
        out[f"kitchen_view{view}"] = all(same)

    # parameters excluded from DDP: the clipping norm covers every gradient the optimizer steps
    model = _net()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["2.bias"])
    ddp = pycomm.wrap(model, hook="int8")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    norms = []
    opt.register_step_pre_hook(
        lambda o, a, k: norms.append(
            float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        )
    )
    loop = pycomm.TrainLoop(ddp, opt, max_grad_norm=0.01)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(4):
        x = torch.randn(6, 16, generator=g)
        loop.step(lambda x=x: ddp(x).square().mean() * 100)
    out["clipped"] = norms

    # join() with uneven inputs: pycomm's allreduce gives plain DDP's parameters
    def uneven(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(10 + rank)
        with ddp.join():
            for _ in range(5 - rank):
                opt.zero_grad()
                ddp(torch.randn(4, 16, generator=g)).sum().backward()
                opt.step()
        return _flat(ddp.module)

    out["join"] = torch.equal(uneven(DDP(_net())), uneven(pycomm.wrap(_net())))
    out["join_int8"] = uneven(pycomm.wrap(_net(), hook="int8"))

    # two accumulators with DDP's own no_sync(), and an optimizer step inside the window
    ddp = pycomm.wrap(_net(), accumulate_steps=4)
    with ddp.no_sync():
        out["no_sync"] = _error(lambda: ddp(torch.randn(2, 16)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(2, 16)).sum().backward()
    out["mid_window"] = _error(opt.step)
    return out


def test_ddp_options_work_or_refuse(tmp_path):
    results = run_ranks(_rank_ddp, 2, str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        assert r["unbound"]
        assert r["early"] == (rank, 2, 4, True)
        assert f"cannot load the hook state of rank {1 - rank} on rank {rank}" in r["other_rank"]
        assert r["gathered"]
        assert (
            "static_graph=True" in r["static_plain"] and "accumulate_steps=2" in r["static_plain"]
        )
        assert r["static_stage"]
        assert r["kitchen_viewFalse"] and r["kitchen_viewTrue"]
        assert len(r["clipped"]) == 4
        for n in r["clipped"]:  # clipped to 0.01: the norm covers the excluded bias too
            assert n == pytest.approx(0.01, rel=1e-3)
        assert r["join"]
        assert "two gradient accumulators" in r["no_sync"] and "accumulate_steps=4" in r["no_sync"]
        assert (
            "optimizer.step() after micro-step 1 of a window of accumulate_steps=4"
            in r["mid_window"]
        )
    assert torch.equal(results[0]["join_int8"], results[1]["join_int8"])
