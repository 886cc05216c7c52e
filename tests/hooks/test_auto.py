"""hook="auto": the cost model on injected measurements (no timing), the decision taken alike on
every rank, kept across a resume, and its options checked on every rank before training."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from ddp_harness import model as _model
from ddp_harness import nodes as _nodes
from ddp_harness import straight_and_resumed
from harness import run_ranks

import pycomm
from pycomm.hooks import auto
from pycomm.hooks.auto import AutoState, choose, predict

MB = 2**20


def _m(wire, codec16=1e-10, int8=(3e-10, 1.5e-10), onebit=(3e-10, 1.5e-10), ready=None):
    """Measurements of a 4-bucket model (2M elements each, the last ready at 40 ms)."""
    ready = ready or [0.01, 0.02, 0.03, 0.04]
    return {
        "step_s": 0.2,
        "forward_s": 0.02,
        "exposed_s": 0.14,
        "ready_s": ready,
        "numel": [2 * MB] * len(ready),
        "wire_s_per_byte": wire,
        "codec_s_per_elem": {
            "bf16": (codec16, codec16),
            "fp16": (codec16, codec16),
            "int8": int8,
            "fp8": int8,  # int8's codec time, as measured on the CPU and the GPU's roofline
            "int4": int8,
            "onebit": onebit,
        },
        "world_size": 2,
        "latency_s": 0.0,
    }


ALL = ["allreduce", "bf16", "fp16", "int8", "onebit"]
DEFAULT = ["allreduce", "bf16", "fp16", "int8"]


def test_slow_link_picks_int8_and_onebit_only_when_allowed():
    m = _m(wire=8e-8)  # about 100 Mbit/s
    p = predict(m, DEFAULT)
    assert choose(p) == "int8"
    assert p["allreduce"] > p["bf16"] > p["int8"]
    assert "onebit" not in p
    assert choose(predict(m, ALL)) == "onebit"
    # the slowest candidate pays its whole exchange after the last bucket
    # (step - exposed) + (first ready + 4 buckets of 8 MB fp32 on the wire) - last ready
    assert p["allreduce"] == pytest.approx(0.2 - 0.14 + 0.01 + 4 * 8 * MB * 8e-8 - 0.04)


def test_fast_link_and_expensive_codecs_pick_the_exact_or_16_bit_hook():
    # 10 GB/s per rank, codecs at 10 ns per element: the exact all-reduce
    assert choose(predict(_m(wire=1e-10, codec16=1e-8, int8=(1e-8, 1e-8)), DEFAULT)) == "allreduce"
    # a moderate link, a cheap 16-bit codec and an expensive int8 one: bf16
    m = _m(wire=2e-9, codec16=1e-10, int8=(2e-8, 2e-8))
    assert choose(predict(m, DEFAULT)) == "bf16"
    # bf16 and fp16 run the same codec and bytes: bf16, listed first, wins the tie
    p = predict(m, DEFAULT)
    assert p["bf16"] == p["fp16"]


def test_hidden_communication_keeps_the_exact_hook():
    # buckets ready early, a fast link: every exchange hides behind the rest of backward
    m = _m(wire=1e-11, ready=[0.01, 0.2, 0.4, 0.6])
    p = predict(m, ALL)
    assert choose(p) == "allreduce"
    assert p["allreduce"] == pytest.approx(min(p.values()))


def test_margin_prefers_the_more_exact_hook_for_small_gains():
    assert choose({"allreduce": 0.104, "bf16": 0.102, "int8": 0.1}) == "allreduce"
    assert choose({"allreduce": 0.2, "bf16": 0.12, "int8": 0.1}) == "int8"
    assert choose({"allreduce": 0.2, "bf16": 0.104, "int8": 0.1}) == "bf16"


def test_same_measurements_same_decision():
    m = _m(wire=3e-9)
    first = predict(m, DEFAULT)
    for _ in range(3):
        assert predict(dict(m), DEFAULT) == first
    # the allow list is normalized: its order does not change the candidates' order
    assert auto.check_allow(["int8", "allreduce"]) == ("allreduce", "int8")


def test_node_hierarchy_candidates():
    m = _m(wire=4e-8)
    m.update(world_size=4, nodes=2, local_size=2, intra_s_per_byte=1e-10, inter_s_per_byte=8e-8)
    p = predict(m, ["allreduce", "int8"], ("flat", "node"))
    assert list(p) == ["allreduce-flat", "allreduce-node", "int8-flat", "int8-node"]
    assert choose(p) == "int8-node"
    # a slow link inside the node: the flat exchange
    m.update(intra_s_per_byte=1e-7)
    assert choose(predict(m, ["allreduce", "int8"], ("flat", "node"))) == "int8-flat"


def test_bucket_size_advice():
    m = _m(wire=1e-8)
    for cap in auto.BUCKET_CAPS_MB:
        r = auto.rebucket(m, cap)
        assert sum(r["numel"]) == sum(m["numel"])  # every element, once
        assert r["ready_s"][-1] == pytest.approx(m["ready_s"][-1])  # the last as measured
        assert r["ready_s"] == sorted(r["ready_s"])
        assert r["numel"][0] <= auto.FIRST_BUCKET_MB * MB / 4  # DDP's small first bucket
        assert max(r["numel"]) <= cap * MB / 4
    assert auto.rebucket(m, 8.0)["numel"] == [MB // 4, 2 * MB, 2 * MB, 2 * MB, 2 * MB - MB // 4]
    # no cost per collective: smaller buckets start sending earlier
    caps = auto.advise_bucket_cap(m, "allreduce")
    assert caps["2"] < caps["64"]
    # 20 ms per collective: fewer, larger buckets
    m["latency_s"] = 0.02
    caps = auto.advise_bucket_cap(m, "int8")
    assert min(caps, key=caps.get) in ("16", "25", "64")


@pytest.mark.parametrize(
    "options, words",
    [
        ({"allow": ["int8", "zstd"]}, ["allow=['int8', 'zstd']", "'zstd'", "allreduce, bf16"]),
        ({"allow": "int8"}, ["allow='int8'", "list of hook names", "onebit"]),
        ({"allow": []}, ["allow=[]", "non-empty"]),
        ({"allow": ["powersgd"]}, ["'powersgd'", "cannot choose"]),
        ({"hierarchy": "ring"}, ["hierarchy='ring'"]),
        ({"start_iter": 1}, ["start_iter=1"]),
        ({"block": 64}, ["unknown option 'block'", "allow, hierarchy, start_iter"]),
    ],
)
def test_bad_options_raise_on_every_rank(options, words):
    for message in run_ranks(_rank_bad_options, 2, options, timeout=60):
        assert message is not None
        for w in words:
            assert w in message, message


def _rank_bad_options(options):
    try:
        pycomm.wrap(torch.nn.Linear(4, 4), hook="auto", hook_options=options)
    except ValueError as e:
        return str(e)
    return None


def _train(ddp, opt, batches, accumulate=1):
    for x, y in batches:
        opt.zero_grad()
        for _ in range(accumulate):
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _data(steps):
    g = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.randn(8, 40, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]


@contextlib.contextmanager
def _injected(per_rank):
    """Replace what auto measures and probes with ``per_rank[rank]``'s numbers (the warm-up
    still runs, its timings are ignored); restored after."""
    measured, probe = AutoState._measured, AutoState._probe
    mine = per_rank[dist.get_rank() % len(per_rank)]

    def fake_measured(self):
        measured(self)  # the real bookkeeping runs; its timings are replaced
        return {
            k: v for k, v in mine.items() if not k.endswith("per_byte") or k == "wire_s_per_byte"
        }

    def fake_probe(self, m):
        probe(self, m)  # the probes' collectives run; their timings are replaced
        probed = ("codec_s_per_elem", "latency_s", "intra_s_per_byte", "inter_s_per_byte")
        m.update({k: v for k, v in mine.items() if k in probed})

    AutoState._measured, AutoState._probe = fake_measured, fake_probe
    try:
        yield
    finally:
        AutoState._measured, AutoState._probe = measured, probe


SLOW, FAST = _m(wire=8e-8), _m(wire=1e-11)


def _rank_decision(per_rank, allow, accumulate):
    options = {} if allow is None else {"allow": allow}
    with _injected(per_rank) if per_rank else contextlib.nullcontext():
        ddp = pycomm.wrap(
            _model(), hook="auto", hook_options=options, accumulate_steps=accumulate,
            bucket_cap_mb=0.004,
        )  # fmt: skip
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        _train(ddp, opt, _data(7), accumulate)
    state = pycomm.hook_state(ddp)
    stats = state.stats
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    return stats, params


@pytest.mark.parametrize(
    "per_rank, allow, accumulate, want",
    [
        (None, None, 1, None),  # real measurements: whatever they pick, every rank alike
        # MAX over ranks: rank 0's slow link decides (int4: half int8's bytes, its codec time)
        ([SLOW, FAST], None, 1, "int4"),
        ([FAST, SLOW], ["allreduce", "int8", "onebit"], 1, "onebit"),
        ([FAST, FAST], None, 2, "allreduce"),  # inside the accumulate stage
    ],
)
def test_decision_identical_on_every_rank(per_rank, allow, accumulate, want):
    results = run_ranks(_rank_decision, 2, per_rank, allow, accumulate, timeout=120)
    (s0, p0), (s1, p1) = results
    d0, d1 = s0["auto"], s1["auto"]
    assert d0 is not None and d0 == d1
    assert d0["decided_at"] == 5 and d0["hierarchy"] == "flat"  # start_iter's default
    assert d0["choice"] in (allow or auto.DEFAULT_ALLOW)
    assert str(int(d0["bucket_cap_mb_best"])) in d0["bucket_cap_mb_predicted_s"]
    assert set(d0["predicted_s"]) == set(allow or auto.DEFAULT_ALLOW)
    assert len(d0["measurements"]["ready_s"]) == len(d0["measurements"]["numel"]) > 1
    if want is not None:
        assert d0["choice"] == want
    assert torch.equal(p0, p1)  # the same hook on both ranks: the same parameters
    assert s0["steps"] == 7
    if d0["choice"] in ("allreduce", "onebit"):  # onebit keeps to its own 20 exact iterations
        assert s0["bytes_sent"] == s0["bytes_fp32"]
    else:
        assert s0["bytes_sent"] < s0["bytes_fp32"]


def _rank_resume(k, m):
    data = _data(k + m)

    def build():
        ddp = pycomm.wrap(
            _model(), hook="auto", hook_options={"allow": ["allreduce", "int8"]},
            bucket_cap_mb=0.004,
        )  # fmt: skip
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    with _injected([SLOW]):  # int8
        ddp, opt = build()
        _train(ddp, opt, data)
        straight = [p.detach().clone() for p in ddp.module.parameters()]
        ddp, opt = build()
        _train(ddp, opt, data[:k])
        saved = {
            "model": ddp.module.state_dict(),
            "opt": opt.state_dict(),
            "hook": pycomm.hook_state(ddp).state_dict(),
        }
    # measurements that would pick allreduce: a resume must not measure again
    with _injected([FAST]):
        ddp, opt = build()
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        pycomm.hook_state(ddp).load_state_dict(saved["hook"])
        _train(ddp, opt, data[k:])
    resumed = [p.detach() for p in ddp.module.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
    state = pycomm.hook_state(ddp)
    errors = {}
    other = dict(saved["hook"])
    other["fingerprint"] = {**other["fingerprint"], "topology": "node: 2 nodes x 1 ranks"}
    for name, sd in {"topology": other, "world": {**saved["hook"], "world_size": 3}}.items():
        try:
            pycomm.hook_state(build()[0]).load_state_dict(sd)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return same, state.stats, saved["hook"]["decision"], errors


def test_resume_continues_with_the_saved_decision():
    for same, stats, decision, errors in run_ranks(_rank_resume, 2, 6, 3, timeout=120):
        assert decision["choice"] == "int8" and decision["decided_at"] == 5
        assert stats["auto"] == decision  # not measured again after the load
        assert stats["steps"] == 9 and stats["bytes_sent"] < stats["bytes_fp32"]
        assert same, "the resumed run differs from the uninterrupted one"
        assert (
            "topology is 'node: 2 nodes x 1 ranks' in the checkpoint but 'flat'"
            in (errors["topology"])
        )
        assert "world_size=3 into world_size=2" in errors["world"]


def _rank_nodes():
    inter = _m(wire=4e-8)
    inter.update(intra_s_per_byte=1e-10, inter_s_per_byte=8e-8)
    with _nodes([0, 0, 1, 1]), _injected([inter]):
        ddp = pycomm.wrap(_model(), hook="auto", bucket_cap_mb=0.004)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        _train(ddp, opt, _data(6))
    stats = pycomm.hook_state(ddp).stats
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    return stats["auto"], stats.get("bytes_inter"), params


def test_nodes_choose_the_hierarchy_too():
    results = run_ranks(_rank_nodes, 4, timeout=180)
    first = results[0]
    for decision, inter, params in results:
        assert decision == first[0]
        assert decision["choice"] == "int4" and decision["hierarchy"] == "node"
        assert "int4-node" in decision["predicted_s"] and "int4-flat" in decision["predicted_s"]
        assert inter > 0  # the node hierarchy's cross-node bytes
        assert torch.equal(params, first[2])


def _rank_resume_before_the_decision(cut):
    """Cut at ``cut`` <= start_iter (5): the warm-up's records and DDP's buckets are in the
    checkpoint, so the resumed run decides at 5, as the uninterrupted one, and compresses in
    its layout (the fresh DDP's first step re-bucketed)."""
    data = _data(8)

    def build():
        ddp = pycomm.wrap(_model(), hook="auto", bucket_cap_mb=0.004)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    with _injected([SLOW]):
        straight, resumed, saved, ddp = straight_and_resumed(build, _train, data, cut)
    return saved["decision"], pycomm.hook_state(ddp).stats, torch.equal(straight, resumed)


def _rank_one():
    ddp = pycomm.wrap(_model(), hook="auto")
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), _data(2))
    return pycomm.hook_state(ddp).stats


@pytest.mark.parametrize(
    "nprocs, cut",
    # 3 ranks: an all-reduce's sums depend on where an element sits in the bucket, and the
    # resumed DDP's first step buckets as a fresh DDP does (cut 2: in the measured warm-up)
    [(2, 4), (2, 5), (3, 2), (3, 4)],
)
def test_resume_before_the_decision_decides_when_the_run_would(nprocs, cut):
    results = run_ranks(_rank_resume_before_the_decision, nprocs, cut, timeout=180)
    for before, stats, same in results:
        assert before is None
        assert stats["auto"]["decided_at"] == 5 and stats["auto"]["choice"] == "int4"
        assert stats["steps"] == 8 and same


def test_one_rank_needs_no_measurement():
    (stats,) = run_ranks(_rank_one, 1, timeout=60)
    assert stats["auto"]["choice"] == "allreduce" and stats["auto"]["decided_at"] == 0
    assert stats["bytes_sent"] == 0 and stats["steps"] == 2


def _rank_register_and_checkpoint(path):
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _injected([SLOW]):
        ddp = DDP(_model(), bucket_cap_mb=0.004)
        state = pycomm.register(ddp, hook="auto", hook_options={"allow": ["allreduce", "bf16"]})
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        _train(ddp, opt, _data(6))
        pycomm.checkpoint.save(path, ddp, opt, step=6)
    with _injected([FAST]):  # would pick allreduce if it measured again
        fresh = pycomm.wrap(_model(), hook="auto", hook_options={"allow": ["allreduce", "bf16"]})
        opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        pycomm.checkpoint.load(path, fresh, opt)
        loaded = pycomm.hook_state(fresh)
        _train(fresh, opt, _data(1))
    return state.stats["auto"], loaded.stats["auto"], loaded.stats["steps"]


def test_register_and_the_checkpoint_module(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    for decision, loaded, steps in run_ranks(_rank_register_and_checkpoint, 2, path, timeout=120):
        assert decision["choice"] == "bf16" and loaded == decision
        assert steps == 7
