"""Issue 7, reliability: bad launcher values, a port in use, ranks that disagree, die or stall,
hooks registered at the wrong time, resource growth over a long run, checkpoints and restarts.

Every fault test sets a short process-group timeout T and asserts the failure arrives within
T + 2 s: a bound on a failure's deadline, not a speed measurement.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import pickle
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from harness import TESTS, run_ranks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm

pytestmark = pytest.mark.timeout(150)

T = 3.0  # the process-group timeout the fault tests set
BOUND = T + 2.0  # every failure must arrive within this many seconds
KILL_CODE = 9
PEER_LOST = re.compile(r"by peer|remote worker|broken pipe|connection (reset|closed|refused)", re.I)
SCRIPTS = os.path.join(TESTS, "scripts")

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(seed=0, hidden=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)
    )


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)


def _step(ddp, opt, step, rank):
    x, y = _batch(step, rank)
    loss = ((ddp(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


# --------------------------------------------------- ranks with an environment each (no agent)


def _run_with_env(fn, env, out, args):
    """A spawned rank: its own launcher variables, fn's result pickled to ``out``."""
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    os.environ.update(env)
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = {"unexpected": repr(exc)}
    with open(out, "wb") as f:
        pickle.dump(result, f)
    os._exit(0)  # no interpreter teardown next to a broken process group


def spawn_ranks(fn, envs, *args, deadline=60.0):
    """Run ``fn(*args)`` in one spawned process per environment in ``envs``; their results in
    order. A process still running after ``deadline`` seconds fails the test. Started as
    pycomm.launch starts ranks (PYCOMM_START_METHOD: forkserver in this suite, see conftest)."""
    ctx = multiprocessing.get_context(os.environ.get("PYCOMM_START_METHOD") or "spawn")
    tmp = tempfile.mkdtemp(prefix="pycomm-faults-")
    try:
        outs = [os.path.join(tmp, f"{i}.pkl") for i in range(len(envs))]
        procs = [
            ctx.Process(target=_run_with_env, args=(fn, env, out, args))
            for env, out in zip(envs, outs)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        assert not hung, f"process(es) {hung} still running after {deadline} s"
        results = []
        for p, out in zip(procs, outs):
            assert os.path.exists(out), f"a process exited with code {p.exitcode} and no result"
            with open(out, "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _init_then_allreduce(timeout):
    """Join the group and all-reduce once; report the error and how long this rank waited."""
    start = time.monotonic()
    try:
        pycomm.init("gloo", timeout=timeout)
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"ok": t.item(), "elapsed": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "elapsed": time.monotonic() - start,
        }


def _env(rank, world_size, port):
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _assert_failed_in_time(results):
    for rank, r in enumerate(results):
        assert "unexpected" not in r, r
        assert "ok" not in r, f"rank {rank} did not fail: {r}"
        assert r["elapsed"] < BOUND, f"rank {rank} failed after {r['elapsed']:.1f} s: {r}"


# ------------------------------------------------------------- row 1: bad launcher variables

TR, SL = "torchrun environment", "SLURM environment"
GOOD_TR = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
GOOD_SL = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]"}
# (environment, variable, bad value or None when missing, source)
BAD_ENV = [
    ({**GOOD_TR, "RANK": ""}, "RANK", None, TR),
    ({k: v for k, v in GOOD_TR.items() if k != "WORLD_SIZE"}, "WORLD_SIZE", None, TR),
    ({**GOOD_TR, "RANK": "one"}, "RANK", "one", TR),
    ({**GOOD_TR, "WORLD_SIZE": "2.5"}, "WORLD_SIZE", "2.5", TR),
    ({**GOOD_TR, "RANK": "-1"}, "RANK", "-1", TR),
    ({**GOOD_TR, "WORLD_SIZE": "-4"}, "WORLD_SIZE", "-4", TR),
    ({**GOOD_TR, "RANK": "2"}, "RANK", "2", TR),
    ({**GOOD_TR, "RANK": "7"}, "RANK", "7", TR),
    ({**GOOD_TR, "LOCAL_RANK": "-3"}, "LOCAL_RANK", "-3", TR),
    ({**GOOD_TR, "MASTER_PORT": "port"}, "MASTER_PORT", "port", TR),
    ({k: v for k, v in GOOD_TR.items() if k != "MASTER_PORT"}, "MASTER_PORT", None, TR),
    ({"SLURM_PROCID": "1"}, "SLURM_NTASKS", None, SL),
    ({**GOOD_SL, "SLURM_PROCID": "x1"}, "SLURM_PROCID", "x1", SL),
    ({**GOOD_SL, "SLURM_NTASKS": "-2"}, "SLURM_NTASKS", "-2", SL),
    ({**GOOD_SL, "SLURM_PROCID": "-1"}, "SLURM_PROCID", "-1", SL),
    ({**GOOD_SL, "SLURM_PROCID": "2"}, "SLURM_PROCID", "2", SL),
    ({**GOOD_SL, "SLURM_LOCALID": "2"}, "SLURM_LOCALID", "2", SL),
]


def _socket_fds():
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                fds.append(fd)
        except OSError:
            pass
    return sorted(fds)


@pytest.mark.parametrize(
    "env, name, value, source",
    BAD_ENV,
    ids=[f"{c[1]}={c[2]!r}" for c in BAD_ENV],
)
def test_bad_launcher_variable_fails_fast_without_a_socket(monkeypatch, env, name, value, source):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, val in env.items():
        monkeypatch.setenv(var, val)
    pycomm.shutdown()
    opened = []

    def forbidden(*args, **kwargs):
        opened.append(args)
        raise AssertionError("a socket, store or process group was opened before validation")

    # Python sockets, torch's stores (C++ sockets) and every way into a process group.
    monkeypatch.setattr(socket, "socket", forbidden)
    monkeypatch.setattr(socket, "create_connection", forbidden)
    monkeypatch.setattr(dist, "TCPStore", forbidden)
    monkeypatch.setattr(dist, "FileStore", forbidden)
    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(threading.Thread, "start", forbidden)
    sockets_before = _socket_fds()
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        pycomm.init("gloo", timeout=T)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert (f"{name} is not set" if value is None else f"{name}={value!r}") in message
    assert f"({source})" in message and "expected" in message
    assert elapsed < 1.0, f"took {elapsed:.2f} s"
    assert opened == [] and _socket_fds() == sockets_before
    assert not dist.is_initialized()


# ------------------------- rows 2 and 3: port in use, world sizes differ, a rank never joins


@pytest.fixture(scope="module")
def init_faults():
    """Three broken jobs of 2 ranks, run side by side (6 processes, one start-up cost): the
    port held by another program; rank 1 believing in 3 ranks; ranks that never join."""
    holder = socket.socket()  # another program holds the port: accepts, never answers
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)
    port = holder.getsockname()[1]
    ws_port = _free_port()
    envs = {
        "port": [_env(0, 2, port), _env(1, 2, port)],
        "world_size": [_env(0, 2, ws_port), _env(1, 3, ws_port)],
        # one job lacks its rank 1, another its rank 0
        "missing": [_env(0, 2, _free_port()), _env(1, 2, _free_port())],
    }
    try:
        flat = spawn_ranks(_init_then_allreduce, [e for job in envs.values() for e in job], T)
    finally:
        holder.close()
    results = {name: flat[2 * i : 2 * i + 2] for i, name in enumerate(envs)}
    return results, port


def test_port_in_use_names_the_port_within_the_timeout(init_faults):
    results, port = init_faults
    _assert_failed_in_time(results["port"])
    for r in results["port"]:
        assert str(port) in r["message"], r
    assert "already in use" in results["port"][0]["message"]


def test_world_size_differs_between_ranks_every_rank_fails(init_faults):
    results, _ = init_faults
    _assert_failed_in_time(results["world_size"])
    # the rank that waits for a third rank is told what to check
    assert "world size (this rank: 3)" in results["world_size"][1]["message"]


def test_rank_that_never_joins_fails_the_others(init_faults):
    results, _ = init_faults
    _assert_failed_in_time(results["missing"])
    for r in results["missing"]:
        assert "could not join" in r["message"] and "all 2 ranks must start" in r["message"]


# ------------------------------------------ rows 4 and 5: a rank dies or stalls in its hook


def _custom_hook_ddp(group, on_step):
    """DDP with a hook that all-reduces on ``group`` after calling ``on_step(step)``."""
    ddp = DDP(_model(), process_group=group)
    state = {"step": 0}

    def stalling_or_dying_hook(state, bucket):
        on_step(state["step"])
        t = bucket.buffer().div_(dist.get_world_size(group))
        work = dist.all_reduce(t, group=group, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(state, stalling_or_dying_hook)
    return ddp, state


def _int8_ddp(group, on_step):
    """DDP with pycomm's int8 hook, wrapped to call ``on_step(iteration)`` first."""
    ddp = DDP(_model(), process_group=group)
    state = pycomm.hooks.hook_spec("int8").state(group)

    def dying_int8_hook(state, bucket):  # or stalling
        on_step(state.iter)
        return pycomm.hooks.compressed_hook(state, bucket)

    ddp.register_comm_hook(state, dying_int8_hook)
    return ddp, {"step": None}


def _wait_for_everyone(ready, deadline=60.0):
    """A barrier across launches: mark this process ready in ``ready`` (a folder, with the
    number of processes to wait for), then wait for all of them; so that the faults begin
    once every launch running side by side is past its start-up."""
    folder, count = ready
    open(os.path.join(folder, f"{os.getpid()}.ready"), "w").close()
    end = time.monotonic() + deadline
    while len([f for f in os.listdir(folder) if f.endswith(".ready")]) < count:
        if time.monotonic() > end:
            raise TimeoutError(f"only some of {count} processes started within {deadline} s")
        time.sleep(0.05)


def _rank_fault_in_hook(out_dir, kind, fault, k, ready):
    """Train on a group with timeout T; rank 1 dies or stalls inside the hook at step k. The
    survivors write their error and how long after the step began it came, then re-raise."""
    rank = dist.get_rank()
    group = dist.new_group(timeout=datetime.timedelta(seconds=T))

    def on_step(step):
        if rank == 1 and step == k:
            if fault == "die":
                os._exit(KILL_CODE)
            time.sleep(120)  # stalls far past T; launch kills it

    ddp, state = (_int8_ddp if kind == "int8" else _custom_hook_ddp)(group, on_step)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    _wait_for_everyone(ready)
    for step in range(k + 3):
        if state["step"] is not None:
            state["step"] = step
        began = time.monotonic()
        try:
            _step(ddp, opt, step, rank)
        except Exception as exc:
            record = {"step": step, "error": str(exc), "elapsed": time.monotonic() - began}
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(record, f)
            raise
    return "finished"


FAULTS = {"die": 3, "stall": 2}  # the fault and its step; int8 compresses from iteration 2 on
KINDS = ("custom", "int8")


@pytest.fixture(scope="module")
def faults_in_hook(tmp_path_factory):
    """The four launches of rows 4 and 5 (a rank dies or stalls, in a hook of our own or in
    int8) side by side, in threads: 8 processes, one start-up's wait and one T instead of
    four. Their ranks start faulting together once all 8 are built (``_wait_for_everyone``),
    so that no launch's start-up slows another's failure. {(fault, kind): (the LaunchError or
    None, rank 0's record or None)}."""
    ready = str(tmp_path_factory.mktemp("ready"))
    results = {}

    def one(fault, kind):
        out_dir = tmp_path_factory.mktemp(f"{fault}-{kind}")
        args = (str(out_dir), kind, fault, FAULTS[fault], (ready, 2 * len(FAULTS) * len(KINDS)))
        try:
            run_ranks(_rank_fault_in_hook, 2, *args, timeout=90, fresh=True)
            error = None
        except pycomm.LaunchError as exc:
            error = exc
        record = out_dir / "rank0.json"
        results[fault, kind] = (error, json.loads(record.read_text()) if record.exists() else None)

    threads = [threading.Thread(target=one, args=(f, k)) for f in FAULTS for k in KINDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_rank_killed_in_hook_others_see_a_lost_peer(faults_in_hook, kind):
    e, survivor = faults_in_hook["die", kind]
    assert isinstance(e, pycomm.LaunchError), e
    assert (e.rank, e.exitcode) == (1, KILL_CODE), str(e)
    assert "rank 1" in str(e) and f"code {KILL_CODE}" in str(e)
    assert survivor["step"] == FAULTS["die"]
    assert PEER_LOST.search(survivor["error"]), survivor["error"]
    assert survivor["elapsed"] < BOUND, survivor


@pytest.mark.parametrize("kind", KINDS)
def test_rank_stalled_in_hook_is_named_after_the_timeout(faults_in_hook, kind):
    # int8: rank 0 waits in the two-phase exchange, on the hook's own process groups, which
    # must time out as the group given to the hook does (not after torch's default 30 min)
    e, survivor = faults_in_hook["stall", kind]
    assert isinstance(e, TimeoutError), str(e)
    assert e.rank == 1 and e.unfinished == (1,), str(e)
    assert "[1]" in str(e) and "stalled" in str(e)
    hook = "stalling_or_dying_hook" if kind == "custom" else "dying_int8_hook"
    assert hook in e.traceback  # where rank 1 was stuck
    assert survivor["step"] == FAULTS["stall"]
    assert re.search(r"timed out|timeout", survivor["error"], re.I), survivor["error"]
    assert T - 0.5 < survivor["elapsed"] < BOUND, survivor


# ------------------------------------------- row 6: a hook registered twice or too late


def _register_error(ddp, **kwargs):
    try:
        pycomm.register(ddp, **kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return type(exc).__name__, str(exc)


def _rank_register_errors():
    rank = dist.get_rank()
    out = {}
    # trained one step, gradients zeroed (set to None) afterwards
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _step(ddp, opt, 0, rank)
    opt.zero_grad(set_to_none=True)
    out["after_one_step"] = _register_error(ddp)
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        _step(ddp, opt, step, rank)
    out["after_three_steps"] = _register_error(ddp, hook="int8")
    ddp = DDP(_model())
    with ddp.no_sync():
        ddp(_batch(0, rank)[0]).sum().backward()
    out["after_no_sync_backward"] = _register_error(ddp)
    ddp = DDP(_model())
    with torch.no_grad():
        ddp(_batch(0, rank)[0])  # evaluation is not training
    out["after_eval_forward"] = _register_error(ddp)
    out["twice"] = _register_error(ddp)
    out["on_wrap"] = _register_error(pycomm.wrap(_model()), hook="int8")
    ddp = DDP(_model())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    out["torch_hook_first"] = _register_error(ddp)
    # only rank 0 trained: every rank must get the error, none may wait for the others
    ddp = DDP(_model())
    if rank == 0:
        with ddp.no_sync():
            ddp(_batch(0, rank)[0]).sum().backward()
    out["one_rank_trained"] = _register_error(ddp)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works: no rank was left behind in a collective
    out["group_ok"] = t.item()
    return out


def test_register_twice_or_after_training_is_a_clear_error():
    for out in run_ranks(_rank_register_errors, 2, timeout=90):
        for case in ("after_one_step", "after_three_steps", "after_no_sync_backward"):
            assert out[case] is not None, case
            assert out[case][0] == "RuntimeError", out[case]
            assert "already trained" in out[case][1] and "before the first" in out[case][1]
        assert out["after_eval_forward"] is None
        assert out["twice"][0] == "RuntimeError"
        assert "already has a pycomm hook (allreduce)" in out["twice"][1]
        assert "already has a pycomm hook" in out["on_wrap"][1]
        assert out["torch_hook_first"][0] == "RuntimeError"
        assert "'allreduce_hook'" in out["torch_hook_first"][1]
        assert out["one_rank_trained"][0] == "ValueError"
        assert "ranks disagree on state of the DDP model" in out["one_rank_trained"][1]
        assert out["group_ok"] == 2.0


# --------------------------------------------- row 8: no growth over 500 steps with int8

SOAK_STEPS, SOAK_WARMUP, SOAK_EVERY = 500, 100, 50


def _resources():
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {
        "rss": rss_kb * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "tasks": len(os.listdir("/proc/self/task")),
        "threads": threading.active_count(),
    }


def _rank_soak():
    rank = dist.get_rank()
    ddp = pycomm.wrap(_model(hidden=64), hook="int8")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    samples = []
    for step in range(1, SOAK_STEPS + 1):
        _step(ddp, opt, step, rank)
        if step >= SOAK_WARMUP and step % SOAK_EVERY == 0:
            samples.append(_resources())
    return samples, dict(pycomm.hook_state(ddp).stats)


@pytest.mark.slow
def test_int8_500_steps_on_4_ranks_does_not_grow():
    for rank, (samples, stats) in enumerate(run_ranks(_rank_soak, 4, timeout=240)):
        assert stats["steps"] == SOAK_STEPS and stats["compression"] > 2  # int8 ran
        base, rest = samples[0], samples[1:]
        peak = max(s["rss"] for s in rest)
        assert peak <= 1.05 * base["rss"], (rank, [s["rss"] for s in samples])
        for key in ("fds", "tasks", "threads"):
            assert max(s[key] for s in rest) <= base[key], (rank, key, samples)


# --------------------------------------------------------------- row 10: pycomm.checkpoint


def _params(ddp):
    return [p.detach().clone() for p in ddp.module.parameters()]


def _rank_save_then_die_mid_save(path, out_dir, hook):
    """Train 4 steps, save; train 2 more and start another save, during which rank 0 is
    killed while writing the checkpoint file itself (the hook files are already written)."""
    rank = dist.get_rank()
    ddp = pycomm.wrap(_model(), hook=hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        _step(ddp, opt, step, rank)
    state = pycomm.hook_state(ddp)
    torch.save(
        {"params": _params(ddp), "hook": state.state_dict(), "opt": opt.state_dict()},
        os.path.join(out_dir, f"saved{rank}.pt"),
    )
    pycomm.checkpoint.save(path, ddp, opt, step=4, note="first")
    for step in range(4, 6):
        _step(ddp, opt, step, rank)
    if rank == 0:
        real = torch.save

        def torn_save(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and obj.get("format") == pycomm.checkpoint.FORMAT:
                f.write(b"half a checkpoint")
                f.flush()
                os._exit(KILL_CODE)
            return real(obj, f, *args, **kwargs)

        torch.save = torn_save
    pycomm.checkpoint.save(path, ddp, opt, step=6, note="second")
    return "unreachable"


def _load_error(path, ddp, opt):
    try:
        pycomm.checkpoint.load(path, ddp, opt)
        return None
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return type(exc).__name__, str(exc)


def _rank_load(path, hook):
    ddp = pycomm.wrap(_model(seed=5), hook=hook)  # other initial values: the load must matter
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = pycomm.hook_state(ddp)
    loaded = {}
    original = state.load_state_dict

    def capture(sd):
        loaded["hook"] = sd
        original(sd)

    state.load_state_dict = capture
    extra = pycomm.checkpoint.load(path, ddp, opt)
    result = {
        "extra": extra,
        "params": _params(ddp),
        "hook": loaded["hook"],
        "opt": opt.state_dict(),
    }
    # a model of another shape, another hook, no hook: refused, nothing changed
    other = pycomm.wrap(_model(hidden=12), hook=hook)
    result["other_model"] = _load_error(path, other, torch.optim.SGD(other.parameters(), lr=0.1))
    other_hook = "allreduce" if hook == "int8" else "int8"
    other = pycomm.wrap(_model(), hook=other_hook)
    result["other_hook"] = _load_error(path, other, torch.optim.SGD(other.parameters(), lr=0.1))
    plain = DDP(_model(seed=7))
    result["no_hook"] = _load_error(path, plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    # another optimizer class (torch failed half-way, the model already loaded)
    other = pycomm.wrap(_model(seed=7), hook=hook)
    result["other_optimizer"] = _load_error(path, other, torch.optim.Adam(other.parameters()))
    result["other_optimizer_untouched"] = torch.equal(
        next(other.module.parameters()), next(_model(seed=7).parameters())
    )
    # a file with the format but not the rest; a path that is no regular file; an empty one
    folder = os.path.dirname(path)
    torn = os.path.join(folder, f"torn{dist.get_rank()}.pt")
    torch.save({"format": pycomm.checkpoint.FORMAT}, torn)
    result["torn"] = _load_error(torn, ddp, opt)
    fifo = os.path.join(folder, "fifo")
    if dist.get_rank() == 0:
        os.mkfifo(fifo)
    dist.barrier()
    try:
        pycomm.checkpoint.save(fifo, ddp, opt)
        result["fifo"] = None
    except ValueError as e:
        result["fifo"] = (str(e), stat.S_ISFIFO(os.stat(fifo).st_mode))
    result["empty"] = _load_error("", ddp, opt)
    result["no_hook_untouched"] = torch.equal(
        next(plain.module.parameters()), next(_model(seed=7).parameters())
    )
    # another world size: the same model and hook on a group of one rank
    alone = dist.new_group([0])
    if dist.get_rank() == 0:
        ddp = pycomm.wrap(_model(), hook=hook, process_group=alone)
        result["other_world"] = _load_error(path, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    return result


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_checkpoint_save_load_atomic_and_mismatches(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(pycomm.LaunchError) as err:
        run_ranks(
            _rank_save_then_die_mid_save, 2, path, str(tmp_path), "int8", timeout=90, fresh=True
        )
    assert (err.value.rank, err.value.exitcode) == (0, KILL_CODE)
    # the killed save left the first checkpoint whole; a fresh process group loads it
    results = run_ranks(_rank_load, 2, path, "int8", timeout=90)
    saved = [torch.load(tmp_path / f"saved{r}.pt", weights_only=True) for r in range(2)]
    for rank, (r, s) in enumerate(zip(results, saved)):
        assert r["extra"] == {"step": 4, "note": "first"}
        assert all(torch.equal(a, b) for a, b in zip(r["params"], s["params"]))
        assert _same(r["opt"], s["opt"])  # momentum buffers too
        assert _same(r["hook"], s["hook"]), rank  # residuals, counters, fingerprint
        assert r["other_model"][0] == "ValueError" and "parameter 0" in r["other_model"][1]
        assert "[16, 8]" in r["other_model"][1] and "[12, 8]" in r["other_model"][1]
        assert r["other_hook"][0] == "ValueError"
        assert "'int8' in the checkpoint but 'allreduce'" in r["other_hook"][1]
        assert r["no_hook"][0] == "ValueError" and "no pycomm hook" in r["no_hook"][1]
        assert r["no_hook_untouched"] and r["other_optimizer_untouched"]
        assert r["other_optimizer"][0] == "ValueError"
        assert (
            "is of another optimizer: its parameter group 0 has options ['dampening'"
            in (r["other_optimizer"][1])
        )
        assert r["torn"][0] == "ValueError" and "lacks ['world_size', 'parameters'" in r["torn"][1]
        message, still_a_fifo = r["fifo"]
        assert still_a_fifo and "fifo' is not a regular file; expected the path" in message
        assert r["empty"] == (
            "ValueError",
            "pycomm.checkpoint.load: path='' is empty, expected a file path",
        )
    # each rank got its own hook state back (error-feedback residuals differ between ranks)
    assert not _same(results[0]["hook"], results[1]["hook"])
    other_world = results[0]["other_world"]
    assert other_world[0] == "ValueError"
    assert "world_size=2" in other_world[1] and "world_size=1" in other_world[1]


def _rank_one_rank_fails(path, case):
    """A save or a load that fails on one rank only: (error type, message, what is on disk,
    whether the model changed) on each rank."""
    rank = dist.get_rank()
    ddp = pycomm.wrap(_model(), hook="int8")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _step(ddp, opt, 0, rank)
    extra = {"step": 1}
    if case == "load: rank 1's hook file is gone":
        pycomm.checkpoint.save(path, ddp, opt, step=1)
        dist.barrier()
        if rank == 1:
            folder = os.path.dirname(path)
            os.remove(os.path.join(folder, next(f for f in os.listdir(folder) if ".hook1." in f)))
        dist.barrier()
        ddp = pycomm.wrap(_model(seed=3), hook="int8")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    elif case == "save: the path is a folder":
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
    elif case == "save: an extra value load cannot read":
        extra["args"] = _Unloadable()
    before = _params(ddp)
    try:
        if case.startswith("load"):
            pycomm.checkpoint.load(path, ddp, opt)
        else:
            pycomm.checkpoint.save(path, ddp, opt, **extra)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        error = (type(exc).__name__, str(exc))
    dist.barrier()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _params(ddp)))
    return error, sorted(os.listdir(os.path.dirname(path))), unchanged


class _Unloadable:
    """An object torch.save writes and torch.load(weights_only=True) refuses."""


@pytest.mark.parametrize(
    "case, kind, pattern",
    [
        ("load: rank 1's hook file is gone", "FileNotFoundError", r"on rank 1: .* names the hook "
         r"state of rank 1 in .*hook1.*, which is missing"),
        ("save: the path is a folder", "ValueError", r"save: path='.*ckpt.pt' is a folder; "
         "expected the path of a checkpoint file"),
        ("save: an extra value load cannot read", "ValueError", r"save: extra value "
         r"args=_Unloadable cannot be loaded back with weights_only=True"),
    ],
)  # fmt: skip
def test_a_checkpoint_failing_on_one_rank_is_raised_on_every_rank(tmp_path, case, kind, pattern):
    path = str(tmp_path / "ckpt.pt")
    for error, files, unchanged in run_ranks(_rank_one_rank_fails, 2, path, case, timeout=60):
        assert error is not None and error[0] == kind, error
        assert re.search(pattern, error[1]), error[1]
        assert unchanged  # a failed load changes nothing
        if case.startswith("save"):  # nothing of the failed save is left, no checkpoint
            assert [f for f in files if f.startswith("ckpt.pt.hook")] == []


# ------------------------------------------ row 9: torchrun --max-restarts=1, a rank killed


def _torchrun_logs(log_dir) -> str:
    """The tail of each attempt's rank logs that torchrun's ``--log-dir`` wrote."""
    parts = []
    for path in sorted(log_dir.rglob("*.log")):
        text = path.read_text(errors="replace")
        if text.strip():
            parts.append(f"--- {path.relative_to(log_dir)}:\n{text[-1500:]}")
    return "\n".join(parts) or "(no rank logs)"


@pytest.mark.slow
def test_torchrun_restart_resumes_from_checkpoint_equal_to_uninterrupted(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    # A fresh rendezvous store per restart: torchrun's shared one keeps the failed attempt's
    # addresses, which a restarted rank may read (pytorch/pytorch#135712; pycomm.init warns).
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    steps, every, kill_step = 10, 3, 7  # checkpoints after steps 3, 6, 9; killed at step 7
    log_dir = tmp_path / "logs"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        # One restart is needed; a second one is a production job's restart budget. It
        # absorbed, once in CI, an abort at exit ("terminate called without an active
        # exception": the exit race that pycomm.dist.settle_at_exit closes). Which attempt
        # finished is checked below.
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.2",
        "--log-dir",
        str(log_dir),
        "--tee",
        "3",
        os.path.join(SCRIPTS, "train_restart.py"),
        str(tmp_path),
        str(steps),
        str(every),
        str(kill_step),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops its workers on SIGTERM (they have sessions of their own)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"torchrun still running after 100 s:\n{_torchrun_logs(log_dir)}")
    assert proc.returncode == 0, f"{out[-2000:]}\n{_torchrun_logs(log_dir)}"
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    logs = _torchrun_logs(log_dir)
    restart = records[0]["restart"]
    for r in records:
        assert r["restart"] == restart  # both ranks finished in the same attempt
        assert r["final"] == r["uninterrupted"], logs
    assert records[0]["final"] == records[1]["final"]
    assert (tmp_path / "killed.txt").read_text() == f"rank 1 killed at step {kill_step}"
    if restart == 1:  # the first attempt was killed, the second finished
        assert [r["resumed_from"] for r in records] == [6, 6]  # the last checkpoint before the kill
    else:
        # The second attempt failed too (logged below); the third resumed from the last
        # checkpoint that the second one saved (6, or 9 when it failed after step 9).
        assert restart == 2, logs
        assert records[0]["resumed_from"] == records[1]["resumed_from"] in (6, 9), logs
        warnings.warn(f"torchrun needed a second restart:\n{logs}", stacklevel=1)
