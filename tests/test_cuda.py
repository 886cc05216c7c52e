"""The CUDA kernels (csrc/cuda) against the CPU kernels, bit for bit: odd sizes, every dtype,
strides, misaligned views, NaN/Inf, many tensors, bad input; and the hooks on CUDA tensors.

Each kernel check runs on two backends:

- ``cuda``: the real kernels on a GPU, with CUDA tensors. Skipped without a GPU;
  ``scripts/gpu_validate.sh`` runs this file on one.
- ``emu``: the same kernel source compiled as C++ against ``csrc/cuda/emu/emu.h``, which runs
  every CUDA thread as a fiber with real barriers and warp shuffles, registered as the CPU
  kernels of a mirror library ``pycomm_emu``. It runs everywhere (building it takes about half
  a minute, cached in the temp directory; ``PYCOMM_CUDA_EMU=0`` skips it), and checks the
  kernels' indexing, vector and scalar paths, reductions, launch shapes and rounding without a
  GPU (not their speed, nor what only concurrent blocks or a memory checker would show).

The expected values are the CPU kernels' (tested against pycomm.reference in test_ops.py and
test_codecs.py), so that a difference points at the CUDA kernel.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
from kernel_data import DTYPES, NAN
from kernel_data import bits_equal as _bits_equal
from kernel_data import codec_input as _x
from kernel_data import rand as _rand
from kernel_data import residual as _residual

from pycomm import ops, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
EMU_SOURCES = [
    os.path.join(CSRC, "cuda", "emu", "fusion_emu.cpp"),
    os.path.join(CSRC, "cuda", "emu", "codecs_emu.cpp"),
]


def _pycomm_ops() -> list[str]:
    return sorted(
        n.split("::", 1)[1]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("pycomm::")
    )


# --- the build: runs everywhere ------------------------------------------------------------


def test_build_has_a_cuda_kernel_for_every_op_or_none():
    names = _pycomm_ops()
    assert "quantize_int8" in names and "pack" in names
    has = {n: torch._C._dispatch_has_kernel_for_dispatch_key(f"pycomm::{n}", "CUDA") for n in names}
    # WITH_CUDA builds register every op for CUDA (a new op without a .cu kernel fails here)
    assert set(has.values()) == {ops.WITH_CUDA}, has
    expect = os.environ.get("PYCOMM_EXPECT_CUDA")
    if expect is not None:  # set by scripts/cuda_check.sh and scripts/gpu_validate.sh
        assert ops.WITH_CUDA == (expect == "1"), (ops.WITH_CUDA, expect)


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
    assert "copy%" in out.stdout


# --- backends --------------------------------------------------------------------------------


def _sources_digest() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for root, _, files in os.walk(os.path.join(CSRC, "cuda")):
        for f in sorted(files):
            with open(os.path.join(root, f), "rb") as fh:
                h.update(f.encode() + fh.read())
    with open(os.path.join(CSRC, "checks.h"), "rb") as fh:
        h.update(fh.read())
    return h.hexdigest()[:16]


_EMU_LIB = None


def load_emulator() -> None:
    """Builds (once per source version, cached in the temp directory) and loads the emulated
    CUDA kernels as ``torch.ops.pycomm_emu.*``, with pycomm's own schemas."""
    global _EMU_LIB
    if _EMU_LIB is not None:
        return
    from torch.utils.cpp_extension import load

    lib = torch.library.Library("pycomm_emu", "DEF")
    for name in _pycomm_ops():
        schema = str(getattr(torch.ops.pycomm, name).default._schema)
        lib.define(schema.split("::", 1)[1])
    build = os.environ.get("PYCOMM_EMU_BUILD") or os.path.join(
        tempfile.gettempdir(), f"pycomm_cuda_emu_{_sources_digest()}"
    )
    os.makedirs(build, exist_ok=True)
    load(
        name="pycomm_cuda_emu",
        sources=EMU_SOURCES,
        extra_cflags=[
            "-O1",
            "-ffp-contract=off",  # as the CPU kernels, so that fp32 rounds as on the GPU
            "-fno-strict-aliasing",
            "-Wno-unknown-pragmas",
            "-DPYCOMM_CUDA_EMULATION",
        ],
        extra_include_paths=[CSRC],
        build_directory=build,
        is_python_module=False,
        verbose=False,
    )
    _EMU_LIB = lib


class Backend:
    """Where the CUDA kernels run: ``cuda`` (a GPU) or ``emu`` (the emulator, on the CPU)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.device = torch.device("cuda") if name == "cuda" else torch.device("cpu")
        self.ns = torch.ops.pycomm if name == "cuda" else torch.ops.pycomm_emu

    def __call__(self, op: str, *args):
        return getattr(self.ns, op)(*args)

    def to(self, t, _copies=None):
        """t on this backend with the same shape, strides and storage offset (alignment)."""
        if t is None:
            return None
        key = t.untyped_storage().data_ptr()
        whole = None if _copies is None else _copies.get(key)
        if whole is None:
            n = t.untyped_storage().nbytes() // t.element_size()
            whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
            whole = whole.to(self.device, copy=True)
            if _copies is not None:
                _copies[key] = whole
        return whole.as_strided(t.shape, t.stride(), t.storage_offset())

    def args(self, args):
        """Every tensor of args (lists too) on this backend; tensors that share memory here
        share it there."""
        copies: dict = {}
        return [
            self.to(a, copies)
            if isinstance(a, torch.Tensor)
            else [self.to(t, copies) for t in a]
            if isinstance(a, list)
            else a
            for a in args
        ]


@functools.cache
def _backend(name: str) -> Backend:
    if name == "emu":
        load_emulator()
    return Backend(name)


@pytest.fixture(params=["emu", "cuda"])
def be(request) -> Backend:
    if request.param == "emu" and os.environ.get("PYCOMM_CUDA_EMU", "1") == "0":
        pytest.skip("PYCOMM_CUDA_EMU=0 (scripts/cuda_check.sh runs these)")
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device (scripts/gpu_validate.sh runs these on a GPU)")
        if not ops.WITH_CUDA:
            pytest.skip("pycomm._C was built without its CUDA kernels")
    return _backend(request.param)


@pytest.fixture
def cuda() -> Backend:
    if not torch.cuda.is_available() or not ops.WITH_CUDA:
        pytest.skip("needs a CUDA device and a CUDA build (scripts/gpu_validate.sh)")
    return _backend("cuda")


def _poisoned_like(t):
    return torch.full_like(t, NAN) if t.is_floating_point() else torch.full_like(t, 0x55)


# --- fusion ops ------------------------------------------------------------------------------

# 0, 1, around one vector (8), one block's share (2048), one chunk (8192), large
SIZES = [0, 1, 7, 9, 2047, 2049, 8191, 8193, 30011]


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_pack_unpack(be, in_dtype, out_dtype):
    for n in SIZES:
        for scale in (0.5, 1.0):
            tensors = [_rand(n, in_dtype), _rand(n + 3, in_dtype, seed=5)]
            want = ops.pack(tensors, scale, out_dtype)
            dev = [be.to(t) for t in tensors]
            _bits_equal(be("pack", dev, scale, out_dtype), want)
            into = be.to(_poisoned_like(want))
            be("pack_into_", into, dev, scale)
            _bits_equal(into, want)
            back_want = [torch.full_like(t, NAN) for t in tensors]
            ops.unpack_(want, back_want, 3.0)
            back = [be.to(t) for t in back_want]
            for b in back:
                b.fill_(NAN)
            be("unpack_", be.to(want), back, 3.0)
            for b, w in zip(back, back_want):
                _bits_equal(b, w)


def _mixed(dtype, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    shapes = [(), (0,), (1,), (3, 5), (17,), (33, 3), (2, 0, 4), (1000,), (129, 7), (4096,)]
    out = []
    for i in range(count):
        t = (torch.randn(shapes[i % len(shapes)], generator=g) * 2).to(dtype)
        if i % 4 == 3 and t.dim() == 2:
            t = t.t()  # non-contiguous
        if i % 7 == 5 and t.dim() == 1 and t.numel() > 4:
            t = t[::2]  # strided
        if i % 11 == 6 and t.dim() == 1 and t.numel() > 4:
            t = t[1:]  # contiguous, misaligned
        out.append(t)
    out[1] = torch.tensor([NAN, float("inf"), -float("inf")], dtype=dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_many_mixed_strided(be, dtype):
    # 300 tensors: more than one launch's table; strided ones are staged
    tensors = _mixed(dtype, 300)
    dev = [be.to(t) for t in tensors]
    for scale, out_dtype in ((0.25, None), (1.0, None), (2.0, torch.float32)):
        want = ops.pack(tensors, scale, out_dtype)
        _bits_equal(be("pack", dev, scale, out_dtype), want)
    # into a flat that starts 1 element into its buffer: every piece misaligned
    want = ops.pack(tensors, 0.5)
    buf = torch.full((want.numel() + 9,), NAN, dtype=dtype)
    into = be.to(buf)[1 : 1 + want.numel()]
    be("pack_into_", into, dev, 0.5)
    _bits_equal(into, want)
    whole = into.cpu()
    assert be.to(buf)[0].isnan() and whole.numel() == want.numel()
    # unpack_ into non-contiguous targets, and back from the misaligned flat
    targets = [
        torch.zeros(t.shape[::-1], dtype=dtype).t() if t.dim() == 2 else torch.zeros_like(t)
        for t in tensors
    ]
    assert any(not t.is_contiguous() for t in targets)
    dev_targets = [be.to(t) for t in targets]
    ops.unpack_(want, targets, 4.0)
    be("unpack_", into, dev_targets, 4.0)
    for g, w in zip(dev_targets, targets):
        _bits_equal(g, w)


def test_unpack_overlapping_target_rejected(be):
    t = be.to(torch.ones(1)).expand(3, 2)
    with pytest.raises(RuntimeError, match="memory location"):
        be("unpack_", be.to(torch.ones(6)), [t], 1.0)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("fp32_dst", [True, False])
def test_accumulate(be, src_dtype, fp32_dst):
    dst_dtype = torch.float32 if fp32_dst else src_dtype
    for n in SIZES:
        src = _rand(n, src_dtype)
        dst = _rand(n, dst_dtype, special=False, seed=9)
        got = be.to(dst)
        ops.accumulate_(dst, src, 0.3)
        be("accumulate_", got, be.to(src), 0.3)
        _bits_equal(got, dst)


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b.t(),  # both transposed alike: one dense pass
        lambda b: b[:, ::2],  # strided: staged
        lambda b: b[1:, 3:],  # offset, non-contiguous
    ],
)
def test_accumulate_and_scale_strided(be, make):
    base_d, base_s = torch.randn(64, 48), torch.randn(64, 48).bfloat16()
    dst, src = make(base_d), make(base_s)
    got = be.to(dst)
    ops.accumulate_(dst, src, -2.0)
    be("accumulate_", got, be.to(src), -2.0)
    _bits_equal(got, dst)
    got = be.to(src)
    ops.scale_(src, 3.0)
    be("scale_", got, 3.0)
    _bits_equal(got, src)
    # a transposed src into a contiguous dst: staged
    dst, src = torch.randn(48, 64), torch.randn(64, 48).t()
    got = be.to(dst)
    ops.accumulate_(dst, src, 0.5)
    be("accumulate_", got, be.to(src), 0.5)
    _bits_equal(got, dst)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale(be, dtype):
    for n in SIZES:
        t = _rand(n, dtype)
        got = be.to(t)
        ops.scale_(t, 0.125)
        be("scale_", got, 0.125)
        _bits_equal(got, t)
        v = _rand(n + 1, dtype)[1:]  # misaligned: the scalar path
        got = be.to(v)
        ops.scale_(v, 3.0)
        be("scale_", got, 3.0)
        _bits_equal(got, v)


# --- codecs ----------------------------------------------------------------------------------


def _check_encoder(be, name, x, scale, arg, numel, with_residual):
    r_cpu = _residual(numel) if with_residual else None
    r_dev = be.to(r_cpu)
    want = getattr(ops, name)(x, r_cpu, scale, arg, numel)
    got = be(name, be.to(x), r_dev, scale, arg, numel)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        _bits_equal(g, w)
    if with_residual:
        _bits_equal(r_dev, r_cpu)


@pytest.mark.parametrize(
    "name, arg, block",
    [("quantize_int8", 64, 64), ("quantize_int8", 3, 3), ("quantize_int8", 4096, 4096),
     ("quantize_onebit", 64, 64), ("quantize_onebit", 4096, 4096), ("encode16", torch.bfloat16, 8)],
)  # fmt: skip
def test_residual_out(be, name, arg, block):
    # the new residual in residual_out (non-finite blocks: the old value), residual untouched
    for n in _sizes(block):
        numel = _numel(n, block, 1)
        x = _x(n, torch.bfloat16, block)
        old = _residual(numel)
        r_cpu, out_cpu = old.clone(), torch.full((numel,), 123.0)
        want = getattr(ops, name)(x, r_cpu, 0.5, arg, numel, out_cpu)
        r_dev, out_dev = be.to(old), be.to(torch.full((numel,), NAN))
        got = be(name, be.to(x), r_dev, 0.5, arg, numel, out_dev)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            _bits_equal(g, w)
        _bits_equal(out_dev, out_cpu)
        _bits_equal(r_dev, old)


def _numel(n, block, pad_blocks=0):
    return -(-n // block) * block + pad_blocks * block


# 1, 8, 64, 256 the usual; 3, 100, 1500 not multiples of 8; 2048 one tile; 2560, 4096 larger
INT8_BLOCKS = [1, 3, 8, 64, 100, 256, 1500, 2048, 2560, 4096]
ONEBIT_BLOCKS = [8, 64, 256, 2048, 4096]


def _sizes(block):
    return sorted({0, 1, max(block - 1, 0), block, block + 1, 7, 9, 3000, 20011})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", INT8_BLOCKS)
def test_quantize_int8(be, dtype, block):
    for n in _sizes(block):
        for pad in (0, 3):
            numel = _numel(n, block, pad)
            x = _x(n, dtype, block, seed=pad)
            for with_residual in (False, True):
                _check_encoder(be, "quantize_int8", x, 0.5, block, numel, with_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", ONEBIT_BLOCKS)
def test_quantize_onebit(be, dtype, block):
    for n in _sizes(block):
        for pad in (0, 2):
            numel = _numel(n, block, pad)
            x = _x(n, dtype, block, seed=pad)
            for with_residual in (False, True):
                _check_encoder(be, "quantize_onebit", x, 2.0, block, numel, with_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_encode16(be, dtype, out_dtype):
    for n in [0, 1, 7, 9, 33, 2049, 20011]:
        for pad in (0, 5):
            x = _x(n, dtype, 8, seed=pad)
            if n > 20:
                x[5] = 1e6 if dtype != torch.float16 else 6e4  # overflows fp16 after scale
            for with_residual in (False, True):
                _check_encoder(be, "encode16", x, 3.0, out_dtype, n + pad, with_residual)


@pytest.mark.parametrize("name", ["quantize_int8", "quantize_onebit", "encode16"])
def test_encoders_strided_misaligned_and_tiny(be, name):
    arg = torch.bfloat16 if name == "encode16" else 64
    base = (torch.randn(300, 70) * 2).to(torch.float16)
    for x in (base.t(), base[::3, ::2], base[:, 5], base.reshape(-1)[3:6403]):
        numel = _numel(x.numel(), 64, 1)
        _check_encoder(be, name, x, 0.5, arg, numel, True)
    # a misaligned residual: the scalar paths
    x = _x(1000, torch.float32, 64)
    r_cpu = _residual(1025)[1:]
    r_dev = be.to(_residual(1025))[1:]
    want = getattr(ops, name)(x, r_cpu, 1.0, arg, 1024)
    got = be(name, be.to(x), r_dev, 1.0, arg, 1024)
    for g, w in zip(got, want) if isinstance(got, tuple) else ((got, want),):
        _bits_equal(g, w)
    _bits_equal(r_dev, r_cpu)
    # zeros, signed zeros, subnormals, the largest finite values
    rows = [
        [0.0] * 16,
        [-0.0] * 16,
        [1e-38, 0.0, -1e-38, -0.0] * 4,
        [1e-40, 0.0, 3e-41, -1e-45] * 4,
        [3.4e38, -3.4e38] * 8,
    ]
    for vals in rows:
        x = torch.tensor(vals)
        if name == "encode16":
            for dt in (torch.float16, torch.bfloat16):
                _check_encoder(be, name, x, 1.0, dt, 16, True)
            continue
        for block in (1, 4, 8, 16) if name == "quantize_int8" else (8, 16):
            _check_encoder(be, name, x, 1.0, block, 16, True)


# bf16 residuals: y in fp32 as with fp32 ones, the new residual rounded to nearest even, a
# non-finite block's (16-bit: element's) kept bit for bit. Expected: pycomm.reference (the CPU
# kernels are compared below where the build has them).

# (op, arg, block): the tile kernel at small, odd and whole-tile blocks, the one-block-per-CTA
# kernel past a tile (4096), 16-bit to both output dtypes
_BF16_CASES = [
    ("quantize_int8", 1, 1), ("quantize_int8", 3, 3), ("quantize_int8", 64, 64),
    ("quantize_int8", 2048, 2048), ("quantize_int8", 4096, 4096),
    ("quantize_onebit", 8, 8), ("quantize_onebit", 64, 64), ("quantize_onebit", 4096, 4096),
    ("encode16", torch.bfloat16, 8), ("encode16", torch.float16, 8),
]  # fmt: skip
_BF16_IDS = [f"{n}-{str(a).replace('torch.', '')}" for n, a, _ in _BF16_CASES]


def _bf16_residual(numel, seed=1):
    # from about y's rounding error down to 1e-6 of it: the new residuals need all of bf16's
    # exponent range and most of them round (a truncation or an fp32 store would show)
    return (_residual(numel, seed) * torch.logspace(0, -6, numel)).bfloat16()


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _check_bf16_encoder(be, name, x, scale, arg, numel, separate, r0=None):
    """be's encoder vs the reference with a bf16 residual (r0, or a random one): in place, or
    into residual_out (then residual is only read)."""
    old = _bf16_residual(numel) if r0 is None else r0
    r_ref = old.clone()
    out_ref = torch.full((numel,), 123.0).bfloat16() if separate else None
    want = _tuple(getattr(reference, name)(x, r_ref, scale, arg, numel, out_ref))
    r_dev = be.to(old)
    out_dev = be.to(torch.full((numel,), NAN).bfloat16()) if separate else None
    got = _tuple(be(name, be.to(x), r_dev, scale, arg, numel, out_dev))
    for g, w in zip(got, want):
        _bits_equal(g, w)
    if separate:
        _bits_equal(out_dev, out_ref)
        _bits_equal(r_dev, old)
        return out_dev.cpu()
    _bits_equal(r_dev, r_ref)
    return r_dev.cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, arg, block", _BF16_CASES, ids=_BF16_IDS)
def test_bf16_residual(be, dtype, name, arg, block):
    sizes = [0, 1, 7, 9, block + 1, 3000] + ([20011] if block in (3, 64) else [])
    for n in sizes:
        for pad in (0, 1):
            numel = _numel(n, block, pad)
            x = _x(n, dtype, block, seed=pad)  # n > 2 * block: NaN and ±Inf blocks
            for separate in (False, True):
                _check_bf16_encoder(be, name, x, 0.5, arg, numel, separate)


@pytest.mark.parametrize("name, arg, block", _BF16_CASES, ids=_BF16_IDS)
def test_bf16_residual_nonfinite_block_kept_bit_for_bit(be, name, arg, block):
    numel = _numel(max(4 * block, 64), block)
    x = _x(numel, torch.float32, block, special=False)
    old = _bf16_residual(numel)
    bits = old.view(torch.int16)
    # residual NaNs with payloads (a signalling pattern; negative), +Inf, and an x of Inf: each
    # makes its block (16-bit: element) non-finite
    bits[1], bits[block + 2], bits[numel - 2] = 0x7F81, -0x3F, 0x7F80  # -0x3F: 0xFFC1
    x[numel - 1] = float("inf")
    bad = [1, block + 2, numel - 2, numel - 1]
    kept = bad if name == "encode16" else sorted({j for i in bad for j in _block_of(i, block)})
    for separate in (False, True):
        new = _check_bf16_encoder(be, name, x, 1.0, arg, numel, separate, old.clone())
        # the reference's NaNs are torch's canonical one; the kernels store the old bits
        assert torch.equal(new.view(torch.int16)[kept], bits[kept]), separate
        updated = [i for i in range(numel) if i not in kept]
        assert not torch.equal(new.view(torch.int16)[updated], bits[updated])


def _block_of(i, block):
    return range(i // block * block, (i // block + 1) * block)


@pytest.mark.parametrize("name", ["quantize_int8", "quantize_onebit", "encode16"])
def test_bf16_residual_misaligned_and_strided_x(be, name):
    arg = torch.bfloat16 if name == "encode16" else 64
    # views 1 element (2 bytes: the scalar path) and 8 (16 bytes: vectors) into their buffers
    for offset in (1, 8):
        buf = _bf16_residual(1024 + offset)
        x = _x(1000, torch.float16, 64)
        want_r = buf[offset:].clone()
        want = _tuple(getattr(reference, name)(x, want_r, 1.0, arg, 1024))
        got_r = be.to(buf)[offset:]
        got = _tuple(be(name, be.to(x), got_r, 1.0, arg, 1024))
        for g, w in zip(got, want):
            _bits_equal(g, w)
        _bits_equal(got_r, want_r)
        # residual_out misaligned too
        out_buf = torch.full((1024 + offset,), NAN).bfloat16()
        want_o = out_buf[offset:].clone()
        getattr(reference, name)(x, buf[offset:], 1.0, arg, 1024, want_o)
        got_o = be.to(out_buf)[offset:]
        be(name, be.to(x), be.to(buf)[offset:], 1.0, arg, 1024, got_o)
        _bits_equal(got_o, want_o)
    base = (torch.randn(300, 70) * 2).to(torch.bfloat16)
    for x in (base.t(), base[::3, ::2]):
        numel = _numel(x.numel(), 64, 1)
        for separate in (False, True):
            _check_bf16_encoder(be, name, x, 0.5, arg, numel, separate)


def _cpu_has_bf16_residuals() -> bool:
    try:
        torch.ops.pycomm.quantize_int8(torch.ones(8), torch.zeros(8).bfloat16(), 1.0, 8, 8)
    except RuntimeError as e:
        if "expected Float" not in str(e):
            raise
        return False
    return True


@pytest.mark.parametrize("name, arg, block", _BF16_CASES, ids=_BF16_IDS)
def test_bf16_residual_same_as_cpu_kernels(be, name, arg, block):
    if not _cpu_has_bf16_residuals():
        pytest.skip("the in-place CPU build predates bf16 residuals")
    for dtype in DTYPES:
        for n in (1, block + 1, 3000):
            numel = _numel(n, block, 1)
            x = _x(n, dtype, block)
            for separate in (False, True):
                old = _bf16_residual(numel)
                r_cpu, r_dev = old.clone(), be.to(old)
                out_cpu = torch.full((numel,), 7.0).bfloat16() if separate else None
                out_dev = be.to(torch.full((numel,), NAN).bfloat16()) if separate else None
                want = _tuple(getattr(ops, name)(x, r_cpu, 0.5, arg, numel, out_cpu))
                got = _tuple(be(name, be.to(x), r_dev, 0.5, arg, numel, out_dev))
                for g, w in zip(got, want):
                    _bits_equal(g, w)
                _bits_equal(r_dev, r_cpu)
                if separate:
                    _bits_equal(out_dev, out_cpu)


@pytest.mark.parametrize("name", ["quantize_int8", "quantize_onebit", "encode16"])
@pytest.mark.parametrize("r_dtype, out_dtype", [(torch.bfloat16, torch.float32),
                                                (torch.float32, torch.bfloat16)])  # fmt: skip
def test_residual_out_of_another_dtype_refused(be, name, r_dtype, out_dtype):
    arg = torch.float16 if name == "encode16" else 8
    r, out = be.to(torch.zeros(16, dtype=r_dtype)), be.to(torch.zeros(16, dtype=out_dtype))
    names = {torch.float32: "Float", torch.bfloat16: "BFloat16"}
    msg = (
        f"pycomm.{name}: residual_out has dtype {names[out_dtype]}, "
        f"expected {names[r_dtype]} like residual"
    )
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        be(name, be.to(torch.ones(16)), r, 1.0, arg, 16, out)
    assert not r.cpu().any() and not out.cpu().any()  # nothing written
    with pytest.raises(RuntimeError, match=r"residual has dtype Half, expected Float or BFloat16"):
        be(name, be.to(torch.ones(16)), be.to(torch.zeros(16).half()), 1.0, arg, 16)


def _encode_rows(name, rows, n, block, numel, special):
    outs = [
        getattr(ops, name)(
            _x(n, torch.float32, block, special, seed=r), None, r + 1.0, block, numel
        )
        for r in range(rows)
    ]
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


def _check_sum(be, name, args, out):
    want_out = out.clone()
    want = getattr(ops, name)(*args, want_out)
    got_out = be.to(_poisoned_like(out))
    got = be(name, *(be.to(a) if isinstance(a, torch.Tensor) else a for a in args), got_out)
    _bits_equal(got_out, want_out)
    ref_out = out.clone()
    ref = getattr(reference, name)(*args, ref_out)
    got = got.cpu()
    assert got.dtype == torch.float64 and got.shape == (2,)
    assert got[1] == want[1] == ref[1]
    torch.testing.assert_close(got[0], ref[0], rtol=1e-9, atol=0)


def _out(m, dtype, short):
    return torch.full((max(m - short, 0),), 7.0, dtype=dtype)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_int8_sum(be, rows, out_dtype):
    for block in (1, 3, 64, 100, 256):
        for n in (1, block + 1, 3000) + ((20011,) if block in (3, 64) else ()):
            numel = _numel(n, block, 1)
            for special in (False, True):
                codes, scales = _encode_rows("quantize_int8", rows, n, block, numel, special)
                for short in (0, block + 5):
                    _check_sum(
                        be,
                        "dequantize_int8_sum",
                        (codes, scales, block, 0.5),
                        _out(numel, out_dtype, short),
                    )


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_onebit_sum(be, rows, out_dtype):
    for block in (8, 64, 256):
        for n in (1, block + 1, 3000) + ((20011,) if block == 64 else ()):
            numel = _numel(n, block, 1)
            for special in (False, True):
                bits, scales = _encode_rows("quantize_onebit", rows, n, block, numel, special)
                for short in (0, block + 5):
                    _check_sum(
                        be,
                        "dequantize_onebit_sum",
                        (bits, scales, block, 0.25),
                        _out(numel, out_dtype, short),
                    )


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("chunk_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_decode16_sum(be, rows, chunk_dtype, out_dtype):
    for m in (1, 9, 33, 2049, 20011):
        chunks = torch.stack([_x(m, torch.float32, 8, seed=r) * (r + 1) for r in range(rows)])
        chunks = chunks.to(chunk_dtype)
        for short in (0, 5):
            _check_sum(be, "decode16_sum", (chunks, 3.0), _out(m, out_dtype, short))


@pytest.mark.parametrize("hook", ["bf16", "int8", "onebit"])
@pytest.mark.parametrize("rows, m", [(1, 256), (3, 2048), (4, 20480)])
def test_decoders_read_the_receive_buffers_row_slices(be, hook, rows, m):
    # as the hooks decode: codes and scales are column slices of one [R, codes | scales] uint8
    # buffer (Codec.pack / Codec.split), read in place, no contiguous copy
    from pycomm.hooks import compressed

    codec = {
        "bf16": lambda: compressed.Float16Codec(torch.bfloat16),
        "int8": lambda: compressed.Int8Codec(256),
        "onebit": lambda: compressed.OneBitCodec(64),
    }[hook]()
    x = torch.stack([_x(m, torch.float32, codec.block, seed=r) * (r + 1) for r in range(rows)])
    enc = [codec.encode(x[r], None, 1.0, m) for r in range(rows)]
    scales = None if enc[0][1] is None else torch.cat([e[1] for e in enc])
    packed = codec.pack(torch.cat([e[0] for e in enc]), scales, rows)
    codes, scales = codec.split(packed, m)
    assert not codes.is_contiguous() or scales is None or rows == 1
    name = {"bf16": "decode16_sum", "int8": "dequantize_int8_sum"}.get(
        hook, "dequantize_onebit_sum"
    )
    args = (codes, 0.5) if scales is None else (codes, scales, codec.block, 0.5)
    _check_sum(be, name, args, torch.full((m,), 7.0))  # the slices, as they are, on every backend


def test_sum_overflow_zero_size_and_misaligned_out(be):
    chunks = torch.full((2, 12), 60000.0, dtype=torch.float16)
    _check_sum(be, "decode16_sum", (chunks, 1.0), torch.empty(3, 4, dtype=torch.float16))
    codes = torch.full((1, 16), 127, dtype=torch.int8)
    scales = torch.tensor([[2.0, NAN]])
    _check_sum(be, "dequantize_int8_sum", (codes, scales, 8, 1.0), torch.empty(2, 8))
    out = be.to(torch.empty(0))
    z = be.to(torch.empty(1, 0, dtype=torch.int8))
    assert be("dequantize_int8_sum", z, be.to(torch.empty(1, 0)), 8, 1.0, out).tolist() == [0, 0]
    chunks = torch.randn(2, 40).bfloat16()
    buf = torch.full((41,), 7.0)
    want = buf[1:].clone()
    ops.decode16_sum(chunks, 0.5, want)
    got = be.to(buf)[1:]
    be("decode16_sum", be.to(chunks), 0.5, got)
    _bits_equal(got, want)


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
    ("pack_into_", lambda: (torch.ones(10)[::2], [torch.ones(5)], 1.0)),  # strided flat
    ("pack_into_", lambda: (torch.ones(4), [torch.ones(5)], 1.0)),  # short flat
    ("pack_into_", lambda: (torch.ones(5), [torch.ones(5).long()], 1.0)),
    (
        "dequantize_int8_sum",  # columns of a row-major tensor are not rows
        lambda: (torch.zeros(16, 2).char().t(), torch.ones(2, 2), 8, 1.0, torch.empty(16)),
    ),
]


@pytest.mark.parametrize("name, make", _BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(_BAD)])
def test_bad_input_same_message_as_cpu(be, name, make):
    with pytest.raises(RuntimeError) as cpu:
        getattr(torch.ops.pycomm, name)(*make())
    with pytest.raises(RuntimeError) as dev:
        be(name, *be.args(make()))
    first = str(cpu.value).splitlines()[0]
    assert str(dev.value).splitlines()[0] == first
    assert re.match(r"pycomm\.\w+: ", first), first


@pytest.mark.parametrize("name, make", _BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(_BAD)])
def test_bad_input_same_message_in_fake_mode(name, make):
    # the fakes (what FakeTensorMode and torch.compile run) port csrc/checks.h: same messages
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


def test_fakes_give_the_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, r = torch.randn(20, 16), torch.zeros(320)
    want = ops.quantize_onebit(x, r.clone(), 1.0, 64, 320)
    with FakeTensorMode() as mode:
        got = ops.quantize_onebit(mode.from_tensor(x), mode.from_tensor(r), 1.0, 64, 320)
    for g, w in zip(got, want):
        assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device)


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
def test_opcheck_cuda(cuda, name, make):
    torch.library.opcheck(getattr(torch.ops.pycomm, name).default, make("cuda"))


def _rank_hooks_on_cuda(hook, steps, side_stream=False):
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    # the caller's stream: the hooks must enqueue on it, not on the default stream
    ctx = torch.cuda.stream(torch.cuda.Stream()) if side_stream else contextlib.nullcontext()
    with ctx:
        return _train_on_cuda(hook, steps, dev, dist, DDP, pycomm)


def _train_on_cuda(hook, steps, dev, dist, DDP, pycomm):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 3)
        ).to(dev)

    ddp = pycomm.wrap(model(), hook=hook, bucket_cap_mb=0.02)
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
        assert ours.is_cuda
        errors.append(((ours - exact).norm() / exact.norm()).item())
        grads.append(ours.cpu())
    torch.cuda.current_stream().synchronize()
    return errors, grads, dict(pycomm.hook_state(ddp).stats)


@pytest.mark.parametrize(
    "hook, bound",
    [("allreduce", 0.0), ("bf16", 1e-2), ("fp16", 2e-3), ("int8", 5e-2), ("onebit", 1.5)],
)
def test_hooks_on_cuda_two_ranks_gloo(cuda, hook, bound):
    import pycomm

    results = pycomm.launch(_rank_hooks_on_cuda, 2, hook, 5, backend="gloo", timeout=300)
    errors, grads, stats = results[0]
    assert errors[0] == 0.0 and errors[1] == 0.0  # warm-up: the exact all-reduce
    assert max(errors) <= bound, errors
    if hook != "allreduce":
        assert max(errors[2:]) > 0  # the codec ran
    assert stats["steps"] == 5 and stats.get("nonfinite_buckets", 0) == 0
    for a, b in zip(grads, results[1][1]):  # every rank holds the same reduced gradients
        assert torch.equal(a, b)
    # the same training on a stream of the caller's: the same gradients, bit for bit
    side = pycomm.launch(_rank_hooks_on_cuda, 2, hook, 5, True, backend="gloo", timeout=300)
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

hook = sys.argv[1]
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
dev = torch.device("cuda", 0)
states = {
    "allreduce": (hooks.AllreduceState, hooks.allreduce_hook),
    "fp16": (hooks.Fp16State, hooks.compressed_hook),
    "bf16": (hooks.Bf16State, hooks.compressed_hook),
    "int8": (hooks.Int8State, hooks.compressed_hook),
    "onebit": (hooks.OneBitState, hooks.compressed_hook),
}
make, fn = states[hook]
state = make(None)
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
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
for _ in range(4):
    step()
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
print("STEPS", state.stats["steps"])
"""


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "bf16", "int8", "onebit"])
def test_hooks_never_synchronize_the_host(cuda, hook):
    out = subprocess.run(
        [sys.executable, "-c", SYNC_FREE, hook], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STEPS 7" in out.stdout, out.stdout


def test_ops_never_synchronize_the_host(cuda):
    n, block = 1 << 16, 256
    x = torch.randn(n, device="cuda")
    r = torch.zeros(n, device="cuda")
    out = torch.empty(n, device="cuda")
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
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("hook", ["allreduce", "bf16", "int8", "onebit"])
def test_hooks_on_cuda_nccl_world_one(cuda, hook):
    import pycomm

    (res,) = pycomm.launch(_rank_hooks_on_cuda, 1, hook, 3, backend="nccl", timeout=300)
    errors, _, stats = res
    assert errors == [0.0] * 3 and stats["steps"] == 3
