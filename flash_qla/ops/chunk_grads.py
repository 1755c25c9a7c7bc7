"""Chunk-parallel gradients: dq, dk, dβ and dg of every chunk, from the two state walks.

Computes, for every chunk of 64 tokens and v-head h (dq and dk summed over the v-heads
of a qk-head), with S the forward state at the chunk's start (fused_fwd), dS' the
gradient of the state after it and dU = dv (fused_bwd), γ = g_cum, e^γ and e^{γ_L − γ}
zero past the sequence's end, Γ_ij = e^{γ_i − γ_j} on and below the diagonal of the valid
rows, 0 elsewhere:

    U  = V − diag(e^γ) K S,   v_new = A U                        (recomputed, [C, V])
    N  = K Kᵀ ⊙ Γ ⊙ StrictLower,  P = Q Kᵀ ⊙ Γ                   [C, C]
    dP = scale · dO v_newᵀ ⊙ Lower,  dN = −dU v_newᵀ ⊙ StrictLower
    dq = scale · diag(e^γ) dO Sᵀ + (dP ⊙ Γ) K
    dk = (dP ⊙ Γ)ᵀ Q + (dN ⊙ Γ) K + (dN ⊙ Γ)ᵀ K
         − diag(e^γ) dU Sᵀ + diag(e^{γ_L − γ}) v_new dS'ᵀ
    dβ = rowsum(dU ⊙ v_new) / β²                                  (β_i = A_ii)
       = rowsum((dv_new − Nᵀ dU) ⊙ W),  W = U − N v_new,          (a chunk with a valid |β| < BETA_MIN)
         dv_new = scale · Pᵀ dO + diag(e^{γ_L − γ}) K dS'
    dγ = e^γ ⊙ rowsum(scale · dO ⊙ Q S − dU ⊙ K S) − e^{γ_L − γ} ⊙ rowsum(v_new ⊙ K dS')
         + rowsum(R) − colsum(R),  R = dP ⊙ P + dN ⊙ N,
         + at the last valid token: e^{γ_L} ⟨S, dS'⟩ + Σ_i e^{γ_L − γ_i} ⟨v_new_i, (K dS')_i⟩
    dg = reverse cumsum of dγ over the chunk

flash_qla/reference/backward_stages.py derives these and checks them against autograd.
dβ needs no inverse again: A = diag(β) (I + N diag(β))⁻¹, so the gradient of N is −dU v_newᵀ,
(I + N diag(β))⁻¹ U = U − N v_new = W, v_new = diag(β) W, and dv_new − Nᵀ dU = diag(β)⁻¹ dU: dβ is
the quotient rowsum(dU ⊙ v_new) / β², summed from v_new's fp32 accumulator as v_new is stored, with
β read from A's diagonal (A_ii = β_i in the input dtype: exact for β in q's dtype; fp32 β rounded as
every entry of A is). A chunk whose valid tokens include a |β| < BETA_MIN (β = 0 makes the quotient
0 / 0; the threshold's reason is in backward_stages) takes the products instead: N v_new, Pᵀ dO and
Nᵀ dU, three [C, C] x [C, V] products a v-head, with U as A U reads it and dv_new's K dS' term (both
rounded to the input dtype, the latter as the walk's stored dv_new was) kept in tiles; they run after
dq and dk's products, where their accumulators cost ptxas no registers (under a branch in the place
the products had before, they took ptxas to 255 registers and a stack; now 223, none).
The quotient reads dU row by row as the walk stored it (rounded to the input dtype), where the
products read it only through Nᵀ dU: against the fp32 reference its dβ is 15-55 % further off
(relative L2, bf16: 16/32 8x4096 3.26e-3 -> 4.31e-3, strong gates 2.37e-3 -> 3.70e-3, the largest,
2/8 1x32768 weak gates, 4.08e-3 -> 4.78e-3), under half the 1e-2 bar; the other gradients are
bitwise the same. Training step, H200, one process, interleaved: 16/32 1x32768 2771 -> 2726 µs,
8x4096 2436 -> 2394, 2/8 8x4096 650 -> 635 (benchmark/NOTES.md v51).

Precision: every reduction (dγ, dβ, ⟨S, dS'⟩) sums in fp32; only the operands of the
tensor-core products are rounded to the input dtype (S and dS' arrive rounded so). dq and
dk of a qk-head sum over its v-heads in fp32 registers in a fixed order (deterministic,
no atomics on them; in two parts, below, the two parts' fp32 sums are added, the same bits in
either order) and are rounded once when stored. Rows past the sequence's end (last chunk)
hold the next sequence's data and meet only zero factors (e^γ, e^{γ_L − γ}, Γ, the zero upper
triangle of A); the tiles are copied unmasked, and on a sequence's last chunk the rows past its
end of A, q, k, V, dO and dU are zeroed once they arrive (staging.zero_rows_past, in branches
with barriers of their own), so that an Inf or NaN there does not survive its zero factor.

Inputs (packed varlen, T tokens in all;
the token-major tensors, outputs too, passed packed, [1, T, ...], and read as the [T, ...] shown: launch.token_major):
    q, k       [T, Hqk, K]   input dtype
    v, do      [T, Hv, V]    input dtype
    dv         [T, Hv, V]    input dtype (fused_bwd)
    A          [T, Hv, C]    input dtype (forward)
    gamma      [Hv, slots, C] fp32 γ chunk-major (kkt_solve)
    h, dh      [slots, Hv, K, V] input dtype: S and dS' of every chunk (slot = global chunk
               index), as the tensor-core products read them
    chunk_table [slots, 2] int32: (first token, tokens) of each global chunk
               (flash_qla.ops.chunks; 0 tokens past the last chunk)
Outputs (then scale, float; slots, int; blocks, int, the persistent blocks launched: the last arguments):
    dq, dk     [T, Hqk, K]   input dtype
    dbeta      [T, Hv]       beta_dtype: β's when it has q's dtype, fp32 otherwise (rounded
               once, from the fp32 sum, where it is stored: bitwise what a conversion kernel after
               gave, one launch and a [T, Hv] fp32 buffer less; training step 2/8 8x4096 665.6 ->
               663.9 µs, 16/32 1x2048 264.5 -> 260.3; benchmark/NOTES.md v41)
    dg         [T, Hv]       fp32
    dq_first, dk_first [slots, C, Hqk, K] fp32: the sums of an item's part that counts first (PARTS = 2;
               else [1, C, Hqk, K], unused)
    counts     [slots, Hqk]  int32, zero: an item's parts arrived and published (PARTS = 2; else [1, Hqk],
               unused); left zero

Schedule: persistent, one block of `grads_threads` threads (two warpgroups) per SM
(`blocks`); block b takes the items (chunk slot, qk-head) b, b + blocks, ..., slot-major, so the
empty slots past the last chunk come last and a block stops at its first. For an item it walks
the Hv / Hqk v-heads of the qk-head, accumulating dq and dk. Every tile arrives by cp.async,
each copy its own group, and a v-head's tiles are copied while the previous v-head (of this item
or of the block's previous item) computes, each set as soon as that one has read its tiles for
the last time: S, dS', A and γ after the products with the states; at its end k and q (when the
next v-head starts an item), then V, dO and dU. The next item's chunk row (first token, tokens)
is loaded at the item's start and first read there, so no copy waits for the chunk table.
In PARTS = 2 parts (flash_qla.ops.backward.grads_parts: where the items leave the last round of blocks
mostly idle, most often fewer items than SMs, a block walking all of an item's v-heads leaves most SMs
idle, and the parts save more than their exchange costs) an item is (chunk slot, qk-head, part),
the two parts neighbours, each walking half the qk-head's v-heads. At its end a part counts itself
in its item's count (one thread's relaxed atomicAdd of 1). The part that counts first stores its
fp32 dq and dk sums in dq_first and dk_first (every row: whole 8-byte stores, no masks) and, after a
block barrier, publishes them (one thread's release atomicAdd of 2). The part that counts second
stores nothing: one thread waits for the count to reach 4 (an acquire load; the first part is
resident, having counted), then it adds the first's sums to its own (two addends: the same bits
whichever part adds), sets the count back to zero and stores dq and dk. So the kernel expects every
count zero at launch (flash_qla.ops.buffers.counters) and leaves it so. dβ and dg, per v-head, are
the same arithmetic either way. Against both parts storing their sums behind every thread's
__threadfence and the second adding the other's after one more: chunk_grads 27.5 -> 26.1 µs at 2/8
1x2048, training step 121.7 -> 120.2 (benchmark/NOTES.md v60). TileLang keeps an atomic add's memory
order only where the add returns the old value (its non-returning add is relaxed): the publishing
add returns it, unread.
Against a block per (chunk, qk-head), which loaded its chunk row, then q and k and its first
v-head's tiles, and waited for them with nothing to overlap: chunk_grads ~1.36 -> ~1.29 ms at
16/32 8x4096 (low-level backward 2.193 -> 2.131 ms), 2/8 8x4096 0.598 -> 0.587
(benchmark/NOTES.md v18; copying ahead only the v-heads' tiles, not q, k and the chunk row,
gained nothing: ncu put the item's first wait at 8 % of the stall samples).
Every product runs on wgmma with fp32 accumulators, in three phases that keep few
accumulators live: the products with the states (K S, K dS', v_new = A U; ⟨S, dS'⟩'s fold runs
on the CUDA cores while K S and K dS' are on the tensor cores: low-level backward 16/32 8x4096
2.125 -> 2.113 ms, 2/8 0.584 -> 0.578, gradients bitwise equal; benchmark/NOTES.md v19 step 3,
which also lists reorderings and load paths that lost); the state terms
of dq and dk (dO Sᵀ, dU Sᵀ, v_new dS'ᵀ), which also give dγ's e^γ ⊙ rowsum(scale dO ⊙ Q S −
dU ⊙ K S) as e^γ ⊙ rowsum(scale (dO Sᵀ) ⊙ Q − (dU Sᵀ) ⊙ K) (no Q S product: C K V multiply-adds
less a v-head); then the [C, C] products (dP, dN, Q Kᵀ, K Kᵀ in one batch; Q Kᵀ and K Kᵀ are
formed per v-head, not kept through it: their 32 registers a thread are what lets ptxas keep
everything else in registers; Γ's exponentials are formed while the four run: training step 16/32
8x4096 2.420 -> 2.411 ms, 2/8 0.675 -> 0.673, gradients bitwise equal, benchmark/NOTES.md v29), N
v_new accumulated onto U (W), Pᵀ dO − Nᵀ dU, and the reductions.
dq and dk are staged for whole-row 16-byte stores (from the accumulators a store writes 4 bytes of a
row), dq in v_new's tile and dk in K dS''s (swizzled for stmatrix), both free at an item's end: 3 barriers
there where staging both in v_new's tile, one after the other, took 5 (training step, H100, one process,
interleaved: 16/32 1x2048 210.8 -> 208.3 µs, 32/32 1x2048 225.1 -> 222.7, 16/16 1x2048 152.0 -> 151.5,
2/8 1x2048 119.8 -> 120.3, the 8192- and 32768-token rows within 0.2 %; gradients bitwise equal;
benchmark/NOTES.md v87 step 3).
The four [C, C] terms of dq and dk are issued without a wait before dβ and dγ, whose
reductions and scan use no tensor cores, and waited for after them (1.390 -> 1.375
ms at 16/32 8x4096, 1.391 -> 1.367 at 1x32768; benchmark/NOTES.md v11 step 6).
Against synchronous tile copies and direct stores: 16/32 8x4096 backward 3.39 -> 2.79 ms,
1x32768 3.99 -> 3.43 (benchmark/NOTES.md v8). A chunk's first token and length come from the
chunk table (flash_qla.ops.chunks) with one load.

Barriers: a v-head waits at 7 block-wide barriers (3 for its copies, 2 before products that
read tiles just stored: U, and the [C, C] operands with the small arrays, 2 after tiles are read
for the last time), an item's end at 1 (its dq and dk staged), where a v-head took 48. The kernel
is compiled without TileLang's thread-storage sync pass, every barrier placed here: the pass,
which cannot tell the tiles of the one dynamic shared buffer apart, added 3 a v-head (before U's
stmatrix, where each warp overwrites the elements it read; after v_new's product, before v_new's
and K dS''s tiles are written; after the [C, C] products, before their operand tiles are written)
and 2 at an item's end (before each staging stmatrix), none of which ordered an access to memory
that another thread had written or would read (benchmark/NOTES.md v87 step 5). Without them, training
step (H100, one process, interleaved; v88 step 1): 16/32 1x2048 210.0 -> 209.1 µs, 32/32 1x2048
225.0 -> 223.7, 16/32 4096x8 2728.9 -> 2708.6; the gradients bitwise equal. At one block of 8 warps
an SM each is time no warp issues in:
- the row and column sums take none of their own: a row sum is reduced within each warpgroup's
  half of the columns and a column sum within each warp's 16 rows, by shuffles (X, Rr and Rc
  index the warpgroup or warp explicitly, so the reduction stays inside it); the halves and the
  four warps' parts go to shared memory and are added where dβ and dγ read them;
- the small fp32 arrays (γ, its exponentials, the sums' parts) are static shared memory, apart
  from the tiles (TileLang's pass, when it ran, planned their barriers apart from the tiles');
- v_new's tile and the four [C, C] operand tiles are stored from the loops that form them (a
  T.copy lowers to stmatrix and took a barrier of its own before each);
- dγ's reverse cumsum runs in warp 0's registers by shuffles (rows lane and 32 + lane), with
  the last valid token's two totals (warp shuffle sums too; a serial sum over shared memory was a
  chain of 2 C dependent adds, benchmark/NOTES.md v15), not over a shared tile between barriers.
One exchange per result through shared memory took 76 barriers a v-head, batched exchanges 48
(chunk_grads 1.59 -> 1.44 ms at 16/32 8x4096, benchmark/NOTES.md v9); 10, training step
(benchmark/NOTES.md v27, one process, interleaved): 16/32 8x4096 2.549 -> 2.431 ms, 1x32768
3.305 -> 3.192, 2/8 8x4096 0.698 -> 0.673, 4/16 8x4096 1.256 -> 1.201; dq, dk, dv bitwise, dβ
within 1.1e-5 and dg 2.5e-7 (relative: the sums' order changed).
"""

import tilelang
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout
from tilelang.transform import PassConfigKey

from flash_qla.arch import ArchProfile
from flash_qla.ops.launch import follow_previous_kernel, kernel_factory, token_major
from flash_qla.ops.staging import zero_rows_past
from flash_qla.reference.backward_stages import BETA_MIN

LOG2E = 1.4426950408889634


@kernel_factory
def chunk_grads_kernel(
    Hqk: int, Hv: int, K: int, V: int, dtype: str, profile: ArchProfile, beta_dtype: str, PARTS: int = 1
):  # fmt: skip
    """Compile (or load from TileLang's cache) the chunk gradients for one static config; beta_dtype: dβ's
    (flash_qla.ops.forward.beta_kernel_dtype's name); PARTS: the items a (chunk, qk-head) splits into, each
    walking GROUPS / PARTS of its v-heads (PARTS = 2: dq and dk summed through dq_first, dk_first and counts)."""
    C = profile.chunk
    GROUPS = Hv // Hqk
    assert PARTS in (1, 2) and GROUPS % PARTS == 0, "whole items, or two of whole v-heads"
    VHEADS = GROUPS // PARTS  # an item's v-heads
    PER_SLOT = Hqk * PARTS  # items a chunk slot
    assert K % C == 0, "⟨S, dS'⟩ folds K rows onto C"
    assert K == V, "dq and dk are staged in [C, V] tiles"
    # a wgmma accumulator's rows are 4 warps of 16 (the column sums' four parts), and warp 0 holds
    # dγ's rows as two halves of 32 (the scan and the last token's totals)
    assert C == 64, "chunk_grads is written for chunks of 64 tokens"
    accum = "float32"
    # Reductions over a wgmma accumulator, whose threads hold 2 of their warp's 16 rows and 2 of
    # every 8 columns: the warpgroups split the columns, the 4 warps of a warpgroup its 64 rows.
    # A row sum is reduced within each warpgroup's half of the columns (X and Rr: [C, 2, half],
    # the middle index the warpgroup), a column sum within each warp's 16 rows (Rc: [C // 16, 16,
    # C], the first index the warp), by shuffles alone; the halves and the warps' parts go to
    # shared memory and are added where they are read, after a barrier that is there anyway.
    HALF = V // 2
    WARP_ROWS = 16
    tokens = T.dynamic("tokens")
    n_slots = T.dynamic("n_slots")
    part_slots = T.dynamic("part_slots")  # chunk slots (PARTS = 2), else a placeholder's 1
    # a v-head's tiles in the order they are copied, one cp.async group each, in two sets issued
    # where the previous v-head frees their tiles (see the docstring); an item's k and q come
    # between γ and V, so the waits count the same groups after each tile at every v-head
    TILE_ORDER = ("S", "dS'", "A", "γ", "V", "dO", "dU")

    @T.macro
    def arrived(pending):
        """Wait until at most `pending` copy groups are in flight, then for every thread's copies."""
        T.ptx_wait_group(pending)
        T.sync_threads()

    @T.macro
    def zeroed():
        """After a zeroing of tiles' rows past a sequence's end (staging.zero_rows_past) right behind an
        `arrived`, in the zeroing's branch: the stores visible to wgmma and to every thread. TileLang's sync
        pass takes this barrier for the stores' ordering; without it, it puts barriers of its own after the
        branch, on every v-head of every chunk."""
        T.fence_proxy_async()
        T.sync_threads()

    def pending_after(tile: str) -> int:
        """Groups still in flight once `tile` (and every tile copied before it) has arrived."""
        return len(TILE_ORDER) - 1 - TILE_ORDER.index(tile)

    @T.macro
    def copy_state_tiles(h, dh, A, gamma, s_s, ds_s, a_s, gam_s, slot, t0, ih):
        """S, dS', A and γ of v-head ih of a chunk: free once the products with the states are done."""
        T.async_copy(h[slot, ih, :, :], s_s)
        T.async_copy(dh[slot, ih, :, :], ds_s)
        T.async_copy(A[t0:t0 + C, ih, :], a_s)
        T.async_copy(gamma[ih, slot, :], gam_s)

    @T.macro
    def copy_qk_tiles(q, k, q_s, k_s, t0, ihk):
        """k and q of a chunk: free once the previous item's last products are done."""
        T.async_copy(k[t0:t0 + C, ihk, :], k_s)
        T.async_copy(q[t0:t0 + C, ihk, :], q_s)

    @T.macro
    def copy_grad_tiles(v, do, dv, u_s, do_s, du_s, t0, ih):
        """V, dO and dU of v-head ih of a chunk: free once the v-head's dβ is formed."""
        T.async_copy(v[t0:t0 + C, ih, :], u_s)
        T.async_copy(do[t0:t0 + C, ih, :], do_s)
        T.async_copy(dv[t0:t0 + C, ih, :], du_s)

    @T.macro
    def store_dq_dk(DQ, DK, vn_s, kd_s, dq, dk, t0, valid, ihk):
        """dq and dk of an item's chunk, staged in v_new's tile and K dS''s (both free now) for whole-row 16-byte
        stores."""
        T.copy(DQ, vn_s)
        T.copy(DK, kd_s)
        T.sync_threads()
        for i, d in T.Parallel(C, K):
            if i < valid:
                dq[t0 + i, ihk, d] = vn_s[i, d]
                dk[t0 + i, ihk, d] = kd_s[i, d]

    def next_vhead(hg, slot, t0, ih, next_item, next_t0, next_valid):
        """The block's next v-head as expressions (whether there is one, its chunk slot, first token
        and v-head): this chunk's next one, else the first of the block's next item."""
        in_item = hg + 1 < VHEADS
        return (
            T.Or(in_item, next_valid > 0),
            T.if_then_else(in_item, slot, next_item // PER_SLOT),
            T.if_then_else(in_item, t0, next_t0),
            T.if_then_else(in_item, ih + 1, (next_item % PER_SLOT) * VHEADS),
        )

    def qk_head(item):
        """The qk-head of an item (its PARTS parts are neighbours)."""
        return item % PER_SLOT // PARTS

    @T.prim_func
    def chunk_grads(
        q: T.Tensor([1, tokens, Hqk, K], dtype),
        k: T.Tensor([1, tokens, Hqk, K], dtype),
        v: T.Tensor([1, tokens, Hv, V], dtype),
        do: T.Tensor([1, tokens, Hv, V], dtype),
        dv: T.Tensor([1, tokens, Hv, V], dtype),
        A: T.Tensor([1, tokens, Hv, C], dtype),
        gamma: T.Tensor([Hv, n_slots, C], accum),
        h: T.Tensor([n_slots, Hv, K, V], dtype),
        dh: T.Tensor([n_slots, Hv, K, V], dtype),
        chunk_table: T.Tensor([n_slots, 2], "int32"),
        dq: T.Tensor([1, tokens, Hqk, K], dtype),
        dk: T.Tensor([1, tokens, Hqk, K], dtype),
        dbeta: T.Tensor([1, tokens, Hv], beta_dtype),
        dg: T.Tensor([1, tokens, Hv], accum),
        dq_first: T.Tensor([part_slots, C, Hqk, K], accum),
        dk_first: T.Tensor([part_slots, C, Hqk, K], accum),
        counts: T.Tensor([part_slots, Hqk], "int32"),
        scale: T.float32,
        slots: T.int32,
        blocks: T.int32,
    ):
        with T.Kernel(blocks, threads=profile.grads_threads) as bid:
            q, k, v, do, dv, A, dq, dk, dbeta, dg = token_major(q, k, v, do, dv, A, dq, dk, dbeta, dg)
            follow_previous_kernel()
            q_s = T.alloc_shared([C, K], dtype)
            k_s = T.alloc_shared([C, K], dtype)
            do_s = T.alloc_shared([C, V], dtype)  # dO
            du_s = T.alloc_shared([C, V], dtype)  # dU = dv
            u_s = T.alloc_shared([C, V], dtype)  # V, then U
            kd_s = T.alloc_shared([C, V], dtype)  # diag(e^{γ_L − γ}) K dS', for dβ's products; then dk staged
            vn_s = T.alloc_shared([C, V], dtype)  # v_new, then dq and dk staged for their stores
            a_s = T.alloc_shared([C, C], dtype)
            n_s = T.alloc_shared([C, C], dtype)  # −N
            p_s = T.alloc_shared([C, C], dtype)  # scale · P
            dqk_s = T.alloc_shared([C, C], dtype)  # dP ⊙ Γ
            dkk_s = T.alloc_shared([C, C], dtype)  # dN ⊙ Γ
            s_s = T.alloc_shared([K, V], dtype)  # S
            ds_s = T.alloc_shared([K, V], dtype)  # dS'
            # dk is staged in K dS''s tile by stmatrix, 8 rows at once: swizzled 128-byte rows, else they share banks
            T.annotate_layout({kd_s: make_full_bank_swizzled_layout(kd_s)})
            gam_s = T.alloc_shared([C], accum)  # γ as copied (the next v-head's once prefetched)
            gc_s = T.alloc_shared([C], accum, scope="shared")  # this v-head's γ
            eg_s = T.alloc_shared([C], accum, scope="shared")
            ed_s = T.alloc_shared([C], accum, scope="shared")
            # the reductions' parts: [C, 2] the warpgroups' halves of a row sum, [C // 16, C] the
            # warps' parts of a column sum
            dgr_s = T.alloc_shared([C, 2], accum, scope="shared")  # dγ's row terms of the state products
            rr_s = T.alloc_shared([C, 2], accum, scope="shared")  # rowsum(R)
            rc_s = T.alloc_shared([C // WARP_ROWS, C], accum, scope="shared")  # colsum(R)
            vk_s = T.alloc_shared([C, 2], accum, scope="shared")  # ⟨v_new_i, (K dS')_i⟩
            sd_s = T.alloc_shared([C, 2], accum, scope="shared")  # row sums of ⟨S, dS'⟩'s fold
            db_s = T.alloc_shared([C, 2], accum, scope="shared")  # dβ
            rb_s = T.alloc_shared([C], accum, scope="shared")  # 1 / β², β read from A's diagonal
            quot_s = T.alloc_shared([1], "int32", scope="shared")  # dβ as the quotient (every valid β ≥ BETA_MIN)
            if PARTS == 2:
                done_s = T.alloc_shared([1], "int32", scope="shared")  # the item's count as this part came (0: the first)

            KS = T.alloc_fragment([C, V], accum)  # K S, then U, then W = U − N v_new
            KD = T.alloc_fragment([C, V], accum)  # K dS', then scale Pᵀ dO − Nᵀ dU
            VN = T.alloc_fragment([C, V], accum)  # v_new
            X = T.alloc_fragment([C, 2, HALF], accum)  # elementwise terms of row sums, X[i, j // HALF, j % HALF]
            QK = T.alloc_fragment([C, C], accum)  # Q Kᵀ
            KK = T.alloc_fragment([C, C], accum)  # K Kᵀ
            DP = T.alloc_fragment([C, C], accum)
            DN = T.alloc_fragment([C, C], accum)
            G = T.alloc_fragment([C, C], accum)  # Γ on and below the diagonal of the valid rows
            Rr = T.alloc_fragment([C, 2, C // 2], accum)  # R for its row sums, Rr[i, j // (C / 2), j % (C / 2)]
            # R for its column sums, Rc[i // 16, i % 16, j]
            Rc = T.alloc_fragment([C // WARP_ROWS, WARP_ROWS, C], accum)
            DQ = T.alloc_fragment([C, K], accum)  # summed over the v-heads
            DK = T.alloc_fragment([C, K], accum)  # summed over the v-heads
            Y = T.alloc_fragment([C, K], accum)
            Z = T.alloc_fragment([C, K], accum)
            rows = T.alloc_fragment([C, 2], accum)  # row sums of [C, V] tiles, per warpgroup
            r_rows = T.alloc_fragment([C, 2], accum)
            r_cols = T.alloc_fragment([C // WARP_ROWS, C], accum)  # per warp
            dgl = T.alloc_local([C // 32], accum)  # warp 0: dγ of rows lane and 32 + lane
            shifted = T.alloc_var(accum)
            t0 = T.alloc_var("int32")
            valid = T.alloc_var("int32")
            next_t0 = T.alloc_var("int32")  # the block's next item's chunk: first token and tokens
            next_valid = T.alloc_var("int32")
            g_last = T.alloc_var(accum)
            at_last = T.alloc_var(accum)
            sd_part = T.alloc_var(accum)
            small = T.alloc_var(accum)
            quot = T.alloc_var("int32")
            vk_part = T.alloc_var(accum)
            if PARTS == 2:
                published = T.alloc_local([1], "int32")  # the count the first part's publishing add returned (unread)
            tx = T.get_thread_binding()
            lane = tx % 32

            # items (chunk slot, qk-head), slot-major: the empty slots past the last chunk come
            # last, so a block's items are valid up to its first empty one
            items = slots * PER_SLOT
            next_valid = 0
            if bid < items:
                next_t0 = chunk_table[bid // PER_SLOT, 0]
                next_valid = chunk_table[bid // PER_SLOT, 1]
                if next_valid > 0:  # the first item's first v-head, in the order of the later copies
                    first = (bid % PER_SLOT) * VHEADS
                    copy_state_tiles(h, dh, A, gamma, s_s, ds_s, a_s, gam_s, bid // PER_SLOT, next_t0, first)
                    copy_qk_tiles(q, k, q_s, k_s, next_t0, qk_head(bid))
                    copy_grad_tiles(v, do, dv, u_s, do_s, du_s, next_t0, first)

            for it in T.serial(T.ceildiv(items - bid, blocks)):
                item = bid + it * blocks
                slot = item // PER_SLOT
                ihk = qk_head(item)
                t0 = next_t0
                valid = next_valid
                # the next item's chunk, loaded now and first read where its tiles are copied
                next_valid = 0
                if item + blocks < items:
                    next_t0 = chunk_table[(item + blocks) // PER_SLOT, 0]
                    next_valid = chunk_table[(item + blocks) // PER_SLOT, 1]
                if valid > 0:
                    T.clear(DQ)
                    T.clear(DK)

                    for hg in T.serial(VHEADS):
                        ih = (item % PER_SLOT) * VHEADS + hg
                        # this v-head's tiles were copied while the previous one computed (and the
                        # item's k and q, between γ and V)
                        arrived(pending_after("γ"))
                        if valid < C:  # a sequence's last chunk: the next sequence's rows out of every product
                            zero_rows_past(a_s, valid)
                            zero_rows_past(k_s, valid)
                            zero_rows_past(q_s, valid)
                            zeroed()
                        g_last = gam_s[valid - 1]
                        for i in T.Parallel(C):  # first read after the next wait
                            gc_s[i] = gam_s[i]
                            eg_s[i] = T.if_then_else(i < valid, T.exp2(gam_s[i] * LOG2E), 0.0)
                            ed_s[i] = T.if_then_else(i < valid, T.exp2((g_last - gam_s[i]) * LOG2E), 0.0)
                            rb_s[i] = 1.0 / (T.cast(a_s[i, i], accum) * T.cast(a_s[i, i], accum))
                        if tx < 32:  # whether a valid row has |β| < BETA_MIN, read after the next barrier
                            small = T.if_then_else(
                                lane < valid and T.abs(T.cast(a_s[lane, lane], accum)) < BETA_MIN, 1.0, 0.0
                            ) + T.if_then_else(
                                lane + 32 < valid and T.abs(T.cast(a_s[lane + 32, lane + 32], accum)) < BETA_MIN, 1.0, 0.0
                            )
                            quot_s[0] = T.if_then_else(T.warp_reduce_sum(small) == 0.0, 1, 0)
                        # 1. products with the states; U, v_new. Under K S and K dS': ⟨S, dS'⟩, multiplied and
                        #    summed in fp32, K rows folded onto the C rows of X (the two 16-bit operands' product,
                        #    uncast, is a bf16 multiply rounding every term: benchmark/NOTES.md v61)
                        T.wgmma_gemm(k_s, s_s, KS, clear_accum=True)
                        T.wgmma_gemm(k_s, ds_s, KD, clear_accum=True)
                        T.clear(X)
                        for b in T.unroll(K // C):
                            for i, j in T.Parallel(C, V):
                                X[i, j // HALF, j % HALF] += (
                                    T.cast(s_s[b * C + i, j], accum) * T.cast(ds_s[b * C + i, j], accum)
                                )
                        T.reduce_sum(X, rows, dim=2)
                        T.copy(rows, sd_s)
                        T.wait_wgmma(0)
                        for acc in (KS, KD):
                            T.warpgroup_fence_operand(acc, num_regs=C * V // profile.grads_threads)
                        arrived(pending_after("V"))
                        if valid < C:
                            zero_rows_past(u_s, valid)
                            zeroed()
                        quot = quot_s[0]
                        for i, j in T.Parallel(C, V):
                            KS[i, j] = u_s[i, j] - eg_s[i] * KS[i, j]
                        T.copy(KS, u_s)
                        T.sync_threads()  # U stored by every warp before the product reads it
                        T.gemm(a_s, u_s, VN, clear_accum=True)
                        # v_new's tile stored from the loop that reads v_new, each thread the elements it
                        # holds (a T.copy, by stmatrix, took a block-wide barrier of its own)
                        for i, j in T.Parallel(C, V):
                            vn_s[i, j] = VN[i, j]
                            X[i, j // HALF, j % HALF] = VN[i, j] * KD[i, j]
                            if quot == 0:  # dv_new's K dS' term, for dβ's products
                                kd_s[i, j] = KD[i, j] * ed_s[i]
                        T.reduce_sum(X, rows, dim=2)
                        T.copy(rows, vk_s)
                        arrived(pending_after("dU"))
                        if valid < C:
                            zero_rows_past(do_s, valid)
                            zero_rows_past(du_s, valid)
                            zeroed()
                        if quot != 0:  # dβ's row sums rowsum(dU ⊙ v_new), over 1 / β² where it is stored
                            for i, j in T.Parallel(C, V):
                                X[i, j // HALF, j % HALF] = VN[i, j] * du_s[i, j]
                            T.reduce_sum(X, rows, dim=2)
                            T.copy(rows, db_s)

                        # 2. the state terms: dq += scale diag(e^γ) dO Sᵀ,
                        #    dk += −diag(e^γ) dU Sᵀ + diag(e^{γ_L − γ}) v_new dS'ᵀ,
                        #    and dγ's e^γ ⊙ rowsum(scale dO ⊙ Q S − dU ⊙ K S) as
                        #    e^γ ⊙ rowsum(scale (dO Sᵀ) ⊙ Q − (dU Sᵀ) ⊙ K), from the same products
                        T.gemm(do_s, s_s, Y, transpose_B=True, clear_accum=True)
                        for i, d in T.Parallel(C, K):
                            DQ[i, d] = DQ[i, d] + Y[i, d] * (scale * eg_s[i])
                            X[i, d // HALF, d % HALF] = Y[i, d] * q_s[i, d] * scale
                        T.gemm(du_s, s_s, Y, transpose_B=True, clear_accum=True)
                        for i, d in T.Parallel(C, K):
                            DK[i, d] = DK[i, d] - eg_s[i] * Y[i, d]
                            X[i, d // HALF, d % HALF] = (X[i, d // HALF, d % HALF] - Y[i, d] * k_s[i, d]) * eg_s[i]
                        T.reduce_sum(X, rows, dim=2)
                        T.copy(rows, dgr_s)
                        T.gemm(vn_s, ds_s, Z, transpose_B=True, clear_accum=True)
                        for i, d in T.Parallel(C, K):
                            DK[i, d] = DK[i, d] + ed_s[i] * Z[i, d]
                        T.sync_threads()  # S, dS', A and γ are read for the last time
                        # the next v-head, formed where its tiles are copied (held in registers
                        # through the v-head, or in shared memory, ptxas spilled 4-80 bytes)
                        n_ok, n_slot, n_t0, n_ih = next_vhead(hg, slot, t0, ih, item + blocks, next_t0, next_valid)
                        if n_ok:
                            copy_state_tiles(h, dh, A, gamma, s_s, ds_s, a_s, gam_s, n_slot, n_t0, n_ih)

                        # 3. the [C, C] products and the reductions over them
                        T.wgmma_gemm(do_s, vn_s, DP, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(du_s, vn_s, DN, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(q_s, k_s, QK, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(k_s, k_s, KK, transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(C, C):  # under the products
                            G[i, j] = T.if_then_else(j <= i and i < valid, T.exp2((gc_s[i] - gc_s[j]) * LOG2E), 0.0)
                        T.wait_wgmma(0)
                        for acc in (DP, DN, QK, KK):
                            T.warpgroup_fence_operand(acc, num_regs=C * C // profile.grads_threads)
                        # the [C, C] operands stored from the loop that forms them (a T.copy each, by
                        # stmatrix, took a block-wide barrier each), R's sums, then one barrier for both
                        for i, j in T.Parallel(C, C):
                            DP[i, j] = DP[i, j] * scale * G[i, j]  # dP ⊙ Γ
                            DN[i, j] = T.if_then_else(j < i, -DN[i, j] * G[i, j], 0.0)  # dN ⊙ Γ
                            # R = dP ⊙ P + dN ⊙ N
                            Rr[i, j // (C // 2), j % (C // 2)] = DP[i, j] * QK[i, j] + DN[i, j] * KK[i, j]
                            Rc[i // WARP_ROWS, i % WARP_ROWS, j] = Rr[i, j // (C // 2), j % (C // 2)]
                            dqk_s[i, j] = DP[i, j]
                            dkk_s[i, j] = DN[i, j]
                            if quot == 0:  # dβ's products' operands
                                n_s[i, j] = T.if_then_else(j < i, -KK[i, j] * G[i, j], 0.0)  # −N
                                p_s[i, j] = QK[i, j] * G[i, j] * scale  # scale · P
                        T.reduce_sum(Rr, r_rows, dim=2)
                        T.copy(r_rows, rr_s)
                        T.reduce_sum(Rc, r_cols, dim=1)
                        T.copy(r_cols, rc_s)
                        T.sync_threads()  # TileLang plans the small static arrays' barriers apart from the tiles'

                        # the [C, C] terms of dq and dk run on the tensor cores under dβ and dγ, which
                        # use none: dq += (dP ⊙ Γ) K, dk += (dP ⊙ Γ)ᵀ Q + (dN ⊙ Γ) K + (dN ⊙ Γ)ᵀ K
                        T.wgmma_gemm(dqk_s, k_s, DQ)
                        T.wgmma_gemm(dqk_s, q_s, DK, transpose_A=True)
                        T.wgmma_gemm(dkk_s, k_s, DK)
                        T.wgmma_gemm(dkk_s, k_s, DK, transpose_A=True)

                        # dγ of rows lane and 32 + lane and its reverse cumsum over the chunk, in warp 0's
                        # registers by shuffles (no shared tile, no barrier); the last valid token's two
                        # totals, Σ ⟨S, dS'⟩ rows and Σ_i e^{γ_L − γ_i} vk_i, by warp shuffles too
                        if tx < 32:
                            sd_part = sd_s[lane, 0] + sd_s[lane, 1]
                            vk_part = ed_s[lane] * (vk_s[lane, 0] + vk_s[lane, 1])
                            for r in T.unroll(1, C // 32):
                                sd_part += sd_s[r * 32 + lane, 0] + sd_s[r * 32 + lane, 1]
                                vk_part += ed_s[r * 32 + lane] * (vk_s[r * 32 + lane, 0] + vk_s[r * 32 + lane, 1])
                            at_last = T.warp_reduce_sum(sd_part) * T.exp2(g_last * LOG2E) + T.warp_reduce_sum(vk_part)
                            for r in T.unroll(C // 32):
                                row = r * 32 + lane
                                dgl[r] = (
                                    dgr_s[row, 0] + dgr_s[row, 1] + rr_s[row, 0] + rr_s[row, 1]
                                    - (rc_s[0, row] + rc_s[1, row] + rc_s[2, row] + rc_s[3, row])
                                    - ed_s[row] * (vk_s[row, 0] + vk_s[row, 1])
                                    + T.if_then_else(row == valid - 1, at_last, 0.0)
                                )
                            for r in T.unroll(C // 32):  # suffix sums within each 32 rows
                                for o in T.unroll(5):
                                    shifted = T.shfl_down(dgl[r], 1 << o)
                                    dgl[r] += T.if_then_else(lane + (1 << o) < 32, shifted, 0.0)
                            dgl[0] += T.shfl_sync(dgl[1], 0)  # rows 32.. in rows ..31
                            for r in T.unroll(C // 32):
                                if r * 32 + lane < valid:
                                    dg[t0 + r * 32 + lane, ih] = dgl[r]

                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(DQ, num_regs=C * K // profile.grads_threads)
                        T.warpgroup_fence_operand(DK, num_regs=C * K // profile.grads_threads)
                        # a chunk with a valid |β| < BETA_MIN: W = U − N v_new and dβ = rowsum((dv_new − Nᵀ dU) ⊙ W)
                        if quot == 0:
                            for i, j in T.Parallel(C, V):
                                KS[i, j] = u_s[i, j]
                            T.gemm(n_s, vn_s, KS)  # n_s holds −N
                            T.gemm(p_s, do_s, KD, transpose_A=True, clear_accum=True)
                            T.gemm(n_s, du_s, KD, transpose_A=True)
                            for i, j in T.Parallel(C, V):
                                X[i, j // HALF, j % HALF] = (kd_s[i, j] + KD[i, j]) * KS[i, j]
                            T.reduce_sum(X, rows, dim=2)
                            T.copy(rows, db_s)  # dβ's halves, added where dβ is stored
                        T.sync_threads()  # dO, dU and U's tile are read for the last time
                        for i in T.Parallel(C):
                            if i < valid:
                                dbeta[t0 + i, ih] = T.cast(
                                    (db_s[i, 0] + db_s[i, 1]) * T.if_then_else(quot != 0, rb_s[i], 1.0), beta_dtype
                                )
                        n_ok, n_slot, n_t0, n_ih = next_vhead(hg, slot, t0, ih, item + blocks, next_t0, next_valid)
                        if n_ok:
                            if hg + 1 == VHEADS:  # q and k are read for the last time too
                                copy_qk_tiles(q, k, q_s, k_s, n_t0, qk_head(item + blocks))
                            copy_grad_tiles(v, do, dv, u_s, do_s, du_s, n_t0, n_ih)

                    if PARTS == 1:
                        store_dq_dk(DQ, DK, vn_s, kd_s, dq, dk, t0, valid, ihk)
                    else:  # the part that counts first publishes its sums; the second adds them and stores
                        if tx == 0:  # +1 arriving, +2 once the first part's sums are published
                            done_s[0] = T.atomic_add(counts[slot, ihk], 1, memory_order="relaxed", return_prev=True)
                        T.sync_threads()
                        if done_s[0] == 0:
                            for i, d in T.Parallel(C, K):  # every row (those past the end unread)
                                dq_first[slot, i, ihk, d] = DQ[i, d]
                                dk_first[slot, i, ihk, d] = DK[i, d]
                            T.sync_threads()  # every thread's sums stored before thread 0 releases them
                            if tx == 0:  # returning the count, as TileLang's atomic add keeps the order only then
                                published[0] = T.atomic_add(counts[slot, ihk], 2, memory_order="release", return_prev=True)
                        else:
                            if tx == 0:  # both arrived (2) and the first's sums published (+2)
                                while T.atomic_load(counts[slot, ihk], memory_order="acquire") < 4:
                                    T.evaluate(0)
                            T.sync_threads()
                            # the first part's sums from L2 (thread 0's acquire invalidated this SM's L1); two
                            # addends, so the sum is the same bits whichever part adds
                            for i, d in T.Parallel(C, K):
                                DQ[i, d] += dq_first[slot, i, ihk, d]
                                DK[i, d] += dk_first[slot, i, ihk, d]
                            if tx == 0:  # zero again for the next launch
                                counts[slot, ihk] = 0
                            store_dq_dk(DQ, DK, vn_s, kd_s, dq, dk, t0, valid, ihk)

    no_sync_pass = {PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
    return tilelang.compile(chunk_grads, target=profile.target, pass_configs=no_sync_pass)
