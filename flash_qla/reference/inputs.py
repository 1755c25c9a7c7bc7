"""Random inputs as a model produces them, and DESIGN.md §4's sequence labels: for tests, benchmarks and profiles."""

import math

import torch
import torch.nn.functional as F


def make_inputs(B, T, Hqk, Hv, K, V, dtype=torch.bfloat16, device="cpu", strong_decay=False, seed=0):
    """Draw q, k, v, g, beta like a GatedDeltaNet layer does.

    k is L2-normalised, beta = sigmoid(·), g = -exp(A_log) * softplus(a + dt_bias) with
    A_log ~ U(log 1, log 16) and softplus(dt_bias) = dt ~ exp(U(log 1e-3, log 1e-1)) per head.
    strong_decay=True draws A_log ~ U(log 8, log 16) and dt ~ exp(U(log 0.5, log 2)) instead,
    so that a token decays the state by e^-11 (median; e^-0.3 to e^-65 seen).

    Returns
    -------
    dict with q, k [B, T, Hqk, K], v [B, T, Hv, V] in dtype; g [B, T, Hv] in the wider of dtype
    and float32; beta [B, T, Hv] in dtype. Drawn on the CPU from seed, then moved to device.
    """
    gen = torch.Generator().manual_seed(seed)

    def uniform(low, high, *shape):
        return low + (high - low) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    a_log_range, dt_range = ((8, 16), (0.5, 2)) if strong_decay else ((1, 16), (1e-3, 1e-1))
    A_log = uniform(*map(math.log, a_log_range), Hv)
    dt = uniform(*map(math.log, dt_range), Hv).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    g = -A_log.exp() * F.softplus(randn(B, T, Hv) + dt_bias)
    inputs = {
        "q": randn(B, T, Hqk, K),
        "k": F.normalize(randn(B, T, Hqk, K), dim=-1),
        "v": randn(B, T, Hv, V),
        "g": g,
        "beta": torch.sigmoid(randn(B, T, Hv)),
    }
    g_dtype = torch.promote_types(dtype, torch.float32)
    return {name: x.to(device=device, dtype=g_dtype if name == "g" else dtype) for name, x in inputs.items()}


def parse_seqs(label: str) -> list:
    """The sequence lengths of a DESIGN.md §4 label: '1x32768' one sequence of 32768 tokens, '4096x8' eight of
    4096 (length x count), '28672+4096' one of each."""
    if "x" in label:
        first, second = (int(x) for x in label.split("x"))
        return [second] if first == 1 else [first] * second
    return [int(x) for x in label.split("+")]
