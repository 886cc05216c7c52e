"""pycomm.launch: results in rank order, failing/dying/hanging ranks, no leftover processes."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from harness import launched_children, run_ranks

import pycomm
import pycomm.dist as pdist
import pycomm.launcher as plaunch

pytestmark = pytest.mark.timeout(90)


# Per-rank functions: module level, so spawn can pickle them by name.


def _rank_report(scale):
    info = pycomm.init()  # the group launch made: returns its DistInfo
    t = torch.tensor([float(info.rank + 1) * scale])
    dist.all_reduce(t)
    return info.rank, info.world_size, info.local_rank, info.backend, t.item(), os.getpid()


def _record_pid(pid_dir):
    with open(os.path.join(pid_dir, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()  # every rank has recorded its pid before any of them fails


def _raise_on_rank1(pid_dir):
    _record_pid(pid_dir)
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # blocks until rank 1 is gone
    return "unreachable"


def _exit_on_rank1(pid_dir):
    _record_pid(pid_dir)
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()
    return "unreachable"


def _hang_on_rank1(pid_dir):
    _record_pid(pid_dir)
    if dist.get_rank() == 1:
        time.sleep(600)
    return "rank 0 done"


def _rank_environment(name):
    print(f"rank {dist.get_rank()} says hello", flush=True)
    print(f"rank {dist.get_rank()} warns", file=sys.stderr, flush=True)
    return os.environ.get(name), os.path.realpath(os.getcwd())


def _unpicklable_result():
    return lambda: None


def _draw(generator):
    return torch.randn(3, generator=generator).tolist()


def _refuse_to_arrive():
    raise ValueError("this argument cannot be rebuilt in a rank")


class _BrokenOnArrival:
    """Pickles in the parent; unpickling it raises (as a value tied to its process does)."""

    def __reduce__(self):
        return (_refuse_to_arrive, ())


def _exits_zero_early():
    os._exit(0)


def _start_a_child():
    # fork: cheap, and the child only exits; spawn would re-import torch
    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join()
    return child.exitcode


# Helpers


def _recorded_pids(pid_dir, nprocs):
    pids = []
    for rank in range(nprocs):
        with open(os.path.join(pid_dir, f"rank{rank}.pid")) as f:
            pids.append(int(f.read()))
    return pids


def _assert_all_gone(pids):
    assert launched_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(pdist, "_tcp_warned", False)
    pycomm.shutdown()
    yield
    pycomm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("method", plaunch.START_METHODS)
def test_results_in_rank_order(method):
    # 4 ranks (2 ranks: test_tcp_backend_through_launch_warns_and_uses_gloo)
    nprocs = 4
    results = pycomm.launch(_rank_report, nprocs, 0.5, timeout=60, start_method=method)
    assert [r[:4] for r in results] == [(rank, nprocs, rank, "gloo") for rank in range(nprocs)]
    expected_sum = 0.5 * nprocs * (nprocs + 1) / 2
    assert [r[4] for r in results] == [expected_sum] * nprocs
    pids = [r[5] for r in results]
    assert len(set(pids)) == nprocs and os.getpid() not in pids
    _assert_all_gone(pids)


def test_failing_rank_raises_launch_error_with_its_traceback(tmp_path):
    with pytest.raises(pycomm.LaunchError) as err:
        run_ranks(_raise_on_rank1, 2, str(tmp_path), timeout=60, fresh=True)
    e = err.value
    assert e.rank == 1
    assert e.exitcode is None
    assert "boom from rank 1" in e.traceback
    assert "_raise_on_rank1" in e.traceback
    assert "rank 1" in str(e) and "boom from rank 1" in str(e)
    _assert_all_gone(_recorded_pids(tmp_path, 2))


@pytest.mark.parametrize("method", plaunch.START_METHODS)
def test_dying_rank_names_rank_and_exit_code(tmp_path, method):
    with pytest.raises(pycomm.LaunchError) as err:
        pycomm.launch(_exit_on_rank1, 2, str(tmp_path), timeout=60, start_method=method)
    e = err.value
    assert (e.rank, e.exitcode) == (1, 3)
    assert "rank 1" in str(e) and "code 3" in str(e)
    _assert_all_gone(_recorded_pids(tmp_path, 2))


@pytest.mark.slow
def test_hanging_rank_times_out(tmp_path):
    start = time.monotonic()
    with pytest.raises(pycomm.LaunchError) as err:
        # long enough that both ranks have started and rank 1 sits in its sleep even on a
        # loaded machine (start-up alone took ~4 s under load: 10 s is 2.5 times that)
        run_ranks(_hang_on_rank1, 2, str(tmp_path), timeout=10, fresh=True)
    elapsed = time.monotonic() - start
    e = err.value
    assert isinstance(e, TimeoutError)
    assert e.rank == 1 and e.unfinished == (1,)
    assert "[1]" in str(e) and "10 s" in str(e)
    # the hung rank's stack is dumped before it is killed
    assert "_hang_on_rank1" in e.traceback
    # a bound on the hang, not a speed measurement: 10 s timeout + start-up + 2 s kill grace
    assert elapsed < 45
    _assert_all_gone(_recorded_pids(tmp_path, 2))


@pytest.mark.parametrize("method", plaunch.START_METHODS)
def test_ranks_see_the_callers_environment_directory_and_output(
    method, monkeypatch, tmp_path, capfd
):
    # a forkserver started by an earlier launch, before the change below
    assert pycomm.launch(_rank_report, 1, 1.0, timeout=60, start_method=method)[0][4] == 1.0
    monkeypatch.setenv("PYCOMM_TEST_VALUE", "set after the first launch")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    results = pycomm.launch(
        _rank_environment, 2, "PYCOMM_TEST_VALUE", timeout=60, start_method=method
    )
    out, err = capfd.readouterr()
    assert results == [("set after the first launch", os.path.realpath(tmp_path))] * 2
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
    assert "rank 0 warns" in err and "rank 1 warns" in err, err
    assert launched_children() == []


def test_invalid_start_method(monkeypatch):
    with pytest.raises(ValueError) as err:
        pycomm.launch(_rank_report, 2, 1.0, start_method="fork")
    assert "start_method='fork' (argument) is invalid; expected one of spawn, forkserver" in str(
        err.value
    )
    monkeypatch.setenv("PYCOMM_START_METHOD", "thread")
    with pytest.raises(ValueError) as err:
        pycomm.launch(_rank_report, 2, 1.0)
    assert "PYCOMM_START_METHOD='thread' (environment) is invalid; expected one of" in str(
        err.value
    )
    # where the platform has no forkserver (Windows)
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ValueError) as err:
        pycomm.launch(_rank_report, 2, 1.0, start_method="forkserver")
    assert (
        "start_method='forkserver' (argument) is not available on this platform; expected one "
        "of spawn" in str(err.value)
    )
    monkeypatch.setenv("PYCOMM_START_METHOD", "forkserver")
    with pytest.raises(ValueError, match=r"PYCOMM_START_METHOD='forkserver' \(environment\) is "):
        pycomm.launch(_rank_report, 2, 1.0)
    assert launched_children() == []


def test_unpicklable_result_is_reported():
    with pytest.raises(pycomm.LaunchError, match="picklable") as err:
        run_ranks(_unpicklable_result, 1, timeout=60, fresh=True)
    assert err.value.rank == 0
    assert launched_children() == []


def test_arguments_arrive_by_value_and_a_failure_to_rebuild_them_is_named():
    g = torch.Generator().manual_seed(7)
    expected = torch.randn(3, generator=torch.Generator().manual_seed(7)).tolist()
    # a generator's state travels by value (multiprocessing's pickler sent it through shared
    # memory that the rank could not map: it died before running fn)
    assert pycomm.launch(_draw, 2, g, timeout=60) == [expected, expected]
    with pytest.raises(pycomm.LaunchError) as err:
        pycomm.launch(_draw, 2, _BrokenOnArrival(), timeout=60)
    assert "cannot be rebuilt in a rank" in str(err.value) + err.value.traceback
    assert launched_children() == []


def test_rank_exiting_zero_without_result_is_an_error():
    with pytest.raises(pycomm.LaunchError, match="without reporting") as err:
        run_ranks(_exits_zero_early, 1, timeout=60, fresh=True)
    assert (err.value.rank, err.value.exitcode) == (0, 0)


def test_tcp_backend_through_launch_warns_and_uses_gloo():
    with pytest.warns(UserWarning, match="'tcp'"):
        results = run_ranks(_rank_report, 2, 1.0, backend="tcp", timeout=60, fresh=True)
    assert [r[:4] for r in results] == [(0, 2, 0, "gloo"), (1, 2, 1, "gloo")]
    assert [r[4] for r in results] == [3.0, 3.0]
    pids = [r[5] for r in results]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    _assert_all_gone(pids)


@pytest.mark.parametrize("nprocs", [0, -1, 1.5, "2", True, None])
def test_invalid_nprocs(nprocs):
    with pytest.raises(ValueError, match="nprocs") as err:
        pycomm.launch(_rank_report, nprocs, 1.0)
    assert repr(nprocs) in str(err.value)
    assert launched_children() == []


def test_invalid_fn_and_backend():
    with pytest.raises(ValueError, match="fn"):
        pycomm.launch("not callable", 2)
    with pytest.raises(ValueError, match="valid backends"):
        pycomm.launch(_rank_report, 2, 1.0, backend="bogus")
    with pytest.raises(ValueError, match="timeout"):
        pycomm.launch(_rank_report, 2, 1.0, timeout=-1)
    with pytest.raises(ValueError, match="timeout=nan .* expected a finite number"):
        pycomm.launch(_rank_report, 2, 1.0, timeout=float("nan"))
    with pytest.raises(ValueError, match="setup=5 .* expected a callable setup"):
        pycomm.launch(_rank_report, 2, 1.0, setup=5)
    assert launched_children() == []


def test_launch_errors_survive_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(pycomm.LaunchError("m", rank=2, exitcode=-9, traceback="t")))
    assert (type(e), e.rank, e.exitcode, e.traceback, str(e)) == (
        pycomm.LaunchError,
        2,
        -9,
        "t",
        "m",
    )
    t = plaunch.LaunchTimeoutError("late", rank=1, traceback="stack", unfinished=(1, 3))
    t = pickle.loads(pickle.dumps(t))
    assert isinstance(t, TimeoutError) and isinstance(t, pycomm.LaunchError)
    assert (t.rank, t.unfinished, t.traceback, str(t)) == (1, (1, 3), "stack", "late")


def test_a_rank_may_start_its_own_processes():
    # e.g. a DataLoader with workers: impossible if ranks were daemonic processes
    assert run_ranks(_start_a_child, 1, timeout=60, fresh=True) == [0]


def test_failure_blames_the_root_cause():
    errors = [
        (20.0, 0, "tb0", "RuntimeError('Connection closed by peer')"),
        (10.0, 2, "tb2", "ValueError('the real bug')"),
        (30.0, 1, "tb1", "RuntimeError('Connection reset')"),
    ]
    e = plaunch._failure(list(errors), [])
    assert (e.rank, e.traceback, e.exitcode) == (2, "tb2", None)
    assert str(e).startswith("rank 2 raised ValueError('the real bug')")
    assert "rank 0: RuntimeError('Connection closed by peer')" in str(e)
    # a rank that died takes the others' collectives down with it
    e = plaunch._failure(list(errors), [(3, -9, False)])
    assert (e.rank, e.exitcode) == (3, -9)
    assert "signal 9" in str(e) and "without reporting" in str(e)
    assert "rank 2: ValueError('the real bug')" in str(e)
