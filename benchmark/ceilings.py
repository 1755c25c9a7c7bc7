"""Measure the two ceilings of DESIGN.md §1 on this GPU: device copy bandwidth and dense bf16 matmul rate.

    python benchmark/ceilings.py
"""

import torch


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / 1e3  # seconds


def main():
    src = torch.randn(2**30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src))
    print(f"device copy: {2 * src.numel() * 4 / seconds / 1e12:.2f} TB/s (read + write)")
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seconds = timed(lambda: a @ b)
    print(f"bf16 matmul {n}^3: {2 * n**3 / seconds / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
