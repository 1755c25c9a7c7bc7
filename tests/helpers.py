"""Shared pieces of the CPU tests: test cases, their inputs, and the error measure."""

import itertools
from dataclasses import dataclass

import torch

from flash_qla.reference import make_inputs

# float64 chunked form vs float64 token-by-token recurrence: both round at ~1e-16; 1e-10
# leaves room for long sums and strong decay and still catches any wrong term.
FP64_REL = 1e-10


def rel_err(x, ref):
    """‖x − ref‖ / ‖ref‖ in float64; ‖x‖ where ref is all zeros (e.g. dg of a lone first token)."""
    x, ref = x.double(), ref.double()
    scale = ref.norm()
    return ((x - ref).norm() / (scale if scale > 0 else 1)).item()


def cu_seqlens_of(lengths):
    """[0, l0, l0 + l1, ...] as int32."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@dataclass(frozen=True)
class Case:
    """One input configuration: dense [B, T] or packed sequences of the given lengths (B = 1)."""

    id: str
    B: int = 1
    T: int = 100
    lengths: tuple = None
    Hqk: int = 2
    Hv: int = 2
    K: int = 16
    V: int = 16
    strong_decay: bool = False
    initial_state: bool = False

    @property
    def N(self):
        return len(self.sequence_lengths)

    @property
    def sequence_lengths(self):
        """Lengths of all sequences; dense rows count as sequences of length T."""
        return (self.T,) * self.B if self.lengths is None else self.lengths

    def inputs(self, dtype=torch.float64, seed=0):
        """q, k, v, g, beta, cu_seqlens and initial_state as keyword arguments."""
        B, T = (self.B, self.T) if self.lengths is None else (1, sum(self.lengths))
        x = make_inputs(B, T, self.Hqk, self.Hv, self.K, self.V, dtype, strong_decay=self.strong_decay, seed=seed)
        x["cu_seqlens"] = None if self.lengths is None else cu_seqlens_of(self.lengths)
        x["initial_state"] = None
        if self.initial_state:
            gen = torch.Generator().manual_seed(seed + 1)
            state = torch.randn(self.N, self.Hv, self.K, self.V, generator=gen, dtype=torch.float64)
            x["initial_state"] = state.to(torch.promote_types(dtype, torch.float32))
        return x


# Dense and packed layouts, odd lengths, chunk edges, GVA ratios 1/2/4, K != V, states, strong decay.
CASES = [
    Case("dense-B2-T150", B=2, T=150),
    Case("dense-T63", T=63),
    Case("dense-T64", T=64),
    Case("dense-T1", T=1),
    Case("varlen-0-1-65-130", lengths=(0, 1, 65, 130), initial_state=True),
    Case("gva2-K32-V16", T=130, Hqk=2, Hv=4, K=32, V=16, initial_state=True),
    Case("gva4-K16-V32", T=70, Hqk=1, Hv=4, K=16, V=32),
    Case("strong-decay", B=2, T=200, strong_decay=True, initial_state=True),
    Case("varlen-gva2-strong-decay", lengths=(65, 0, 128, 7), Hqk=1, Hv=2, strong_decay=True, initial_state=True),
]


def randn_like(x, seed=0):
    """Seeded standard normal noise of x's shape and dtype (upstream gradients)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)


def chunk_bounds(lengths, chunk_size):
    """(sequence, start, end) of every chunk in token order; chunks restart at each sequence."""
    cu = cu_seqlens_of(lengths).tolist()
    return [
        (n, start, min(start + chunk_size, eos))
        for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:]))
        for start in range(bos, eos, chunk_size)
    ]
