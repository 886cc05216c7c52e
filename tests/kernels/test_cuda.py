"""The CUDA kernels (csrc/cuda) beyond the shared kernel cases: the build's CUDA registration,
error messages identical to the CPU kernels', FakeTensorMode's messages and shapes, bf16 residuals
against the CPU kernels; and, on a GPU, devices, streams, opcheck and the hooks on CUDA
tensors. The tests that take the ``gpu`` fixture run on the CPU in the dry run
(``pytest --cpu-stand-in``, from ``scripts/gpu_validate.sh --cpu``): their host code, tables
and plumbing are checked before a GPU ever runs them.

The kernel cases themselves (odd sizes, every dtype, strides, misaligned views, NaN/Inf, many
tensors, bad input) are written once in test_fusion_ops.py and test_codec_ops.py and run on
every backend (cpu, emu, cuda) through conftest.py's ``be`` fixture; ``cuda_be`` here is emu and
cuda alone, for comparisons with the CPU kernels.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, pycomm_ops
from kernel_data import DTYPES, NAN, as_tuple, bf16_residual, padded_numel
from kernel_data import bits_equal as _bits_equal
from kernel_data import codec_input as _x

from pycomm import ops

# --- the build: runs everywhere ------------------------------------------------------------


def test_build_has_a_cuda_kernel_for_every_op_or_none():
    names = pycomm_ops()
    assert "quantize_int8" in names and "pack" in names
    has = {n: torch._C._dispatch_has_kernel_for_dispatch_key(f"pycomm::{n}", "CUDA") for n in names}
    # WITH_CUDA builds register every op for CUDA (a new op without a .cu kernel fails here)
    assert set(has.values()) == {ops.WITH_CUDA}, has
    expect = os.environ.get("PYCOMM_EXPECT_CUDA")
    if expect is not None:  # set by scripts/cuda_check.sh and scripts/gpu_validate.sh
        assert ops.WITH_CUDA == (expect == "1"), (ops.WITH_CUDA, expect)


@pytest.mark.slow
@pytest.mark.timeout(900)  # thousands of checks: minutes where other jobs load the cores
def test_gpu_validate_script_runs_on_cpu(tmp_path):
    # the GPU script's own logic (sweep, poisoning, comparisons, timing table, JSON), run with
    # the CPU kernels standing in for the CUDA ones, so that it cannot rot between GPU runs
    script = os.path.join(ROOT, "scripts", "gpu_validate.py")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--cpu", "--big", "3001", "--reps", "1", "--out", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=850
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_validate.json").read_text())
    assert report["checks_failed"] == 0 and len(report["checks"]) > 2000
    ops_timed = {r["op"].split()[0] for r in report["timing"]}
    assert {"encode16", "quantize_int8", "dequantize_onebit_sum", "pack"} <= ops_timed
    assert {
        "quantize_int4",
        "dequantize_int4_sum",
        "quantize_fp8",
        "dequantize_fp8_sum",
    } <= ops_timed
    checked = {c["check"].split()[0] for c in report["checks"]}
    assert {"quantize_int4", "dequantize_int4_sum", "quantize_fp8", "dequantize_fp8_sum"} <= checked
    assert "copy%" in out.stdout
    # the sizes around the 16-byte vectors are in the fusion sweep; the bucket of odd sizes
    # and both 200-small-tensor cases are timed, those with their 60% target
    assert {"n=7", "n=9"} <= {c["check"].split()[1] for c in report["checks"]}
    timed = {r["op"]: r for r in report["timing"]}
    assert "pack x0.5, 32 odd sizes" in timed and "unpack_ x2, 32 odd sizes" in timed
    assert (
        timed["pack x0.5, 200 small"]["target"] == timed["unpack_ x2, 200 small"]["target"] == 0.6
    )


# --- bad input: the CPU kernels' messages -------------------------------------------------


def _overlapping_residuals():
    big = torch.zeros(24)
    return torch.ones(16), big[:16], 1.0, 8, 16, big[8:]


_BAD = [
    ("pack", lambda: ([torch.ones(3), torch.ones(2, dtype=torch.float16)], 1.0, None)),
    ("pack", lambda: ([torch.ones(3)], 1.0, torch.int32)),
    ("unpack_", lambda: (torch.ones(5), [torch.ones(2), torch.ones(2)], 1.0)),
    ("accumulate_", lambda: (torch.ones(4), torch.ones(5), 1.0)),
    ("accumulate_", lambda: (torch.ones(4).bfloat16(), torch.ones(4).half(), 1.0)),
    ("scale_", lambda: (torch.ones(4, dtype=torch.int64), 2.0)),
    ("encode16", lambda: (torch.ones(10), None, 1.0, torch.float32, 16)),
    ("encode16", lambda: (torch.ones(10), None, 1.0, torch.float16, 9)),
    ("quantize_int8", lambda: (torch.ones(10), torch.zeros(15), 1.0, 8, 16)),
    ("quantize_int8", lambda: (torch.ones(10), torch.zeros(32)[::2], 1.0, 8, 16)),
    ("quantize_int8", lambda: (torch.ones(10), None, 1.0, 6, 16)),
    ("quantize_onebit", lambda: (torch.ones(10), None, 1.0, 4, 16)),
    ("quantize_int4", lambda: (torch.ones(10), None, 1.0, 3, 12)),
    ("quantize_int4", lambda: (torch.ones(16), None, 1.0, 8, 16, None, torch.float16)),
    ("quantize_fp8", lambda: (torch.ones(10), None, 1.0, 3, 16)),
    ("quantize_int8", lambda: (torch.ones(16), None, 1.0, 8, 16, torch.zeros(16))),
    ("quantize_onebit", lambda: (torch.ones(16), torch.zeros(16), 1.0, 8, 16, torch.zeros(8))),
    (
        "quantize_onebit",
        lambda: (torch.ones(16), torch.zeros(16).bfloat16(), 1.0, 8, 16, torch.zeros(16)),
    ),
    (
        "encode16",
        lambda: (torch.ones(16), torch.zeros(16), 1.0, torch.float16, 16, torch.zeros(16).half()),
    ),
    ("quantize_int8", lambda: _overlapping_residuals()),
    ("decode16_sum", lambda: (torch.ones(2, 8), 1.0, torch.empty(8))),
    ("decode16_sum", lambda: (torch.ones(2, 8).half(), 1.0, torch.empty(9))),
    (
        "dequantize_int8_sum",
        lambda: (torch.zeros(2, 16).char(), torch.ones(2, 3), 8, 1.0, torch.empty(16)),
    ),
    (
        "dequantize_onebit_sum",
        lambda: (torch.zeros(2, 2).byte(), torch.ones(2, 2), 8, 1.0, torch.empty(16)),
    ),
    (
        "dequantize_int4_sum",
        lambda: (torch.zeros(2, 2).byte(), torch.ones(2, 2).half(), 2, 1.0, torch.empty(4)),
    ),
    (
        "dequantize_fp8_sum",
        lambda: (
            torch.zeros(2, 16).to(torch.float8_e4m3fn),
            torch.ones(2, 3),
            8,
            1.0,
            torch.empty(16),
        ),
    ),
    ("pack_into_", lambda: (torch.ones(10)[::2], [torch.ones(5)], 1.0)),  # strided flat
    ("pack_into_", lambda: (torch.ones(4), [torch.ones(5)], 1.0)),  # short flat
    ("pack_into_", lambda: (torch.ones(5), [torch.ones(5).long()], 1.0)),
    (
        "dequantize_int8_sum",  # columns of a row-major tensor are not rows
        lambda: (torch.zeros(16, 2).char().t(), torch.ones(2, 2), 8, 1.0, torch.empty(16)),
    ),
]


@pytest.mark.parametrize("name, make", _BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(_BAD)])
def test_bad_input_same_message_as_cpu(cuda_be, name, make):
    with pytest.raises(RuntimeError) as cpu:
        getattr(torch.ops.pycomm, name)(*make())
    with pytest.raises(RuntimeError) as dev:
        cuda_be(name, *cuda_be.args(make()))
    first = str(cpu.value).splitlines()[0]
    assert str(dev.value).splitlines()[0] == first
    assert re.match(r"pycomm\.\w+: ", first), first


@pytest.mark.parametrize("name, make", _BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(_BAD)])
def test_bad_input_same_message_in_fake_mode(name, make):
    # FakeTensorMode (and torch.compile) runs the Meta kernels: the CPU's host entries, same
    # messages
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    op = getattr(torch.ops.pycomm, name)
    with pytest.raises(RuntimeError) as real:
        op(*make())
    mode = FakeTensorMode()
    args = tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, make())
    with mode, pytest.raises(RuntimeError) as fake:
        op(*args)
    assert str(fake.value).splitlines()[0] == str(real.value).splitlines()[0]


def test_fake_mode_gives_the_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, r = torch.randn(20, 16), torch.zeros(320)
    want = ops.quantize_onebit(x, r.clone(), 1.0, 64, 320)
    with FakeTensorMode() as mode:
        got = ops.quantize_onebit(mode.from_tensor(x), mode.from_tensor(r), 1.0, 64, 320)
    for g, w in zip(got, want):
        assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device)


# (op, arg, block): the tile kernel at small, odd and whole-tile blocks, the one-block-per-CTA
# kernel past a tile (4096), 16-bit to both output dtypes
_BF16_CASES = [
    ("quantize_int8", 1, 1), ("quantize_int8", 3, 3), ("quantize_int8", 64, 64),
    ("quantize_int8", 2048, 2048), ("quantize_int8", 4096, 4096),
    ("quantize_int4", 6, 6), ("quantize_int4", 4096, 4096),
    ("quantize_fp8", 3, 3), ("quantize_fp8", 64, 64),
    ("quantize_onebit", 8, 8), ("quantize_onebit", 64, 64), ("quantize_onebit", 4096, 4096),
    ("encode16", torch.bfloat16, 8), ("encode16", torch.float16, 8),
]  # fmt: skip
_BF16_IDS = [f"{n}-{str(a).replace('torch.', '')}" for n, a, _ in _BF16_CASES]


@pytest.mark.parametrize("name, arg, block", _BF16_CASES, ids=_BF16_IDS)
def test_bf16_residual_same_as_cpu_kernels(cuda_be, name, arg, block):
    # test_codec_ops compares every backend with the reference; this, the CUDA kernels with the
    # CPU's directly (bf16 residuals, in place and into residual_out)
    be = cuda_be
    for dtype in DTYPES:
        for n in (1, block + 1, 3000):
            numel = padded_numel(n, block, 1)
            x = _x(n, dtype, block)
            for separate in (False, True):
                old = bf16_residual(numel)
                r_cpu, r_dev = old.clone(), be.to(old)
                out_cpu = torch.full((numel,), 7.0).bfloat16() if separate else None
                out_dev = be.to(torch.full((numel,), NAN).bfloat16()) if separate else None
                want = as_tuple(getattr(ops, name)(x, r_cpu, 0.5, arg, numel, out_cpu))
                got = as_tuple(be(name, be.to(x), r_dev, 0.5, arg, numel, out_dev))
                for g, w in zip(got, want):
                    _bits_equal(g, w)
                _bits_equal(r_dev, r_cpu)
                if separate:
                    _bits_equal(out_dev, out_cpu)


# --- only on a GPU: devices, streams, opcheck, the hooks ------------------------------------


def test_mixed_devices_rejected(cuda):
    with pytest.raises(RuntimeError, match=r"pycomm.pack: tensors\[1\] is on cpu, expected cuda"):
        ops.pack([torch.ones(3, device="cuda"), torch.ones(2)])
    with pytest.raises(RuntimeError, match=r"pycomm.quantize_int8: residual is on cpu"):
        ops.quantize_int8(torch.ones(16, device="cuda"), torch.zeros(16), 1.0, 8, 16)
    with pytest.raises(RuntimeError, match=r"pycomm.decode16_sum: out is on cpu"):
        ops.decode16_sum(torch.ones(2, 8, device="cuda").half(), 1.0, torch.empty(8))


def test_runs_on_the_current_stream(cuda):
    # inputs written on a side stream and used there at once: a kernel on another stream
    # would race with the fill (and read zeros)
    n = 1 << 24
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.zeros(n, device="cuda")
        torch.cuda._sleep(10_000_000)
        x.fill_(127.0)  # scale 1: decodes exactly
        codes, scales = ops.quantize_int8(x, None, 1.0, 256, n)
        out = torch.empty(n, device="cuda")
        stats = ops.dequantize_int8_sum(codes[None], scales[None], 256, 1.0, out)
    s.synchronize()
    assert bool((out == 127.0).all()) and stats.tolist() == [127.0**2 * n, 0.0]


def _opcheck_samples():
    x = torch.randn(20, 16)
    yield "pack", lambda d: ([x.to(d), x.t().to(d)], 0.5, torch.bfloat16)
    yield (
        "unpack_",
        lambda d: (
            torch.randn(640, device=d),
            [torch.empty(20, 16, device=d), torch.empty(320, device=d)],
            2.0,
        ),
    )
    yield (
        "accumulate_",
        lambda d: (torch.randn(37, device=d), torch.randn(37, device=d).half(), 0.5),
    )
    yield "scale_", lambda d: (torch.randn(33, device=d).bfloat16(), 3.0)
    yield "encode16", lambda d: (x.to(d), torch.randn(320, device=d), 0.5, torch.bfloat16, 320)
    yield "quantize_int8", lambda d: (x.to(d), torch.randn(320, device=d), 0.5, 64, 320)
    yield "quantize_onebit", lambda d: (x.to(d), None, 1.0, 64, 320)
    yield (
        "quantize_onebit",
        lambda d: (x.to(d), torch.randn(320, device=d), 1.0, 64, 320, torch.zeros(320, device=d)),
    )
    yield (
        "decode16_sum",
        lambda d: (torch.randn(2, 77, device=d).half(), 0.5, torch.empty(70, device=d)),
    )
    yield (
        "dequantize_int8_sum",
        lambda d: (
            torch.randint(-127, 128, (2, 128), device=d, dtype=torch.int8),
            torch.rand(2, 2, device=d),
            64,
            0.5,
            torch.empty(100, device=d, dtype=torch.bfloat16),
        ),
    )
    yield "quantize_int4", lambda d: (x.to(d), torch.randn(320, device=d), 0.5, 64, 320)
    yield "quantize_fp8", lambda d: (x.to(d), None, 1.0, 3, 321)
    yield "dequantize_int4_sum", lambda d: (
        torch.randint(0, 256, (2, 64), device=d, dtype=torch.uint8),
        torch.rand(2, 2, device=d).bfloat16(),
        64,
        0.5,
        torch.empty(100, device=d),
    )  # fmt: skip
    yield "dequantize_onebit_sum", lambda d: (
        torch.randint(0, 256, (3, 16), device=d, dtype=torch.uint8),
        torch.rand(3, 2, device=d).bfloat16(),
        64,
        0.5,
        torch.empty(128, device=d),
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, make", list(_opcheck_samples()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_opcheck_cuda(gpu, name, make):
    torch.library.opcheck(getattr(torch.ops.pycomm, name).default, make(gpu.type))


def _rank_hooks_on_cuda(hook, steps, side_stream=False, device="cuda"):
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm

    torch.manual_seed(0)
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    # the caller's stream: the hooks must enqueue on it, not on the default stream (the CPU
    # stand-in has none: the same code, on the CPU)
    on_side = side_stream and dev.type == "cuda"
    ctx = torch.cuda.stream(torch.cuda.Stream()) if on_side else contextlib.nullcontext()
    with ctx:
        return _train_on_cuda(hook, steps, dev, dist, DDP, pycomm)


def _train_on_cuda(hook, steps, dev, dist, DDP, pycomm):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 3)
        ).to(dev)

    # every codec compresses from the third step (onebit's default is the 20th)
    opts = {"start_iter": 2} if pycomm.hooks.hook_spec(hook).codec is not None else {}
    ddp = pycomm.wrap(model(), hook=hook, bucket_cap_mb=0.02, hook_options=opts)
    ref = DDP(model(), bucket_cap_mb=0.02)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    errors, grads = [], []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g).to(dev)
        for m in (ddp, ref):
            m.zero_grad()
            m(x).square().mean().backward()
        ours = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        exact = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        assert ours.device.type == dev.type
        errors.append(((ours - exact).norm() / exact.norm()).item())
        grads.append(ours.cpu())
    if dev.type == "cuda":
        torch.cuda.current_stream().synchronize()
    return errors, grads, dict(pycomm.hook_state(ddp).stats)


@pytest.mark.parametrize(
    "hook, bound",
    [("allreduce", 0.0), ("bf16", 1e-2), ("fp16", 2e-3), ("int8", 5e-2), ("onebit", 1.5)],
)
def test_hooks_on_cuda_two_ranks_gloo(gpu, hook, bound):
    import pycomm

    d = gpu.type
    results = pycomm.launch(_rank_hooks_on_cuda, 2, hook, 5, False, d, backend="gloo", timeout=300)
    errors, grads, stats = results[0]
    assert errors[0] == 0.0 and errors[1] == 0.0  # warm-up: the exact all-reduce
    assert max(errors) <= bound, errors
    if hook != "allreduce":
        assert max(errors[2:]) > 0  # the codec ran
    assert stats["steps"] == 5 and stats.get("nonfinite_buckets", 0) == 0
    for a, b in zip(grads, results[1][1]):  # every rank holds the same reduced gradients
        assert torch.equal(a, b)
    # the same training on a stream of the caller's: the same gradients, bit for bit
    side = pycomm.launch(_rank_hooks_on_cuda, 2, hook, 5, True, d, backend="gloo", timeout=300)
    for a, b in zip(grads, side[0][1]):
        assert torch.equal(a, b)


# A fake process group (torch's, for tests) of world size 2 completes every collective at once
# without moving data: the hooks' whole host path runs on one GPU, encoders and decoders on the
# device, with torch's sync debug mode turning any host synchronization into an error.
SYNC_FREE = """
import sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.distributed.fake_pg import FakeStore
import pycomm
from pycomm import hooks

hook, device = sys.argv[1], sys.argv[2]
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
dev = torch.device(device)
spec = hooks.hook_spec(hook)
# every codec compresses from the third step (onebit's default is the 20th)
state = spec.state(None, **({"start_iter": 2} if spec.codec is not None else {}))
fn = spec.hook
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).to(dev)
ddp = DDP(model, bucket_cap_mb=0.1)  # several buckets
ddp.register_comm_hook(state, fn)
x = torch.randn(32, 256, device=dev)

def step():
    ddp.zero_grad(set_to_none=False)
    ddp(x).square().mean().backward()

for _ in range(3):  # DDP's bucket rebuild and the exact warm-up steps
    step()
on_gpu = dev.type == "cuda"  # the CPU stand-in runs the same host path, unwatched
if on_gpu:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
for _ in range(4):
    step()
if on_gpu:
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
print("STEPS", state.stats["steps"], "COMPRESSED", state.stats.get("codec_bytes_sent", 0) > 0)
"""


def sync_free_hooks() -> list[str]:
    """The hooks the sync-free script runs, from the registry: allreduce and every codec's
    (a codec registered later is in the table without an edit here). powersgd is torch's
    (its QR and error feedback are not pycomm's kernels); auto times its candidates."""
    from pycomm.hooks import hook_names, hook_spec

    return [n for n in hook_names() if n == "allreduce" or hook_spec(n).codec is not None]


def test_the_sync_free_table_holds_every_codec():
    assert {"allreduce", "fp16", "bf16", "int8", "fp8", "int4", "onebit"} <= set(sync_free_hooks())


@pytest.mark.parametrize("hook", sync_free_hooks())
def test_hooks_never_synchronize_the_host(gpu, hook):
    out = subprocess.run(
        [sys.executable, "-c", SYNC_FREE, hook, str(gpu)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    compressed = hook != "allreduce"
    assert f"STEPS 7 COMPRESSED {compressed}" in out.stdout, out.stdout


def test_ops_never_synchronize_the_host(gpu):
    n, block = 1 << 16, 256
    x = torch.randn(n, device=gpu)
    r = torch.zeros(n, device=gpu)
    out = torch.empty(n, device=gpu)
    watch = gpu.type == "cuda"
    if watch:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        flat = ops.pack([x, x[:100]], 0.5, torch.bfloat16)
        ops.unpack_(flat.float(), [out, out[:100].clone()], 2.0)
        ops.accumulate_(out, x.half(), 0.5)
        ops.scale_(out, 3.0)
        codes, scales = ops.quantize_int8(x, r, 1.0, block, n)[:2]
        ops.dequantize_int8_sum(codes.view(1, -1), scales.view(1, -1), block, 0.5, out)
        bits, bscales = ops.quantize_onebit(x, r, 1.0, block, n)[:2]
        ops.dequantize_onebit_sum(bits.view(1, -1), bscales.view(1, -1), block, 0.5, out)
        enc = ops.encode16(x, r, 1.0, torch.bfloat16, n)
        ops.decode16_sum(enc.view(1, -1), 1.0, out)
        codes4, scales4 = ops.quantize_int4(x, r, 1.0, block, n)
        ops.dequantize_int4_sum(codes4.view(1, -1), scales4.view(1, -1), block, 0.5, out)
        codes8, scales8 = ops.quantize_fp8(x, r, 1.0, block, n)
        ops.dequantize_fp8_sum(codes8.view(1, -1), scales8.view(1, -1), block, 0.5, out)
    finally:
        if watch:
            torch.cuda.set_sync_debug_mode(0)
    if watch:
        torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("hook", ["allreduce", "bf16", "int8", "int4", "fp8", "onebit"])
def test_hooks_on_cuda_nccl_world_one(gpu, hook):
    import pycomm

    backend = "nccl" if gpu.type == "cuda" else "gloo"  # the stand-in has no NCCL
    (res,) = pycomm.launch(
        _rank_hooks_on_cuda, 1, hook, 3, False, gpu.type, backend=backend, timeout=300
    )
    errors, _, stats = res
    assert errors == [0.0] * 3 and stats["steps"] == 3


def _rank_exchange_on(device, codec):
    """pycomm.Exchange's three collectives on the device's tensors: the same bits on every
    rank, close to the exact mean, and the same as on the CPU's tensors."""
    import torch.distributed as dist

    import pycomm

    r, n = dist.get_rank(), dist.get_world_size()
    out = []
    for dev in (torch.device(device, 0) if device == "cuda" else torch.device(device), "cpu"):
        ex = pycomm.Exchange(codec)
        g = torch.Generator().manual_seed(r)
        t = torch.randn(3001, generator=g).to(dev)
        inp, shard = torch.randn(n * 333, generator=g).to(dev), torch.empty(333, device=dev)
        mine, full = torch.randn(257, generator=g).to(dev), torch.empty(n * 257, device=dev)
        ex.all_reduce(t, key="a").wait()
        ex.reduce_scatter(shard, inp, key="b").wait()
        ex.all_gather(full, mine, key="c").wait()
        out.append([t.cpu(), shard.cpu(), full.cpu()])
    return out


def _fsdp_on(dev, mesh):
    """The small FSDP2 model of the device tests: two Linear blocks and the root sharded on
    ``mesh``, on ``dev``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.Tanh(), torch.nn.Linear(64, 63))
    m = m.to(dev)
    for i in (0, 2):
        fully_shard(m[i], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _sgd_steps(m, dev, steps):
    """``steps`` SGD steps of this rank's own batches (the same on every device), synchronized."""
    import torch.distributed as dist

    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(8, 30, generator=g), torch.randn(8, 63, generator=g)
        torch.nn.functional.mse_loss(m(x.to(dev)), y.to(dev)).backward()
        opt.step()
        opt.zero_grad()
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _rank_fsdp_all_gather_on(device, codec):
    """pycomm.fsdp.compress(all_gather=codec) on the device's FSDP2 (its all-gather and copy
    streams): what every all-gather wrote, per module (forward, then backward's again), for
    two steps of int8 gradients, on the device and on the CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import pycomm.fsdp

    out = []
    for dev in (torch.device(device, 0) if device == "cuda" else torch.device(device), "cpu"):
        dev = torch.device(dev)
        m = _fsdp_on(dev, init_device_mesh(dev.type, (dist.get_world_size(),)))
        comm = pycomm.fsdp.compress(m, hook="int8", all_gather=codec)
        written = {}

        class Recording:
            def __init__(self, name, inner, written):
                self.name, self.inner, self.written = name, inner, written

            def allocate(self, size, *, dtype, device):
                return self.inner.allocate(size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                work = self.inner(output_tensor, input_tensor, group, async_op)
                self.written.setdefault(self.name, []).append(output_tensor.cpu())
                return work

        for name, module in m.named_modules():
            if name in comm.all_gathers:
                module.set_custom_all_gather(Recording(name, comm.all_gathers[name], written))
        _sgd_steps(m, dev, 2)
        out.append((written, comm.stats["all_gather"]))
    return out


def test_fsdp_all_gather_on_the_device(gpu):
    import pycomm

    results = pycomm.launch(
        _rank_fsdp_all_gather_on, 2, gpu.type, "int8", backend="gloo", timeout=300
    )
    (dev0, stats0), (cpu0, _) = results[0]
    assert stats0["calls"] == 2 * 2 * 2  # two modules, forward and backward, two steps
    for (on_device, _), (on_cpu, _) in results:
        for name, outs in on_device.items():
            assert len(outs) == 4
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
            assert torch.equal(outs[0], on_cpu[name][0])  # the first: the CPU kernels' bits
            assert all(torch.equal(a, b) for a, b in zip(outs, dev0[name]))  # every rank


@pytest.mark.parametrize("codec", ["allreduce", "int8", "fp8"])
def test_exchange_on_the_device(gpu, codec):
    import pycomm

    results = pycomm.launch(_rank_exchange_on, 2, gpu.type, codec, backend="gloo", timeout=300)
    for on_device, on_cpu in results:
        for a, b in zip(on_device, on_cpu):
            assert torch.equal(a, b)  # the device's kernels give the CPU's bits


def _rank_exchange_after_side_stream(async_op):
    """Each call made on a side stream right after work that writes its input was queued
    there behind ~0.1 s of the GPU's time (as FSDP2 queues its reduce-scatter input on a
    stream of its own): what the call returns, read on that stream after ``wait()``. A call
    that did not wait for the caller's stream would read the zeros before the write."""
    import torch.distributed as dist

    import pycomm

    dev = torch.device("cuda", 0)
    r, n = dist.get_rank(), dist.get_world_size()
    ex = pycomm.Exchange("int8", start_iter=0)
    side = torch.cuda.Stream(dev)
    out = {}
    for call in ("all_reduce", "reduce_scatter", "all_gather"):
        x = torch.zeros(n * 4096, device=dev)
        y = torch.empty(4096 if call == "reduce_scatter" else n * 4096, device=dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            x.fill_(r + 1.0)
            if call == "all_reduce":
                work, y = ex.all_reduce(x, key="a", async_op=async_op), x
            elif call == "reduce_scatter":
                work = ex.reduce_scatter(y, x, key="b", async_op=async_op)
            else:
                work = ex.all_gather(y, x[:4096], key="c", async_op=async_op)
            work.wait()
            out[call] = y.clone()
        torch.cuda.synchronize()
        out[call] = out[call].cpu()
    return out


@pytest.mark.parametrize("async_op", [True, False])
def test_exchange_waits_for_the_callers_stream(cuda, async_op):
    import pycomm

    n = 2
    for out in pycomm.launch(_rank_exchange_after_side_stream, n, async_op, backend="gloo",
                             timeout=300):  # fmt: skip
        mean = torch.full((n * 4096,), (n + 1) / 2)
        assert torch.allclose(out["all_reduce"], mean, atol=1e-2)
        assert torch.allclose(out["reduce_scatter"], mean[:4096], atol=1e-2)
        ranks = torch.arange(1.0, n + 1).repeat_interleave(4096)
        assert torch.allclose(out["all_gather"], ranks, atol=1e-2)


def _rank_hsdp_on(device, hook):
    """On the device, then on the CPU: FSDP2 sharded over the 4 ranks, and HSDP on 2 nodes of
    2 (``pycomm.fsdp.node_mesh()``, ``hook`` across the nodes, its all-reduce on a stream of
    its own on a GPU), three SGD steps each. Returns, per device, every rank's local shards
    (on the CPU, gathered as objects: no collective of the device's own) of both runs, and the
    HSDP run's all-reduce stats."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import pycomm.fsdp
    from pycomm.topology import set_nodes

    set_nodes(2)
    try:
        out = []
        for dev in (torch.device(device, 0) if device == "cuda" else torch.device(device), "cpu"):
            dev = torch.device(dev)
            runs = []
            for hsdp in (False, True):
                if hsdp:
                    mesh = pycomm.fsdp.node_mesh(dev.type)
                else:
                    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
                m = _fsdp_on(dev, mesh)
                comm = pycomm.fsdp.compress(m, hook=hook) if hsdp else None
                _sgd_steps(m, dev, 3)
                shards = [p.to_local().detach().cpu() for p in m.parameters()]
                runs.append(pycomm.dist.all_gather_objects(shards, None))
            out.append((runs, comm.stats["all_reduce"]))
        return out
    finally:
        set_nodes(None)


def _params(shards_by_rank, ranks):
    """The full parameters, flat, from the dim-0 shards of ``ranks`` (FSDP2's layout)."""
    per_param = zip(*(shards_by_rank[r] for r in ranks))
    return torch.cat([torch.cat(parts).reshape(-1) for parts in per_param])


@pytest.mark.parametrize("hook", ["allreduce", "int8"])
def test_hsdp_on_the_device(gpu, hook):
    import pycomm

    results = pycomm.launch(_rank_hsdp_on, 4, gpu.type, hook, backend="gloo", timeout=300)
    (on_device, ar_device), (on_cpu, _) = results[0]
    assert ar_device["calls"] == 2 * 3  # one all-reduce a block a step, across the nodes
    assert ar_device["bytes_sent"] > 0
    fsdp, hsdp = on_device
    node0, node1 = _params(hsdp, [0, 1]), _params(hsdp, [2, 3])
    assert torch.equal(node0, node1)  # every node holds the same replica, bit for bit
    every_rank = _params(fsdp, [0, 1, 2, 3])
    rel = ((node0 - every_rank).norm() / every_rank.norm()).item()
    if hook == "allreduce":  # exact across the nodes: FSDP2 over every rank, to fp32 rounding
        assert rel < 1e-5, rel
    else:  # int8 across the nodes, from the third step: close, not equal
        assert 0 < rel < 0.02, rel
    # the same training on the CPU: the device's kernels and streams change no more than
    # the device's own arithmetic does
    cpu_hsdp = _params(on_cpu[1], [0, 1])
    assert ((node0 - cpu_hsdp).norm() / cpu_hsdp.norm()).item() < 1e-3
