"""Every kernel stage lowers and compiles for each architecture profile, without a GPU.

Checks the generated CUDA source for the instructions the schedule is built on: wgmma for
the tensor-core products (SM90; with register A operands in the wide walks), TMA loads for
the fused kernels' shared-memory rings, cp.async for kkt_solve's q and k (they arrive while
γ is summed) and for chunk_grads' tiles (they arrive under the first products), mma.sync in
tf32 for kkt_solve's inverse's merges, stmatrix.trans for every 16-bit tile the 64-column wide walks
stage (o, h, and the backward's dv and dS', counted per kernel) and ldmatrix.trans for the 64-column
backward walk's dO reads (inside its ring tile's wait and release), the narrow walks' state stores
waited for a chunk later and the narrow backward walk's wait_group 1, stmatrix and a TMA store in the
O-path walk's o staging (with its warpgroups' registers set by setmaxnreg),
and chunk_grads' batched reductions (and, in parts, its atomic count, the first part's sums
published by a release add and awaited by acquire loads); that no element-wise arithmetic runs
in 16 bits; that each block's shared memory fits the SM; that no kernel touches global memory
before its programmatic-launch wait; and that the kernels with large register tiles keep nothing
in local memory and no wgmma serialised (ptxas, through nvcc); and that the rings TileLang builds for the
walks are fed by the producer's warp 0 alone (launch.ring_trips).
Runs in CPU CI; nvcc must be on the PATH (TileLang calls it).
"""

import re
import shutil
import subprocess

import pytest

from flash_qla.arch import SM90
from flash_qla.ops.chunk_grads import chunk_grads_kernel
from flash_qla.ops.compose_maps import compose_maps_kernel
from flash_qla.ops.fused_bwd import fused_bwd_kernel
from flash_qla.ops.fused_bwd_wide import fused_bwd_wide_kernel
from flash_qla.ops.fused_fwd import fused_fwd_kernel
from flash_qla.ops.fused_fwd_opath import fused_fwd_opath_kernel
from flash_qla.ops.fused_fwd_wide import fused_fwd_wide_kernel
from flash_qla.ops.kkt_solve import kkt_solve_kernel

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile kernels")

TF32_MMA = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
SOLVE_CALL = "flash_qla_unit_lower_inverse<"

# (factory, static args, instructions its SM90 source must use)
KERNELS = [
    # the inverse's merges on the tensor cores: mma.sync in tf32
    ("kkt_solve", kkt_solve_kernel, (16, 32, 128, "bfloat16", SM90), ("wgmma", "cp_async_gs", TF32_MMA, SOLVE_CALL)),
    # β read in q's dtype (no cast launch)
    ("kkt_solve_beta_bf16", kkt_solve_kernel, (16, 32, 128, "bfloat16", SM90, "bfloat16"), ("wgmma", "cp_async_gs", TF32_MMA, SOLVE_CALL)),
    ("fused_fwd_bv32_h0_h", fused_fwd_kernel, (16, 32, 128, 128, 32, "bfloat16", SM90, True, True), ("wgmma", "tma_load")),
    ("fused_fwd_bv32_fp16", fused_fwd_kernel, (4, 8, 128, 128, 32, "float16", SM90, False, False), ("wgmma", "tma_load")),
    ("kkt_solve_backward_mode", kkt_solve_kernel, (16, 32, 128, "bfloat16", SM90, "float32", True), ("wgmma", "cp_async_gs")),
    ("fused_fwd_states_only", fused_fwd_kernel, (16, 32, 128, 128, 32, "bfloat16", SM90, True, True, True), ("wgmma", "tma_load")),
    ("fused_bwd_bv32_dht_dh0", fused_bwd_kernel, (16, 32, 128, 128, 32, "bfloat16", SM90, True, True), ("wgmma", "tma_load")),
    # V-tiles of 16 columns run one consumer warpgroup (small grids, e.g. 2/8 at one sequence)
    ("fused_fwd_bv16", fused_fwd_kernel, (2, 8, 128, 128, 16, "bfloat16", SM90, False, False), ("wgmma", "tma_load")),
    ("fused_bwd_bv16_dht", fused_bwd_kernel, (2, 8, 128, 128, 16, "bfloat16", SM90, True, False), ("wgmma", "tma_load")),
    # V-tiles of 64 and 128: the state transposed, every chain operand read by wgmma from registers
    ("fused_fwd_wide_bv64_h0_h", fused_fwd_wide_kernel, (16, 32, 128, 128, 64, "bfloat16", SM90, True, True), ("wgmma_rs", "tma_load", "flash_qla_stsm_x4_trans((")),
    ("fused_bwd_wide_bv64_dht", fused_bwd_wide_kernel, (2, 8, 128, 128, 64, "bfloat16", SM90, True, False), ("wgmma_rs", "tma_load")),
    ("fused_fwd_wide_h0_h", fused_fwd_wide_kernel, (16, 32, 128, 128, 128, "bfloat16", SM90, True, True), ("wgmma_rs", "tma_load")),
    ("fused_fwd_wide_fp16", fused_fwd_wide_kernel, (4, 8, 128, 128, 128, "float16", SM90, False, False), ("wgmma_rs", "tma_load")),
    ("fused_fwd_wide_states_only", fused_fwd_wide_kernel, (16, 32, 128, 128, 128, "bfloat16", SM90, True, True, True), ("wgmma_rs", "tma_load")),
    # a training forward keeping state checkpoints for the backward's recompute
    ("fused_fwd_bv16_checkpoints", fused_fwd_kernel, (2, 8, 128, 128, 16, "bfloat16", SM90, True, False, False, True), ("wgmma", "tma_load")),
    ("fused_fwd_wide_bv64_checkpoints", fused_fwd_wide_kernel, (2, 8, 128, 128, 64, "bfloat16", SM90, False, False, False, True), ("wgmma_rs", "tma_load")),
    ("fused_bwd_wide_dht_dh0", fused_bwd_wide_kernel, (16, 32, 128, 128, 128, "bfloat16", SM90, True, True), ("wgmma_rs", "tma_load")),
    ("fused_bwd_wide_fp16", fused_bwd_wide_kernel, (4, 8, 128, 128, 128, "float16", SM90, False, False), ("wgmma_rs", "tma_load")),
    # a training forward with keep_states: every state in the input dtype, beside o
    ("fused_fwd_keep_h", fused_fwd_kernel, (16, 32, 128, 128, 32, "bfloat16", SM90, True, True, False, False, False, True), ("wgmma", "tma_load")),
    ("fused_fwd_wide_keep_h", fused_fwd_wide_kernel, (16, 32, 128, 128, 128, "bfloat16", SM90, True, True, False, False, False, True), ("wgmma_rs", "tma_load")),
    # a split walk's pieces: M from I with V = 0 (MAPS), b from 0; no o, no h
    ("fused_fwd_maps", fused_fwd_kernel, (2, 8, 128, 128, 32, "bfloat16", SM90, False, False, True, False, True), ("wgmma", "tma_load")),
    # several short sequences a block (the inference forward over many of them): each chunk's row through the ring
    ("fused_fwd_wide_packed_h0", fused_fwd_wide_kernel, (2, 8, 128, 128, 128, "bfloat16", SM90, True, *(False,) * 5, None, True), ("wgmma_rs", "tma_load")),
    ("fused_fwd_wide_maps", fused_fwd_wide_kernel, (2, 8, 128, 128, 128, "bfloat16", SM90, False, False, True, False, True), ("wgmma_rs", "tma_load")),
    ("fused_fwd_offsets", fused_fwd_kernel, (2, 8, 128, 128, 32, "bfloat16", SM90, False, False, True), ("wgmma", "tma_load")),
    ("fused_fwd_wide_offsets", fused_fwd_wide_kernel, (2, 8, 128, 128, 128, "bfloat16", SM90, False, False, True), ("wgmma_rs", "tma_load")),
    # a split walk's composition of the pieces' maps, with and without an initial state (a ring of its own: D by TMA
    # only for the pieces whose map is not negligible)
    ("compose_maps", compose_maps_kernel, (8, 128, 128, SM90, False), ("wgmma", "tma_load", "warpgroup_reg_alloc")),
    ("compose_maps_s0", compose_maps_kernel, (8, 128, 128, SM90, True), ("wgmma", "tma_load", "warpgroup_reg_alloc")),
    # ... over an inference split's pieces of 64 chunks (flash_qla.ops.forward.split_piece_chunks)
    ("fused_fwd_wide_maps_64", fused_fwd_wide_kernel, (2, 8, 128, 128, 128, "bfloat16", SM90, False, False, True, False, True, False, 64), ("wgmma_rs", "tma_load")),
    ("fused_fwd_wide_offsets_64", fused_fwd_wide_kernel, (2, 8, 128, 128, 128, "bfloat16", SM90, False, False, True, False, False, False, 64), ("wgmma_rs", "tma_load")),
    ("compose_maps_64", compose_maps_kernel, (8, 128, 128, SM90, False, False, 64), ("wgmma", "tma_load", "warpgroup_reg_alloc")),
    # the split backward walk: the pieces' offsets (only dh0 written), the reverse composition
    ("fused_bwd_ends_only", fused_bwd_kernel, (2, 8, 128, 128, 32, "bfloat16", SM90, False, True, True), ("wgmma", "tma_load")),
    ("fused_bwd_wide_ends_only", fused_bwd_wide_kernel, (2, 8, 128, 128, 128, "bfloat16", SM90, False, True, True), ("wgmma_rs", "tma_load")),
    ("compose_maps_reverse", compose_maps_kernel, (8, 128, 128, SM90, False, True), ("wgmma", "tma_load", "warpgroup_reg_alloc")),
    ("compose_maps_reverse_dht", compose_maps_kernel, (8, 128, 128, SM90, True, True), ("wgmma", "tma_load", "warpgroup_reg_alloc")),
    # every tile by cp.async, waited for at its first use; dβ stored in β's dtype (bf16 here)
    ("chunk_grads", chunk_grads_kernel, (16, 32, 128, 128, "bfloat16", SM90, "bfloat16"), ("wgmma", "cp_async_gs")),
    # an item's v-heads in two parts: counted by an atomic; the first part's dq and dk sums published by a release
    # atomic, the second part waiting for them by acquire loads and adding them
    ("chunk_grads_parts", chunk_grads_kernel, (2, 8, 128, 128, "bfloat16", SM90, "bfloat16", 2), ("wgmma", "cp_async_gs", "AtomicAddRet", "AtomicLoad")),
    # an inference forward at 64 columns: kkt_solve without P (only K Kᵀ on wgmma), the walk with the O path on two
    # warpgroups of its own (registers moved by setmaxnreg; o, Sᵀ and v_newᵀ staged by stmatrix, Vᵀ read by ldmatrix;
    # o stored by TMA)
    ("kkt_solve_without_p", kkt_solve_kernel, (2, 8, 128, "bfloat16", SM90, "bfloat16", False, False, False), ("wgmma", "cp_async_gs", TF32_MMA, SOLVE_CALL)),
    # ... and over a split's pieces: kkt_solve without P but with the bounds the map and offsets walks skip by
    ("kkt_solve_without_p_bounds", kkt_solve_kernel, (16, 32, 128, "bfloat16", SM90, "float32", False, False, True), ("wgmma", "cp_async_gs", TF32_MMA, SOLVE_CALL, "log_norms[")),
    ("fused_fwd_opath", fused_fwd_opath_kernel, (2, 8, 128, 128, "bfloat16", SM90, False), ("wgmma_rs", "tma_load", "tma_store", "warpgroup_reg_alloc", "flash_qla_stsm_x4((", "flash_qla_ldsm_x4_trans((")),
    ("fused_fwd_opath_fp16_h0", fused_fwd_opath_kernel, (4, 8, 128, 128, "float16", SM90, True), ("wgmma_rs", "tma_load", "tma_store")),
]


@pytest.mark.parametrize("name,factory,args,instructions", KERNELS, ids=[k[0] for k in KERNELS])
def test_kernel_compiles_for_sm90(name, factory, args, instructions):
    source = factory(*args).get_kernel_source()
    for instruction in instructions:
        assert instruction in source, f"{name}: generated source has no {instruction}"


# the kernels whose threads hold large register tiles: every walk form and width, the chunk-parallel stages
NO_LOCAL_MEMORY = (
    "kkt_solve", "fused_fwd_bv32_h0_h", "fused_fwd_bv16", "fused_bwd_bv32_dht_dh0", "fused_bwd_bv16_dht",
    "fused_fwd_wide_bv64_h0_h", "fused_fwd_wide_h0_h", "fused_fwd_wide_states_only", "fused_bwd_wide_bv64_dht",
    "fused_bwd_wide_dht_dh0", "chunk_grads", "chunk_grads_parts", "fused_fwd_keep_h", "fused_fwd_wide_keep_h", "kkt_solve_without_p",
    "kkt_solve_without_p_bounds",
    "fused_fwd_opath", "fused_fwd_maps", "fused_fwd_wide_maps", "fused_fwd_offsets", "fused_fwd_wide_offsets",
    "fused_bwd_ends_only", "fused_bwd_wide_ends_only", "compose_maps", "compose_maps_reverse_dht",
    "fused_fwd_wide_maps_64", "fused_fwd_wide_offsets_64", "compose_maps_64",
    "fused_fwd_wide_packed_h0",
)  # fmt: skip


# ptxas's advisories that it made the kernel's wgmma wait where the code does not: a register an
# in-flight product reads or writes touched by other instructions (C7514, C7515: every wgmma
# serialised), or a wait injected before such a use (C7517); benchmark/NOTES.md v35 step 4
WGMMA_SERIALISED = re.compile(r"wgmma\.mma_async instructions are serialized|warpgroup\.wait is injected")


@pytest.mark.parametrize("name", NO_LOCAL_MEMORY)
def test_kernel_keeps_nothing_in_local_memory_and_wgmma_async(name, tmp_path):
    """ptxas gives the kernel no stack frame: values kept in local memory miss L1 beside the large
    shared-memory rings and wait on L2 (the wide backward walk kept 32 bytes there, reloaded every
    chunk; without them the backward at 16/32 8x4096 took 0.105 ms less, benchmark/NOTES.md v17).
    And ptxas keeps the kernel's wgmma as asynchronous as the code issues them (no serialisation
    advisory)."""
    from tilelang import env

    _, factory, args, _ = next(k for k in KERNELS if k[0] == name)
    source = tmp_path / f"{name}.cu"
    source.write_text(factory(*args).get_kernel_source())
    includes = [f"-I{env.TILELANG_TEMPLATE_PATH}", f"-I{env.CUTLASS_INCLUDE_DIR}"]
    command = ["nvcc", "--cubin", "-O3", f"-arch={SM90.arch}", "-std=c++20", *includes, "-Xptxas", "-v", str(source)]
    ptxas = subprocess.run(command + ["-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert ptxas.returncode == 0, ptxas.stderr[-2000:]
    frames = re.findall(r"(\d+) bytes stack frame", ptxas.stderr)
    assert frames and all(f == "0" for f in frames), re.findall(r"ptxas info.*", ptxas.stderr)
    assert not WGMMA_SERIALISED.search(ptxas.stderr), re.findall(r"ptxas info.*C75.*", ptxas.stderr)


# element-wise arithmetic in 16 bits: TileLang multiplies (adds) two bf16 / fp16 operands in their own precision
HALF_ARITHMETIC = re.compile(r"tl::(?:mul2|fma2|add2)\b|__h(?:mul|fma|add)")


@pytest.mark.parametrize("name,factory,args,instructions", KERNELS, ids=[k[0] for k in KERNELS])
def test_kernel_does_no_16_bit_arithmetic(name, factory, args, instructions):
    """Every element-wise product and sum runs in fp32; only tensor-core operands (and stored results) are rounded
    to the input dtype. chunk_grads' ⟨S, dS'⟩ once multiplied its two bf16 tiles uncast, in bf16 (benchmark/NOTES.md
    v61): every term rounded to 8 bits of mantissa before the fp32 sum."""
    found = HALF_ARITHMETIC.search(factory(*args).get_kernel_source())
    assert found is None, f"{name}: {found.group(0)} in the source"


def stores_h(source: str) -> bool:
    """Whether a walk's generated source writes h (fused_fwd by TMA, fused_fwd_wide from its staging tile)."""
    return "h_desc" in source or re.search(r"\bh\s*[\[+]", source) is not None


@pytest.mark.parametrize("factory,BV", [(fused_fwd_kernel, 32), (fused_fwd_wide_kernel, 128)])
def test_maps_walks_read_only_what_they_need(factory, BV):
    """The split walk's two map walks store no h; M's (MAPS) reads neither V nor h0: its identity
    start and zero V are the kernel's own. The backward's recompute (STORE_H) still stores h."""
    recompute = factory(2, 8, 128, 128, BV, "bfloat16", SM90, True, True, True).get_kernel_source()
    offsets = factory(2, 8, 128, 128, BV, "bfloat16", SM90, False, False, True).get_kernel_source()
    maps = factory(2, 8, 128, 128, BV, "bfloat16", SM90, False, False, True, False, True).get_kernel_source()
    assert stores_h(recompute) and not stores_h(offsets) and not stores_h(maps)
    assert "v_desc" in offsets and "v_desc" not in maps
    reads_h0 = re.compile(r"\bh0\s*[\[+]")
    assert reads_h0.search(recompute) and not reads_h0.search(maps)
    # the two map walks take their skips from kkt_solve's bounds (flash_qla.ops.negligible); no other walk reads them
    reads_bounds = re.compile(r"\blog_norms\s*\[")
    assert reads_bounds.search(offsets) and reads_bounds.search(maps) and not reads_bounds.search(recompute)


def test_walks_over_longer_pieces_sum_the_bounds_of_every_chunk():
    """Over pieces of 64 chunks (PIECE_CHUNKS) the map walk's and compose_maps' test of M (negligible.map_negligible)
    adds two chunks' bounds a lane, and the offsets walk's suffix sums run over 64 chunks: none is the kernel built
    for pieces of 32 (profile.checkpoint_chunks), and each reads the bounds."""
    walk = (2, 8, 128, 128, 128, "bfloat16", SM90, False, False, True)
    for short, long in [
        ((fused_fwd_wide_kernel, *walk, False, True), (fused_fwd_wide_kernel, *walk, False, True, False, 64)),
        ((fused_fwd_wide_kernel, *walk), (fused_fwd_wide_kernel, *walk, False, False, False, 64)),
        ((compose_maps_kernel, 8, 128, 128, SM90, False), (compose_maps_kernel, 8, 128, 128, SM90, False, False, 64)),
    ]:
        sources = [build(*args).get_kernel_source() for build, *args in (short, long)]
        assert sources[0] != sources[1] and all(re.search(r"\blog_norms\s*\[", source) for source in sources)


@pytest.mark.parametrize("factory,BV", [(fused_fwd_kernel, 32), (fused_fwd_wide_kernel, 128)])
def test_kept_states_are_stored_as_the_recompute_stores_them(factory, BV):
    """KEEP_H (a training forward with keep_states) stores h as the backward's recompute does, in the
    input dtype (fused_fwd by TMA from its S tile, fused_fwd_wide from its staging tile), and o
    beside it; STORE_H alone (the low-level forward's output_h) stores fp32."""

    def h_store(source):
        signature = source[source.index("__global__"):].split("{")[0]
        return "h_desc" in source, set(re.findall(r"(\w+)\* (?:__restrict__ )?h\b", signature))

    keep = factory(16, 32, 128, 128, BV, "bfloat16", SM90, True, True, False, False, False, True).get_kernel_source()
    recompute = factory(16, 32, 128, 128, BV, "bfloat16", SM90, True, True, True).get_kernel_source()
    output_h = factory(16, 32, 128, 128, BV, "bfloat16", SM90, True, True).get_kernel_source()
    assert h_store(keep) == h_store(recompute) != h_store(output_h)
    assert h_store(output_h)[1] == {"float"}
    writes_o = re.compile(r"\bo\s*[\[+]")
    assert writes_o.search(keep) and writes_o.search(output_h) and not writes_o.search(recompute)


@pytest.mark.parametrize(
    "factory,args,state",
    [
        (fused_fwd_wide_kernel, (True, True, True), "h"),  # the backward's recompute
        (fused_fwd_wide_kernel, (False, True, False, False, False, True), "h"),  # keep_states
        (fused_bwd_wide_kernel, (False, True), "dh"),
    ],
)
def test_wide_walks_store_states_by_tma(factory, args, state):
    """The wide walks' staged states go out by TMA bulk stores (staging.state_store), and each
    block waits for its last one before it ends."""
    source = factory(16, 32, 128, 128, 128, "bfloat16", SM90, *args).get_kernel_source()
    assert f"tma_store({state}_desc" in source
    assert not re.search(rf"\b{state}\s*\[", source)  # no element or vector store besides
    loop_end = source.rindex("tma_store(")
    assert "tma_store_wait" in source[loop_end:]


STSM_TRANS_CALL = "flash_qla_stsm_x4_trans(("  # a call site; the function's definition reads "(void*"


@pytest.mark.parametrize(
    "factory,args,calls",
    [
        (fused_bwd_wide_kernel, (64, "bfloat16", SM90, True, False), 2),  # dv and dS'
        (fused_bwd_wide_kernel, (64, "float16", SM90, False, True), 2),
        (fused_fwd_wide_kernel, (64, "bfloat16", SM90, False, True, True), 1),  # the recompute's h
        # o (in the walk, and the last chunk's after it) and the kept h
        (fused_fwd_wide_kernel, (64, "bfloat16", SM90, True, True, False, False, False, True), 3),
        (fused_bwd_wide_kernel, (64, "bfloat16", SM90, False, True, True), 0),  # ENDS_ONLY: nothing staged
        (fused_bwd_wide_kernel, (128, "bfloat16", SM90, True, False), 0),  # two warpgroups: 2-byte stores
    ],
)
def test_wide_walks_stage_16_bit_tiles_by_stmatrix(factory, args, calls):
    """At one warpgroup (64 columns) every 16-bit tile the wide walks stage for a store goes through
    stmatrix.x4.trans (staging.stage_transposed, state_store): the backward walk's dv (rounded first)
    and dS', the forward's o and its kept or recomputed h; none at two warpgroups. Counted as call sites
    in the generated source (each a loop of R / 16 instructions)."""
    source = factory(2, 8, 128, 128, *args).get_kernel_source()
    assert source.count(STSM_TRANS_CALL) == calls


LDSM_TRANS_CALL = "flash_qla_ldsm_x4_trans(("


@pytest.mark.parametrize(
    "args,calls",
    [
        ((64, "bfloat16", SM90, True, False), 2),  # dOᵀ twice: scaled, then gated
        ((64, "float16", SM90, False, True), 2),
        ((64, "bfloat16", SM90, False, True, True), 2),  # ENDS_ONLY reads dO all the same
        ((128, "bfloat16", SM90, True, False), 0),  # two warpgroups: 2-byte loads
    ],
)
def test_wide_backward_walk_reads_do_by_ldmatrix(args, calls):
    """At one warpgroup the backward walk reads dOᵀ from its ring tile by ldmatrix.x4.trans
    (staging.load_transposed), twice a chunk; TileLang's warp specialization must still
    see the read: the tile's wait comes before the first call and its release after the last."""
    source = fused_bwd_wide_kernel(2, 8, 128, 128, *args).get_kernel_source()
    assert source.count(LDSM_TRANS_CALL) == calls
    if calls:
        # the producer's dO stage: wait on its empty barrier, expect bytes on its full one, TMA into do_s
        empty, full = re.search(
            r"mbarrier\[\(\(r & 1\) \+ (\d+)\)\]\.wait\([^;]*\);\s*if \(tl::tl_shuffle_elect<128>\(\)\) \{\s*"
            r"mbarrier\[\(\(r & 1\) \+ (\d+)\)\]\.arrive_and_expect_tx\(\d+\);\s*tl::tma_load\(do_desc",
            source,
        ).groups()
        consumer = source[source.index("tl::warpgroup_reg_alloc") :]
        wait = consumer.index(f"mbarrier[((r_1 & 1) + {full})].wait")
        release = consumer.index(f"mbarrier[((r_1 & 1) + {empty})].arrive()")
        assert wait < consumer.index(LDSM_TRANS_CALL)
        assert consumer.rindex(LDSM_TRANS_CALL) < release


@pytest.mark.parametrize(
    "factory,args,desc",
    [
        # the configs of KERNELS (compiled once a process)
        (fused_bwd_kernel, (16, 32, 128, 128, 32, "bfloat16", SM90, True, True), "dh_desc"),
        (fused_bwd_kernel, (2, 8, 128, 128, 16, "bfloat16", SM90, True, False), "dh_desc"),
        (fused_fwd_kernel, (16, 32, 128, 128, 32, "bfloat16", SM90, True, True, True), "h_desc"),  # the recompute's
        (fused_fwd_kernel, (16, 32, 128, 128, 32, "bfloat16", SM90, True, True, False, False, False, True), "h_desc"),
    ],
)
def test_narrow_walks_wait_for_their_state_store_a_chunk_later(factory, args, desc):
    """The narrow walks store dh (h) from the operand tile by TMA and wait for the store's read of it
    only before the next chunk's staging: a product is issued between the store and its wait."""
    source = factory(*args).get_kernel_source()
    store = source.index(f"tl::tma_store({desc}")
    assert "tma_store_wait" in source[:store]  # the wait before the staging, at the loop's top
    assert source.index("wgmma_ss", store) < source.index("tma_store_wait", store)


NARROW_BWD_ARGS = [  # the configs of KERNELS
    (16, 32, 128, 128, 32, "bfloat16", SM90, True, True),
    (2, 8, 128, 128, 16, "bfloat16", SM90, True, False),
    (2, 8, 128, 128, 32, "bfloat16", SM90, False, True, True),  # ENDS_ONLY
]


@pytest.mark.parametrize("args", NARROW_BWD_ARGS)
def test_narrow_backward_walk_waits_for_dv_product_alone(args):
    """fused_bwd issues Qᵀ dO behind Aᵀ dv_new and waits for the latter alone (wgmma.wait_group 1),
    then once for everything after Kᵀ dv: three waits a chunk in all."""
    source = fused_bwd_kernel(*args).get_kernel_source()
    loop = source[source.index("tl::warpgroup_reg_alloc") :]
    assert re.findall(r"wait_wgmma<(\d)>", loop) == ["0", "1", "0"]


# a wgmma shared-memory operand's tile, in the order the products are issued
WGMMA_B_TILE = re.compile(r"initialize_wgmma_descriptor<[^>]*>\(desc_b\w*, \(&\(\(\(\w+\*\)(\w+)\)\[0\]\)\)\)")


@pytest.mark.parametrize("args", NARROW_BWD_ARGS)
def test_narrow_backward_walk_reads_do_as_loaded(args):
    """Pᵀ dO takes dO's ring tile as it arrived for its B operand (the scale goes on the fp32 product): the
    walk's shared B operands are dS', dO, dv_new, diag(scale · e^γ) dO and −diag(e^γ) dv, one staged copy of
    dO a chunk."""
    source = fused_bwd_kernel(*args).get_kernel_source()
    assert WGMMA_B_TILE.findall(source) == ["ds_s", "do_s", "dvn_s", "doe_s", "due_s"]


@pytest.mark.parametrize("args", [
    (16, 32, 128, 128, 32, "bfloat16", SM90, True, True, False, False, False, True),  # KEEP_H
    (2, 8, 128, 128, 16, "bfloat16", SM90, False, False),
])  # fmt: skip
def test_narrow_forward_walk_stages_v_new_with_its_decayed_copy(args):
    """v_new's tile (P v_new's operand) is stored from the loop that stages diag(e^{γ_L − γ}) v_new (the update's),
    not by a stmatrix copy of its own, which took a consumer barrier of its own: stmatrix stages S alone."""
    source = fused_fwd_kernel(*args).get_kernel_source()
    assert source.count("ptx_stmatrix") == 1
    vd_store = source.index("(bfloat16_t*)vd_s) + ")
    vn_store = source.index("(bfloat16_t*)vn_s) + ", vd_store)
    assert "__sync_thread_partial" not in source[vd_store:vn_store]


@pytest.mark.parametrize("args", NARROW_BWD_ARGS)
def test_narrow_backward_walk_zeroing_holds_its_barriers(args):
    """The last-chunk zeroing of dO's, P's and k's rows holds its two barriers (a named barrier of the consumer's
    own), so TileLang's sync pass adds none before and after it on every chunk: 8 consumer-wide barriers a
    chunk (7 when ENDS_ONLY, which stages no dv), where 10 were."""
    source = fused_bwd_kernel(*args).get_kernel_source()
    barriers = re.findall(r"__sync_thread_partial\(([^;]*)\);", source)
    assert barriers.count("4, 128") == 2
    assert barriers.count("3, 128") == (7 if len(args) > 9 and args[9] else 8)


@pytest.mark.parametrize("BV", [64, 128])
def test_wide_backward_walk_reads_do_as_loaded(BV):
    """dOᵀ, the register A operand of dOᵀ P, is dO as loaded (by ldmatrix at 64 columns, element copies at 128),
    masked past a sequence's end in the input dtype: never widened to fp32, scaled and rounded back (the scale
    goes on the fp32 product)."""
    source = fused_bwd_wide_kernel(16, 32, 128, 128, BV, "bfloat16", SM90, True, False).get_kernel_source()
    assert "DOm[" in source
    assert re.search(r"\(float\)DOm\[", source) is None
    assert re.search(r"DOm\[\w+\] = \(\(bfloat16_t\)\w", source) is None


@pytest.mark.parametrize(
    "args", [(16, 32, 128, 128, 32, "bfloat16", SM90, True, True), (2, 8, 128, 128, 16, "bfloat16", SM90, False, False)]
)
def test_narrow_forward_walk_zeroes_k_rows_past_the_end(args):
    """On a sequence's last chunk the narrow forward walk zeroes the k tile's rows past its end after K S (so that
    nothing of the next sequence's rows, not even an Inf or NaN, reaches the state update's Kᵀ); the rows of
    V − diag(e^γ) K S and v_new there are selected to 0, not stored. Without the zeroing only the GPU's
    isolation tests would go red."""
    source = fused_fwd_kernel(*args).get_kernel_source()
    zeroed = re.findall(r"\*\(uint4\*\)\(\(\(bfloat16_t\*\)(\w+)\) \+ [^;]*\) = make_uint4", source)
    assert zeroed == ["k_s"], zeroed


@pytest.mark.parametrize("states_only", [False, True])
def test_fused_fwd_wide_chains_share_no_barrier(states_only):
    """The wide walk's consumer warpgroups never wait for each other: its only named barriers (the
    staging of o, or of h in the recompute, and on a sequence's last chunk the zeroing of k's rows past
    its end) count one warpgroup's threads, and TileLang adds no block-wide barrier of its own."""
    source = fused_fwd_wide_kernel(16, 32, 128, 128, 128, "bfloat16", SM90, True, True, states_only).get_kernel_source()
    barriers = re.findall(r"__sync_thread_partial\(([^;]*)\);", source)
    assert all(b.endswith(", 128") for b in barriers), barriers
    # before and after the staging: o's in and after the loop, h's in the loop; before and after the zeroing
    assert len(barriers) == (2 if states_only else 4) + 2
    assert source.count("__syncthreads()") == 1  # after the ring's mbarrier init


def test_opath_walk_roles_meet_at_mbarriers_only():
    """fused_fwd_opath's loads, chain and two O warpgroups hand tiles over by mbarriers: the only named
    barriers are the O warpgroups' own around o's staging (ids 10, 11; TileLang's sync pass is off for
    this kernel), and the only block-wide one follows the mbarriers' init. The rows past a sequence's end
    are zeroed by the loading warp (k's, v's and A's, behind an mbarrier of their own), before it hands the
    slot over, not by a consumer. kkt_solve without P takes and reads neither q nor P, with the bounds (over a
    split's pieces) nor them either, and then writes log_norms."""
    source = fused_fwd_opath_kernel(2, 8, 128, 128, "bfloat16", SM90, False).get_kernel_source()
    barriers = re.findall(r"__sync_thread_partial\(([^;]*)\);", source)
    assert barriers == ["10, 128"] * 2 + ["11, 128"] * 2, barriers
    assert source.count("__syncthreads()") == 1
    loads = source[source.index("warpgroup_reg_dealloc<24>"):source.index("warpgroup_reg_dealloc<120>")]
    zeroed = re.findall(r"\*\(uint4\*\)\(\(\(bfloat16_t\*\)(\w+)\) \+ [^;]*\) = make_uint4", loads)
    assert zeroed == ["k_s", "v_s", "a_s"], zeroed
    assert loads.index("last[0].wait(0)") < loads.index("fence_proxy_async") < loads.rindex("full[(c % 3)].arrive()")
    consumers = source[source.index("warpgroup_reg_dealloc<120>"):]
    assert "make_uint4" not in consumers
    for bounds in (False, True):
        kkt = kkt_solve_kernel(2, 8, 128, "bfloat16", SM90, "bfloat16", False, False, bounds).get_kernel_source()
        signature = kkt[kkt.index("__global__"):].split("{")[0]
        assert not re.search(r"\b[qP]\b", signature), signature
        body = kkt[kkt.index("__global__ void __launch_bounds__"):]
        assert bool(re.search(r"\blog_norms\[[^\]]*\] = ", body)) == bounds


@pytest.mark.parametrize("form_p,bounds", [(True, True), (False, False), (False, True)], ids=["P", "noP", "noP_bounds"])
def test_kkt_solve_call_sits_between_barriers(form_p, bounds):
    """The solve (SOLVE's device function) writes M's buffer in place, but TileLang's barrier pass is told it only
    reads it (flash_qla.ops.kkt_solve): a __syncthreads must stand after the kernel's last store to x_s before the
    call, and after the call before A's read-out loads x_s."""
    source = kkt_solve_kernel(2, 8, 128, "bfloat16", SM90, "bfloat16", False, form_p, bounds).get_kernel_source()
    body = source[source.index("__global__ void __launch_bounds__"):]
    call = body.index(SOLVE_CALL)
    stores = [m.start() for m in re.finditer(r"\(\(float\*\)x_s\)(\[[^;]*\]|[^;]*\)\)) = ", body[:call])]
    assert stores and body.rindex("__syncthreads();", 0, call) > stores[-1]
    after = body[body.index("\n", call):]  # past the call
    assert after.index("__syncthreads();") < after.index("(float*)x_s)")


def test_kkt_backward_mode_writes_the_bounds_and_no_inverse():
    """kkt_solve's backward mode forms log_norms (the low-level backward's split walks skip by them) from
    β and K Kᵀ's diagonal, and neither solves (no tf32 merges) nor writes A or g_cum; without BOUNDS
    (a backward that does not split) it reads no β and writes no log_norms."""
    source = kkt_solve_kernel(2, 8, 128, "bfloat16", SM90, "bfloat16", True).get_kernel_source()
    body = source[source.index("__global__ void __launch_bounds__"):]
    assert re.search(r"\blog_norms\[[^\]]*\] = ", body) and re.search(r"= beta\[", body)
    assert TF32_MMA not in source and SOLVE_CALL not in body
    assert not re.search(r"\b(A|g_cum)\[[^\]]*\] = ", body)
    without = kkt_solve_kernel(2, 8, 128, "bfloat16", SM90, "float32", True, True, False).get_kernel_source()
    body = without[without.index("__global__ void __launch_bounds__"):]
    assert not re.search(r"\blog_norms\[[^\]]*\] = ", body) and not re.search(r"= beta\[", body)


@pytest.mark.parametrize("ends_only", [False, True])
def test_fused_bwd_wide_chains_share_no_barrier(ends_only):
    """As the wide forward: the backward walk's warpgroups meet at no barrier (the stagings of dh
    and dv, and on a sequence's last chunk the zeroings of P's, k's, A's and q's rows past its end,
    synchronise one warpgroup's threads; the walk keeping only its end stages none)."""
    source = fused_bwd_wide_kernel(16, 32, 128, 128, 128, "bfloat16", SM90, False, True, ends_only).get_kernel_source()
    barriers = re.findall(r"__sync_thread_partial\(([^;]*)\);", source)
    assert all(b.endswith(", 128") for b in barriers), barriers
    # before and after each of the two stagings and of the zeroings (p and k together, a, q)
    assert len(barriers) == (0 if ends_only else 4) + 2 * 4
    assert source.count("__syncthreads()") == 1  # after the ring's mbarrier init


@pytest.mark.parametrize("factory,BV", [(fused_bwd_kernel, 32), (fused_bwd_wide_kernel, 128)])
def test_ends_only_backward_walks_store_only_dh0(factory, BV):
    """The split backward's offsets walk (ENDS_ONLY) writes dh0 and none of dh, dv."""
    full = factory(2, 8, 128, 128, BV, "bfloat16", SM90, False, True).get_kernel_source()
    ends = factory(2, 8, 128, 128, BV, "bfloat16", SM90, False, True, True).get_kernel_source()
    for name in ("dh", "dv", "dh0"):
        # by TMA (fused_bwd's dh) or element and vector stores
        def writes(source, name=name):
            return f"{name}_desc" in source or re.search(rf"\b{name}\s*[\[+]", source) is not None

        assert writes(full), name
        assert writes(ends) == (name == "dh0"), name
    # the end walk takes its skip from kkt_solve's bounds (flash_qla.ops.negligible), the full walk none
    reads_bounds = re.compile(r"\blog_norms\s*\[")
    assert reads_bounds.search(ends) and not reads_bounds.search(full)


# the last integer argument of each TVM-FFI call in a kernel's host code; the kernel launch's
# is its dynamic shared memory (the largest of them)
LAUNCH_TAIL = re.compile(r"v_int64\) = \(\(int64_t\)(\d+)\);\s*\(\(\(TVMFFIAny\*\)stack_ffi_any\)\[\d+\]\.type_index\) = 0;")
# a kernel's static shared arrays (TileLang's mbarriers, chunk_grads' fp32 vectors) and the
# alignment of its dynamic buffer: ptxas pads the static ones to that alignment ("1024 bytes
# smem" for 12 or 24 mbarriers), and they count against the same per-block limit
STATIC_SHARED = re.compile(r"^\s*__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+\w+\[(\d+)\];", re.MULTILINE)
DYNAMIC_ALIGN = re.compile(r"extern __shared__ __align__\((\d+)\)")
SHARED_TYPE_BYTES = {"uint64_t": 8, "float": 4, "int": 4}


def shared_memory_bytes(kernel):
    """A block's shared memory: its static arrays, padded to the dynamic buffer's alignment, and
    the dynamic buffer its launch asks for."""
    launch_args = [int(x) for x in LAUNCH_TAIL.findall(kernel.get_host_source())]
    assert launch_args, "no kernel launch found in the host code"
    source = kernel.get_kernel_source()
    static = 0
    for dtype, count in STATIC_SHARED.findall(source):
        assert dtype in SHARED_TYPE_BYTES, f"static shared array of unknown element type {dtype}"
        static += SHARED_TYPE_BYTES[dtype] * int(count)
    align = max([int(a) for a in DYNAMIC_ALIGN.findall(source)] + [1])
    return -(-static // align) * align + max(launch_args)


def test_shared_memory_counts_static_arrays_padded():
    """The count that explains a launch that failed on the H200 (benchmark/NOTES.md v34): 231 936
    dynamic bytes beside 12 mbarriers (96 bytes; ptxas: "1024 bytes smem"), 232 032 bytes summed
    as they are, under the 227 KB limit, and 232 960 with the static ones padded, over it."""
    mbarriers = "".join(f"  __shared__ __align__(16) uint64_t {name}_mem[{n}];\n" for name, n in
                        (("full", 3), ("empty", 3), ("sfull", 2), ("sempty", 2), ("vfull", 1), ("vempty", 1)))

    class Kernel:
        def get_host_source(self):
            return "(((TVMFFIAny*)stack_ffi_any)[9].v_int64) = ((int64_t)231936); (((TVMFFIAny*)stack_ffi_any)[9].type_index) = 0;"

        def get_kernel_source(self):
            return "  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];\n" + mbarriers

    assert shared_memory_bytes(Kernel()) == 1024 + 231936 > SM90.max_shared_memory >= 96 + 231936


@pytest.mark.parametrize("name,factory,args,instructions", KERNELS, ids=[k[0] for k in KERNELS])
def test_kernel_fits_shared_memory(name, factory, args, instructions):
    """A block's shared memory, static and dynamic, fits the architecture's limit: over it, only
    the launch on the GPU fails ("Failed to set the allowed dynamic shared memory size")."""
    used = shared_memory_bytes(factory(*args))
    assert 0 < used <= SM90.max_shared_memory, f"{name}: {used} bytes of shared memory"


# kernel pointer parameters (TMA descriptors are kernel parameters, not memory another kernel writes)
POINTER_PARAM = re.compile(r"\b(?:const )?\w+\* (?:__restrict__ )?(\w+)[,)]")
# the narrow walks start without follow_previous_kernel (flash_qla.ops.fused_fwd says why)
WITHOUT_EARLY_LAUNCH = (fused_fwd_kernel, fused_bwd_kernel)


@pytest.mark.parametrize("name,factory,args,instructions", KERNELS, ids=[k[0] for k in KERNELS])
def test_kernel_waits_for_the_previous_one_before_touching_memory(name, factory, args, instructions):
    """Programmatic dependent launch (flash_qla.ops.launch): a kernel may start while the previous one
    on the stream still runs, so no global load, store or copy of it may come before its grid-dependency
    wait; and it lets the next kernel launch early. The narrow walks do neither."""
    source = factory(*args).get_kernel_source()
    definition = source.rindex('extern "C" __global__')
    body = source.index("{", definition)
    if factory in WITHOUT_EARLY_LAUNCH:
        assert "cudaGridDependencySynchronize" not in source and "cudaTriggerProgrammatic" not in source
        return
    wait = source.index("cudaGridDependencySynchronize();", body)
    assert "cudaTriggerProgrammaticLaunchCompletion();" in source[wait:]
    before = source[body:wait]
    pointers = POINTER_PARAM.findall(source[definition:body])
    assert pointers, f"{name}: no pointer parameters found"
    touched = [p for p in pointers if re.search(rf"\b{p}\s*[\[+]", before)]  # p[i] or *(vector*)(p + i)
    assert not touched, f"{name}: {touched} accessed before the wait"
    for copy in ("tma_load", "tma_store", "cp_async", "tl::ld", "tl::st"):
        assert copy not in before, f"{name}: {copy} before the wait"


def test_chunk_grads_barriers():
    """chunk_grads' reductions stay inside a warp (no exchange between warps through shared memory,
    whose barriers each stalled the block's 8 warps) and the kernel keeps its 8 block-wide barriers,
    all placed by hand (compiled without TileLang's thread-storage sync): 7 a v-head, 1 where an item's
    dq and dk are staged (benchmark/NOTES.md v27: 48 a v-head cost ~5 % of a training step; v87), and
    one more in each of the three branches that zero, on a sequence's last chunk, the tiles' rows past
    its end."""
    source = chunk_grads_kernel(16, 32, 128, 128, "bfloat16", SM90, "bfloat16").get_kernel_source()
    reductions = re.findall(r"AllReduce<tl::SumOp, (\d+),", source)
    assert reductions and all(int(threads) <= 32 for threads in reductions), reductions
    outside = without_blocks(source, "if (valid < 64) {")
    assert outside.count("__syncthreads()") == 8
    assert source.count("__syncthreads()") - outside.count("__syncthreads()") == 3


def braced_block(source: str, start: int) -> str:
    """The text of source from start through the brace that closes the first one opened after start."""
    depth, i = 0, source.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return source[start : i + 1]
        i += 1


def without_blocks(source, opening):
    """source without the blocks that open with `opening` (up to the brace that closes each)."""
    while opening in source:
        start = source.index(opening)
        source = source[:start] + source[start + len(braced_block(source, start)):]
    return source


def test_a_kernel_asked_for_in_any_spelling_is_built_once():
    """The factories key on the configuration, not on how the call spells it (flash_qla.ops.launch.kernel_factory):
    flags by position, by keyword or left to their defaults give the one kernel, built once."""
    before = compose_maps_kernel.cache_info().misses
    kernel = compose_maps_kernel(8, 128, 128, SM90, False)
    assert compose_maps_kernel(8, 128, 128, SM90, HAS_S0=False) is kernel
    assert compose_maps_kernel(8, 128, 128, SM90, False, False) is kernel
    assert compose_maps_kernel(Hv=8, K=128, V=128, profile=SM90, HAS_S0=False, REVERSE=False) is kernel
    assert compose_maps_kernel(8, 128, 128, SM90, False, True) is not kernel
    assert compose_maps_kernel.cache_info().misses - before <= 2  # this test's two configurations, at most
    with pytest.raises(TypeError):
        compose_maps_kernel(8, 128, 128, SM90, False, REVERSE=False, UNKNOWN=True)


# the walks whose ring TileLang's warp specialization builds from a T.Pipelined loop (fused_fwd_opath's is its own)
AUTO_RING = (fused_fwd_kernel, fused_fwd_wide_kernel, fused_bwd_kernel, fused_bwd_wide_kernel)
PRODUCER_BRANCH = "if (((int)threadIdx.x) < 128) {"
# the ring loop's bound, launch.ring_trips' count bound before it (T.bind: `int v = ...;`), and that count: 0 for
# warps 1-3 (the warp as cutlass::canonical_warp_idx_sync computes it)
RING_LOOP = re.compile(r"int (\w+) = flash_qla_ring_trips\(.*\);\s*for \(int (\w+) = 0; \2 < \1; \+\+\2\) \{")
RING_TRIPS = re.compile(
    r"int flash_qla_ring_trips\(int n\) \{\s*int warp = __shfl_sync\(0xffffffff, threadIdx\.x / 32, 0\);.*\s*"
    r"return warp >= 1 && warp < 4 \? 0 : n;\s*\}"
)
ELECTED_ARRIVE = re.compile(r"tl::tl_shuffle_elect<128>\(\)\) \{\s*mbarrier\[[^\]]*\]\.arrive")


@pytest.mark.parametrize(
    "name,factory,args", [k[:3] for k in KERNELS if k[1] in AUTO_RING], ids=[k[0] for k in KERNELS if k[1] in AUTO_RING]
)
def test_ring_is_fed_by_one_producer_warp(name, factory, args):
    """The producer warpgroup's warps 1-3 skip the ring loop (launch.ring_trips); warp 0 alone waits for each stage to
    be free and, by its elected thread, loads it and arrives on its full barrier. When every producer thread ran the
    loop, the stage waits of warps 1-3 guarded nothing, and one that came to a stage after the consumers had freed it
    again waited for a phase that never came (the split forward's hang with a lead, benchmark/NOTES.md v107). With
    warps 1-3 gone, the producer branch must hold no arrive but the elected thread's and no barrier they would miss."""
    source = factory(*args).get_kernel_source()
    producer = braced_block(source, source.index(PRODUCER_BRANCH))
    first_wait = producer.index(".wait(")
    assert RING_LOOP.search(producer[:first_wait]) and RING_TRIPS.search(source), f"{name}: warps 1-3 wait"
    assert producer.count(".arrive") == len(ELECTED_ARRIVE.findall(producer)), name
    assert "__syncthreads" not in producer and "__sync_thread_partial" not in producer, name
