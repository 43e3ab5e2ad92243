"""The host floor of one GPU: what PyTorch's eager launches of tiny kernels cost.

An empty kernel, a tiny matrix product and the autograd dispatch of a tiny layer, launched one after another (wall
clock per operation, and GPU time between CUDA events), and an empty kernel replayed from a CUDA graph (no host
work per kernel). Prints JSON.

    python scripts/measure_host_floor.py > floor.json      # on a machine with a CUDA GPU and PyTorch

What it measured on one H100 80GB HBM3 and one H200 is in validation/profiles/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from types import ModuleType

REPEATS = 7  # timed runs of each measurement; the median is kept


def wall_s(torch: ModuleType, step: Callable[[], object], count: int = 2000) -> float:
    """Wall-clock seconds per call of `step`, `count` calls back to back, the device synchronised around them."""
    runs = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(count):
            step()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - started) / count)
    return statistics.median(runs)


def gpu_s(torch: ModuleType, step: Callable[[], object], count: int = 2000) -> float:
    """GPU seconds per call of `step` between two CUDA events around `count` calls."""
    runs = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(count):
            step()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / 1e3 / count)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    import torch  # after --help, which needs no GPU

    device = torch.device("cuda")
    one = torch.zeros(1, device=device)
    for _ in range(200):  # warm up the kernel and the allocator
        one.add_(1)
    found: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    found["add_inplace_1elem_wall_s"] = wall_s(torch, lambda: one.add_(1))
    found["add_inplace_1elem_gpu_s"] = gpu_s(torch, lambda: one.add_(1))
    square = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    found["matmul_64_wall_s"] = wall_s(torch, lambda: square @ square)
    found["matmul_64_gpu_s"] = gpu_s(torch, lambda: square @ square)
    linear = torch.nn.Linear(64, 64, device=device, dtype=torch.bfloat16)
    batch = torch.randn(8, 64, device=device, dtype=torch.bfloat16, requires_grad=True)

    def forward_backward() -> None:
        linear(batch).sum().backward()

    found["linear_64_fwd_bwd_wall_s"] = wall_s(torch, forward_backward, 500)
    found["linear_64_fwd_bwd_gpu_s"] = gpu_s(torch, forward_backward, 500)
    side = torch.cuda.Stream()  # graphs are captured on a side stream after a few warm-up launches there
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            one.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    kernels = 100
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            one.add_(1)
    found["add_inplace_in_graph_gpu_s"] = gpu_s(torch, graph.replay, 50) / kernels
    print(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
