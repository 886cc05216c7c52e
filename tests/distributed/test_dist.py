"""pycomm.init / shutdown: backend names, launcher environment resolution, validation."""

from __future__ import annotations

import datetime
import importlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import pycomm
import pycomm.dist as pdist

# torch.distributed.rendezvous is also a function name there, which `import ... as` picks up.
rendezvous = importlib.import_module("torch.distributed.rendezvous")

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No launcher variables from the outside, no process group before or after a test."""
    saved = dict(os.environ)
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    monkeypatch.setattr(pdist, "_tcp_warned", False)
    pycomm.shutdown()
    yield
    pycomm.shutdown()
    os.environ.clear()
    os.environ.update(saved)


class Recorder:
    """Stands in for init_process_group: records the call, opens nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, backend=None, **kwargs):
        self.calls.append((backend, kwargs))

    @property
    def kwargs(self):
        assert len(self.calls) == 1, self.calls
        return self.calls[0][1]


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(dist, "init_process_group", rec)
    return rec


@pytest.fixture
def no_sockets(monkeypatch):
    """Any attempt to open a store or process group fails the test (not with ValueError)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a store or process group was created before validation failed")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(dist, "TCPStore", forbidden)
    monkeypatch.setattr(dist, "HashStore", forbidden)
    monkeypatch.setattr(rendezvous, "_create_c10d_store", forbidden)


def setenv(values):
    for name, value in values.items():
        os.environ[name] = value


# ---------------------------------------------------------------------------- backends


@needs_no_cuda
@pytest.mark.parametrize("name", [None, "auto", "AUTO", " Auto "])
def test_auto_backend_is_gloo_without_cuda(recorder, name):
    info = pycomm.init(name)
    assert info.backend == "gloo"
    assert recorder.calls[0][0] == "gloo"
    assert info.device == torch.device("cpu")


@pytest.mark.parametrize("name", ["gloo", "GLOO", "Gloo"])
def test_backend_names_are_case_insensitive(recorder, name):
    assert pycomm.init(name).backend == "gloo"
    assert recorder.calls[0][0] == "gloo"


def test_tcp_alias_is_gloo_over_tcp_and_warns_once(recorder):
    setenv({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "4567"})
    with pytest.warns(UserWarning, match="'tcp'.*removed.*gloo"):
        info = pycomm.init("tcp")
    assert info.backend == "gloo"
    backend, kwargs = recorder.calls[0]
    assert backend == "gloo"
    assert kwargs["init_method"] == "tcp://10.1.2.3:4567"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pycomm.init("TCP")
    assert [w for w in caught if "tcp" in str(w.message)] == []
    assert [c[0] for c in recorder.calls] == ["gloo", "gloo"]


@needs_no_cuda
@pytest.mark.parametrize("name", ["ib", "nccl", "NCCL"])
def test_nccl_without_cuda_is_a_clear_error(no_sockets, name):
    with pytest.raises((RuntimeError, ValueError), match="CUDA is not available"):
        pycomm.init(name)


@pytest.mark.parametrize("name", ["foo", "cuda", "", 3])
def test_unknown_backend_lists_valid_names(no_sockets, name):
    with pytest.raises(ValueError) as err:
        pycomm.init(name)
    for valid in ("auto", "gloo", "nccl", "mpi", "tcp", "ib"):
        assert valid in str(err.value)
    assert repr(name) in str(err.value)


# ------------------------------------------------------------------ environment sources


def test_single_process_uses_an_in_process_store(recorder):
    info = pycomm.init()
    assert (info.rank, info.world_size, info.local_rank) == (0, 1, 0)
    kwargs = recorder.kwargs
    assert "init_method" not in kwargs
    assert isinstance(kwargs["store"], dist.HashStore)
    assert (kwargs["rank"], kwargs["world_size"]) == (0, 1)


TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "1234",
}
SLURM = {
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "3",
    "SLURM_LOCALID": "0",
    "SLURM_NODELIST": "node[01-03,07],gpu5",
}


def test_torchrun_environment(recorder):
    setenv(TORCHRUN)
    info = pycomm.init("gloo")
    assert (info.rank, info.world_size, info.local_rank) == (3, 4, 1)
    kwargs = recorder.kwargs
    assert kwargs["init_method"] == "tcp://10.0.0.7:1234"
    assert (kwargs["rank"], kwargs["world_size"]) == (3, 4)


def test_torchrun_agent_store_connects_through_env(recorder):
    setenv({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    pycomm.init("gloo")
    kwargs = recorder.kwargs
    # tcp:// would make rank 0 bind MASTER_PORT, which the torchrun agent already holds.
    assert kwargs["init_method"] == "env://"
    assert (kwargs["rank"], kwargs["world_size"]) == (3, 4)


def test_torchrun_wins_over_slurm(recorder):
    setenv({**SLURM, **TORCHRUN})
    info = pycomm.init("gloo")
    assert (info.rank, info.world_size, info.local_rank) == (3, 4, 1)
    assert recorder.kwargs["init_method"] == "tcp://10.0.0.7:1234"


def test_slurm_environment_first_host_and_job_port(recorder):
    setenv({**SLURM, "SLURM_JOB_ID": "123456"})
    info = pycomm.init("gloo")
    assert (info.rank, info.world_size, info.local_rank) == (2, 3, 0)
    assert recorder.kwargs["init_method"] == "tcp://node01:13456"


def test_slurm_default_port_and_master_overrides(recorder):
    setenv(SLURM)
    pycomm.init("gloo")
    setenv({"MASTER_ADDR": "head", "MASTER_PORT": "2222"})
    pycomm.init("gloo")
    methods = [kwargs["init_method"] for _, kwargs in recorder.calls]
    assert methods == [f"tcp://node01:{pdist.DEFAULT_MASTER_PORT}", "tcp://head:2222"]


def test_arguments_override_environment_value_by_value(recorder):
    setenv({**SLURM, **TORCHRUN})
    info = pycomm.init("gloo", rank=0)
    assert (info.rank, info.world_size) == (0, 4)
    info = pycomm.init("gloo", rank=5, world_size=8)
    assert (info.rank, info.world_size) == (5, 8)
    assert [(k["rank"], k["world_size"]) for _, k in recorder.calls] == [(0, 4), (5, 8)]


def test_arguments_without_environment(recorder):
    info = pycomm.init("gloo", rank=1, world_size=2)
    assert (info.rank, info.world_size) == (1, 2)
    assert recorder.kwargs["init_method"] == f"tcp://127.0.0.1:{pdist.DEFAULT_MASTER_PORT}"


def test_explicit_init_method_and_timeout_are_passed_through(recorder):
    pycomm.init("gloo", init_method="file:///tmp/pycomm-rdzv", rank=0, world_size=2, timeout=7)
    kwargs = recorder.kwargs
    assert kwargs["init_method"] == "file:///tmp/pycomm-rdzv"
    assert kwargs["timeout"] == datetime.timedelta(seconds=7)
    assert (kwargs["rank"], kwargs["world_size"]) == (0, 2)


def test_timeout_accepts_timedelta_and_defaults_to_torch(recorder):
    pycomm.init("gloo", timeout=datetime.timedelta(minutes=2))
    pycomm.init("gloo")
    assert recorder.calls[0][1]["timeout"] == datetime.timedelta(minutes=2)
    assert "timeout" not in recorder.calls[1][1]


def test_rank_argument_without_world_size_source(no_sockets):
    with pytest.raises(ValueError, match="rank=1.*world_size"):
        pycomm.init("gloo", rank=1)


def test_world_size_argument_without_rank_source(no_sockets):
    with pytest.raises(ValueError, match="world_size=2.*rank"):
        pycomm.init("gloo", world_size=2)


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node01", "node01"),
        ("node[01-03,07],gpu5", "node01"),
        ("gpu5,node[01-03]", "gpu5"),
        ("node[7,01-03]", "node7"),
        ("node[001-100]", "node001"),
        ("rack[1-2]-node[3-4],x", "rack1-node3"),
        ("  host-a.example.com ", "host-a.example.com"),
    ],
)
def test_slurm_nodelist_first_host(nodelist, first):
    assert pdist.parse_slurm_nodelist(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "  ", "node[01", "node]01", "node[[1]]", "[]"])
def test_slurm_nodelist_malformed(nodelist):
    with pytest.raises(ValueError, match="SLURM_NODELIST"):
        pdist.parse_slurm_nodelist(nodelist)


# --------------------------------------------------------------------------- bad values

TR = "torchrun environment"
SL = "SLURM environment"
ARG = "argument"
OK_TR = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
OK_SL = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]"}

# (environment, init arguments, variable, bad value or None when missing, source)
BAD = [
    ({"WORLD_SIZE": "2"}, {}, "RANK", None, TR),
    ({"RANK": "0"}, {}, "WORLD_SIZE", None, TR),
    ({**OK_TR, "RANK": "abc"}, {}, "RANK", "abc", TR),
    ({**OK_TR, "RANK": "1.0"}, {}, "RANK", "1.0", TR),
    ({**OK_TR, "RANK": "-1"}, {}, "RANK", "-1", TR),
    ({**OK_TR, "RANK": "2"}, {}, "RANK", "2", TR),
    ({**OK_TR, "WORLD_SIZE": "0"}, {}, "WORLD_SIZE", "0", TR),
    ({**OK_TR, "WORLD_SIZE": "-2"}, {}, "WORLD_SIZE", "-2", TR),
    ({**OK_TR, "WORLD_SIZE": "two"}, {}, "WORLD_SIZE", "two", TR),
    ({**OK_TR, "LOCAL_RANK": "x"}, {}, "LOCAL_RANK", "x", TR),
    ({**OK_TR, "LOCAL_RANK": "-1"}, {}, "LOCAL_RANK", "-1", TR),
    ({**OK_TR, "LOCAL_RANK": "2"}, {}, "LOCAL_RANK", "2", TR),
    ({**OK_TR, "LOCAL_WORLD_SIZE": "0"}, {}, "LOCAL_WORLD_SIZE", "0", TR),
    ({**OK_TR, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, {}, "LOCAL_RANK", "1", TR),
    ({**OK_TR, "MASTER_PORT": "http"}, {}, "MASTER_PORT", "http", TR),
    ({**OK_TR, "MASTER_PORT": "0"}, {}, "MASTER_PORT", "0", TR),
    ({**OK_TR, "MASTER_PORT": "65536"}, {}, "MASTER_PORT", "65536", TR),
    ({**OK_TR, "MASTER_PORT": "-5"}, {}, "MASTER_PORT", "-5", TR),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, {}, "MASTER_ADDR", None, TR),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, {}, "MASTER_PORT", None, TR),
    ({"SLURM_PROCID": "0"}, {}, "SLURM_NTASKS", None, SL),
    ({**OK_SL, "SLURM_PROCID": "x"}, {}, "SLURM_PROCID", "x", SL),
    ({**OK_SL, "SLURM_PROCID": "-1"}, {}, "SLURM_PROCID", "-1", SL),
    ({**OK_SL, "SLURM_PROCID": "2"}, {}, "SLURM_PROCID", "2", SL),
    ({**OK_SL, "SLURM_NTASKS": "0"}, {}, "SLURM_NTASKS", "0", SL),
    ({**OK_SL, "SLURM_NTASKS": "y"}, {}, "SLURM_NTASKS", "y", SL),
    ({**OK_SL, "SLURM_LOCALID": "-2"}, {}, "SLURM_LOCALID", "-2", SL),
    ({**OK_SL, "SLURM_LOCALID": "z"}, {}, "SLURM_LOCALID", "z", SL),
    ({**OK_SL, "SLURM_NODELIST": "n[1-2"}, {}, "SLURM_NODELIST", "n[1-2", SL),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, {}, "MASTER_ADDR", None, SL),
    ({**OK_SL, "MASTER_PORT": "99999"}, {}, "MASTER_PORT", "99999", "environment"),
    ({}, {"rank": -1, "world_size": 2}, "rank", -1, ARG),
    ({}, {"rank": 2, "world_size": 2}, "rank", 2, ARG),
    ({}, {"rank": 1.5, "world_size": 2}, "rank", 1.5, ARG),
    ({}, {"rank": "1", "world_size": 2}, "rank", "1", ARG),
    ({}, {"rank": True, "world_size": 2}, "rank", True, ARG),
    ({}, {"rank": 0, "world_size": 0}, "world_size", 0, ARG),
    ({}, {"rank": 0, "world_size": -3}, "world_size", -3, ARG),
    ({**OK_TR, "RANK": "1"}, {"world_size": 1}, "RANK", "1", TR),
    ({}, {"timeout": -1}, "timeout", -1, ARG),
    ({}, {"timeout": 0}, "timeout", 0, ARG),
    ({}, {"timeout": "5"}, "timeout", "5", ARG),
    ({}, {"timeout": float("nan")}, "timeout", float("nan"), ARG),
    ({}, {"timeout": float("inf")}, "timeout", float("inf"), ARG),
    ({}, {"init_method": 5}, "init_method", 5, ARG),
    # torch's FileStore waits for a missing folder holding the GIL, past any timeout
    (
        {},
        {"init_method": "file:///no-such-dir/rdzv"},
        "init_method",
        "file:///no-such-dir/rdzv",
        ARG,
    ),
    ({}, {"init_method": "file:///tmp"}, "init_method", "file:///tmp", ARG),
    ({}, {"nodes": 2, "rank": 0, "world_size": "4"}, "world_size", "4", ARG),
    ({**OK_TR, "WORLD_SIZE": "abc"}, {"nodes": 1}, "WORLD_SIZE", "abc", TR),
]


@pytest.mark.parametrize(
    "env, kwargs, name, value, source",
    BAD,
    ids=[f"{case[2]}={case[3]!r}-{case[4].split()[0]}" for case in BAD],
)
def test_bad_value_names_variable_value_and_source(no_sockets, env, kwargs, name, value, source):
    setenv(env)
    with pytest.raises(ValueError) as err:
        pycomm.init("gloo", **kwargs)
    message = str(err.value)
    if value is None:
        assert f"{name} is not set" in message
    else:
        assert f"{name}={value!r}" in message
    assert f"({source})" in message
    assert "expected" in message


# ---------------------------------------------------------------------- real process group


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"SLURM_NODEID": "0", "SLURM_NNODES": "0", "SLURM_LOCALID": "0"},
            "SLURM_NNODES=0 (SLURM environment) is invalid; expected an int in [1, 1]",
        ),
        ({"LOCAL_WORLD_SIZE": "2"}, "LOCAL_WORLD_SIZE=2 (environment) does not split world_size=1"),
        (
            {"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1"},
            "LOCAL_RANK='1' (environment) is not rank 0 % LOCAL_WORLD_SIZE=1 = 0",
        ),
        (
            {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
            "LOCAL_RANK (torchrun environment) is not set",
        ),
        (
            {
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "2",
            },
            "local_world_size=2 (from torchrun) is impossible; expected an int in [1, 1]",
        ),
    ],
    ids=["slurm-no-nodes", "lws-not-dividing", "local-rank-off", "no-local-rank", "lws-too-big"],
)
def test_topology_refuses_variables_that_cannot_describe_the_job(env, message):
    pycomm.init()  # one process, before the variables (init reads some of them too)
    os.environ.update(env)
    with pytest.raises(ValueError) as err:
        pycomm.topology()
    assert message in str(err.value)


def test_single_process_init_and_double_shutdown():
    info = pycomm.init()
    expected_backend = "nccl" if torch.cuda.is_available() else "gloo"
    assert info == pycomm.DistInfo(0, 1, 0, expected_backend, info.device)
    assert dist.is_initialized()
    assert dist.get_backend() == expected_backend
    t = torch.full((3,), 2.0, device=info.device)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0, 2.0]
    pycomm.shutdown()
    assert not dist.is_initialized()
    pycomm.shutdown()
    assert not dist.is_initialized()
    # and a fresh init works after shutdown
    assert pycomm.init("gloo", rank=0, world_size=1).world_size == 1


def test_init_on_an_initialized_group(monkeypatch):
    first = pycomm.init("gloo")
    assert pycomm.init() == first
    assert pycomm.init("gloo", rank=0, world_size=1) == first
    with pytest.raises(RuntimeError, match="world_size=2"):
        pycomm.init("gloo", world_size=2)
    with pytest.raises(RuntimeError, match="rank=1"):
        pycomm.init(rank=1)
    # mpi is a valid name; pretend it is available so the mismatch, not MPI, is reported
    monkeypatch.setattr(dist, "is_mpi_available", lambda: True)
    with pytest.raises(RuntimeError, match="'mpi'.*'gloo'"):
        pycomm.init("mpi")
    assert dist.is_initialized()


def test_dist_info_is_frozen():
    info = pycomm.DistInfo(0, 1, 0, "gloo", torch.device("cpu"))
    with pytest.raises(AttributeError):
        info.rank = 1  # type: ignore[misc]
