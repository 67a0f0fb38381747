"""Register-blocked fp32 and bfloat16 score tiles for numba kernels, written as LLVM vector code.

Scoring gallery rows against a batch of queries is a skinny matrix product. Written as plain numba
loops it either vectorised each dot product over the dimensions (a horizontal sum per (row, query)
pair: 70-75 GFLOP/s on the 2-core AMD EPYC host, half of a large sgemm's 152) or, vectorised across
queries, spilled its accumulators to the stack (3-36 GFLOP/s, with numba's SLP vectoriser on or
off). The compiler had to be told the register blocking, so these intrinsics emit it directly:

* a tile is 4 or 6 gallery rows x ``GROUP`` (16) queries, held in 8 or 12 accumulators of 8 lanes
  (AVX2's ymm registers; LLVM splits or joins them on other targets), or, where numba compiles for
  AVX-512 (:func:`wide_vectors`), 12 rows held in 12 accumulators of 16 lanes (zmm);
* the queries are read transposed, ``qt`` (D, W): per dimension, the 16 queries are loaded as two
  8-lane vectors (or one of 16) and each row's value is broadcast and multiplied into them
  (``llvm.fmuladd``: one fused multiply-add where the CPU has one);
* each score is a sum in dimension order: no horizontal sums, no shuffles.

**bfloat16 tiles.** Where numba compiles for AVX512-BF16 (:func:`bf16_tiles`), the same intrinsics
also take ``x`` as the bits of a bfloat16 gallery (uint16, (N, D), D even) and ``qt`` as bfloat16
query pairs, (D / 2, 2 W) uint16: per pair of dimensions, each query's two values side by side.
Each step is one ``vdpbf16ps`` per row: two dimensions of 16 queries, the products exact and summed
in fp32 (round to nearest, denormals read and written as zero). Half the bytes of the fp32 tile, and
twice its multiply-adds per instruction: 16 queries over 1M x 128 demo vectors scored in 15.5 ms
against 29.7 for the fp32 pass on a 2-core Zen 4 EPYC (docs/results/2026-11-28-bf16-tiles.md).

The same product with 4 rows per tile ran at 125-144 GFLOP/s for 64 queries on that host
(docs/results/2026-11-28-exact-tiles.md); on a Zen 4 EPYC (AVX-512), 64 queries ran at 154
GFLOP/s in 12-row tiles against 116-128 in 6-row ones (docs/results/2026-11-28-zen4-exact.md).
A batch of 16 reads each row once for few flops and was bound by memory latency, so
:func:`prefetch_rows` asks for rows some way ahead.

numba caches the kernels that use these by their own file's time stamp only: after editing this
file, delete the ``*.nbi`` / ``*.nbc`` files in ``core/__pycache__`` (a fresh install has none).

Every array must be float32 and C-contiguous, ``qt``'s width a multiple of 16, and the indices in
range: nothing is checked inside (the callers in :mod:`icr.core.threshold_scan` do).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

GROUP = 16  # queries of a tile: two 8-lane vectors, or one of 16 lanes
LANES = 8  # of a vector where nothing wider is asked for (AVX2: 8 floats)
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I8P = ir.IntType(8).as_pointer()


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite's IR builder has no such type; LLVM parses the name)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _is_matrix(ty: Any, dtype: Any = types.float32) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == dtype and ty.ndim == 2 and ty.layout == "C"


def _index(context: Any, builder: ir.IRBuilder, value: ir.Value, ty: Any) -> ir.Value:
    return context.cast(builder, value, ty, types.intp)


def _vector_at(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, vec: Any) -> ir.Value:
    """The floats of one ``vec`` at ``base + offset`` as a pointer to it (no alignment assumed)."""
    return builder.bitcast(builder.gep(base, [offset]), vec.as_pointer())


def _plus(builder: ir.IRBuilder, value: ir.Value, constant: int) -> ir.Value:
    return builder.add(value, ir.Constant(value.type, constant))


def _tile_args(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> tuple[Any, ...]:
    """A tile's arguments (x, i, qt, g, out, t): the arrays x, qt, out, then i, g, t as intp."""
    types_ = signature.args
    arrays = [context.make_array(types_[a])(context, builder, args[a]) for a in (0, 2, 4)]
    starts = [_index(context, builder, args[a], types_[a]) for a in (1, 3, 5)]
    return (*arrays, *starts)


def _tile_intrinsic(rows: int, lanes: int = LANES) -> Any:
    """An intrinsic ``tile(x, i, qt, g, out, t)``: ``out[t + r, g : g + 16] = x[i + r] @ qt[:, g :
    g + 16]`` for r < ``rows``; x (N, D), qt (D, W), out (T, W), all float32 C-contiguous. Or, with
    x (N, D) and qt (D / 2, 2 W) uint16 bfloat16 bits, the same scores by :func:`_bf16_codegen`."""

    @intrinsic
    def tile(_typingctx: Any, x: Any, i: Any, qt: Any, g: Any, out: Any, t: Any) -> Any:
        bf16 = _is_matrix(x, types.uint16) and _is_matrix(qt, types.uint16)
        if not ((bf16 or (_is_matrix(x) and _is_matrix(qt))) and _is_matrix(out)):
            return None
        if not all(isinstance(v, types.Integer) for v in (i, g, t)):
            return None
        sig = types.void(x, i, qt, g, out, t)
        if bf16:
            return sig, functools.partial(_bf16_codegen, rows)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            xa, qa, oa, row0, col0, out0 = _tile_args(context, builder, signature, args)
            dim = builder.extract_value(xa.shape, 1)
            width = builder.extract_value(qa.shape, 1)
            out_width = builder.extract_value(oa.shape, 1)
            vec = ir.VectorType(_F32, lanes)
            parts = GROUP // lanes  # vectors of a tile row
            fmuladd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vec, [vec] * 3), f"llvm.fmuladd.v{lanes}f32"
            )
            splat = ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes)
            # accumulators as stack slots: LLVM's mem2reg keeps them in registers
            zero = ir.Constant(vec, [0.0] * lanes)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(parts * rows)]
            starts = [builder.mul(_plus(builder, row0, r), dim) for r in range(rows)]  # each row's offset
            with cgutils.for_range(builder, dim) as loop:
                c = loop.index
                at = builder.add(builder.mul(c, width), col0)  # qt[c, g]
                halves = [
                    builder.load(_vector_at(builder, qa.data, _plus(builder, at, h * lanes), vec), align=4)
                    for h in range(parts)
                ]
                for r in range(rows):
                    value = builder.load(builder.gep(xa.data, [builder.add(starts[r], c)]), align=4)
                    lane = builder.insert_element(ir.Constant(vec, None), value, ir.Constant(_I32, 0))
                    broadcast = builder.shuffle_vector(lane, ir.Constant(vec, None), splat)
                    for h, half in enumerate(halves):
                        slot = acc[parts * r + h]
                        builder.store(builder.call(fmuladd, [broadcast, half, builder.load(slot)]), slot)
            for r in range(rows):
                at = builder.add(builder.mul(_plus(builder, out0, r), out_width), col0)
                for h in range(parts):
                    to = _vector_at(builder, oa.data, _plus(builder, at, h * lanes), vec)
                    builder.store(builder.load(acc[parts * r + h]), to, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _bf16_codegen(rows: int, context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
    """A bfloat16 tile: per pair of dimensions, one 32-bit load of each row (its two bf16 values)
    broadcast to 16 lanes, and ``vdpbf16ps`` against the 16 queries' pairs into one 16-lane fp32
    accumulator per row (``rows`` of AVX-512's 32 registers)."""
    xa, qa, oa, row0, col0, out0 = _tile_args(context, builder, signature, args)
    two = ir.Constant(row0.type, 2)
    pairs = builder.udiv(builder.extract_value(xa.shape, 1), two)  # 32-bit words of a row
    width = builder.udiv(builder.extract_value(qa.shape, 1), two)  # 32-bit words of a qt row: W
    out_width = builder.extract_value(oa.shape, 1)
    floats, words = ir.VectorType(_F32, GROUP), ir.VectorType(_I32, GROUP)
    halves = ir.VectorType(_BFloat(), 2 * GROUP)
    dot = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(floats, [floats, halves, halves]),
        "llvm.x86.avx512bf16.dpbf16ps.512",
    )
    xw = builder.bitcast(xa.data, _I32.as_pointer())
    qw = builder.bitcast(qa.data, _I32.as_pointer())
    splat = ir.Constant(words, [0] * GROUP)
    acc = [cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * GROUP)) for _ in range(rows)]
    starts = [builder.mul(_plus(builder, row0, r), pairs) for r in range(rows)]
    with cgutils.for_range(builder, pairs) as loop:
        c = loop.index
        at = builder.add(builder.mul(c, width), col0)  # qt's pair c, queries g .. g + 16
        queries = builder.bitcast(builder.load(_vector_at(builder, qw, at, words), align=4), halves)
        for r in range(rows):
            pair = builder.load(builder.gep(xw, [builder.add(starts[r], c)]), align=4)
            lane = builder.insert_element(ir.Constant(words, None), pair, ir.Constant(_I32, 0))
            broadcast = builder.bitcast(builder.shuffle_vector(lane, ir.Constant(words, None), splat), halves)
            builder.store(builder.call(dot, [builder.load(acc[r]), broadcast, queries]), acc[r])
    for r in range(rows):
        at = builder.add(builder.mul(_plus(builder, out0, r), out_width), col0)
        builder.store(builder.load(acc[r]), _vector_at(builder, oa.data, at, floats), align=4)
    return context.get_dummy_value()


# 4 rows: 8 accumulators + 2 query vectors + 1 broadcast of AVX2's 16 registers; 6 rows: 12 + 2 + 1
score_tile4 = _tile_intrinsic(4)
score_tile6 = _tile_intrinsic(6)
score_row = _tile_intrinsic(1)
# 12 rows of one 16-lane vector each: 12 accumulators of AVX-512's 32 registers (on AVX2, LLVM would
# split them into 24 of its 16 registers and spill: use only where :func:`wide_vectors`)
score_tile12w = _tile_intrinsic(12, 2 * LANES)


def _compiles_for(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature`` (the host's, unless ``NUMBA_CPU_NAME`` /
    ``NUMBA_CPU_FEATURES`` name another target: then only if its features say so)."""
    features = getattr(numba.config, "CPU_FEATURES", None)  # (the stubs know neither setting)
    if features is None:
        if getattr(numba.config, "CPU_NAME", None) is not None:  # a named target, e.g. generic
            return False
        features = llvm.get_host_cpu_features().flatten()
    return f"+{feature}" in features.split(",")


@functools.cache
def wide_vectors() -> bool:
    """Whether numba compiles for a CPU with AVX-512 (:func:`_compiles_for`)."""
    return _compiles_for("avx512f")


@functools.cache
def bf16_tiles() -> bool:
    """Whether the tiles can take bfloat16 (numba compiles for AVX512-BF16: Zen 4, Cooper Lake,
    Sapphire Rapids and later). Elsewhere LLVM cannot select ``vdpbf16ps``: never call them so."""
    return _compiles_for("avx512bf16") and _compiles_for("avx512f")


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> the bits of the nearest bfloat16 (ties to even), uint16 of the same shape: the
    rounding torch's ``.to(torch.bfloat16)`` does for finite values."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def _prefetch_rows(_typingctx: Any, x: Any, i: Any, count: Any) -> Any:
    """Asks the CPU to start loading rows ``i .. i + count`` of ``x`` (N, D) float32 or uint16 (a
    hint: no fault, no result)."""
    if not (_is_matrix(x) or _is_matrix(x, types.uint16)):
        return None
    if not (isinstance(i, types.Integer) and isinstance(count, types.Integer)):
        return None
    sig = types.void(x, i, count)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        row0 = _index(context, builder, args[1], signature.args[1])
        dim = builder.extract_value(xa.shape, 1)
        start = builder.mul(row0, dim)
        count = builder.mul(dim, _index(context, builder, args[2], signature.args[2]))
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32]), "llvm.prefetch.p0i8"
        )
        read, keep_everywhere, data = (ir.Constant(_I32, v) for v in (0, 3, 1))
        line = ir.Constant(count.type, 512 // signature.args[0].dtype.bitwidth)  # a hint per 64-byte line
        with cgutils.for_range_slice(builder, ir.Constant(count.type, 0), count, line) as (offset, _):
            pointer = builder.bitcast(builder.gep(xa.data, [builder.add(start, offset)]), _I8P)
            builder.call(prefetch, [pointer, read, keep_everywhere, data])
        return context.get_dummy_value()

    return sig, codegen


prefetch_rows: Any = intrinsic(_prefetch_rows)
