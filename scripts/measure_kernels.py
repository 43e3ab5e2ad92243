"""Time every kernel fasop's roofline counts for a published run's layers on this machine's GPU, beside the roofline.

For each chosen run of validation/ (a row name of measurements.csv or moe-cp-measurements.csv), the kernels of one
rank's units at the run's tp, micro-batch, cp, ep and etp (fasop.cost.roofline.unit_work, the run's model and
precision as scripts/validate_published.py builds them) are each timed through a PyTorch stand-in:

- a matmul: the same GEMM (rows x inner by inner x columns) in the operand layout of its pass (forward x W^T,
  input gradient dY W, weight gradient X^T dY), bf16 or fp16; an FP8 GEMM through torch._scaled_mm on e4m3
  operands (rows rounded up to 16, as FP8 GEMMs need); a grouped GEMM as one GEMM per local expert, as
  Transformer Engine's grouped linear layer launches them;
- a fused attention kernel: scaled_dot_product_attention (cuDNN's fused attention, the backend Transformer
  Engine prefers on Hopper, else the flash backend) at the run's heads, query groups, head dims, tokens per
  ring step and mask, forward, or its backward (the gradients of Q, K and V);
- an element-wise kernel: a copy moving the same bytes (half read, half written) in as many launches.

Each stand-in is timed by triton.testing.do_bench (CUDA events, the L2 cache flushed before every run, the
median). The roofline's time is fasop.cost.roofline.kernel_gpu_s at the catalogue's figures for the run's GPU.
Collectives and the host's launches are not timed: this compares the GPU work kernel by kernel. `--extras` also
times a sustained large GEMM (clock and power read every few seconds: does a long run keep its short-run speed?)
and real element-wise kernels (norms, activations, dropout) against the copy's bandwidth.

    python scripts/measure_kernels.py --out kernels.csv [--row ROW ...] [--extras extras.csv]   # CUDA and PyTorch
    python scripts/measure_kernels.py --report kernels.csv extras.csv   # the tables, on any machine

`--report` reads what the two measured (extras.csv with a `machine` column where several machines ran) and
prints, beside today's roofline, what each kernel class and each layer took alone and back to back: what it
measured on one H100 is in validation/profiles/ (H100-kernels.csv, H100-power-limit.csv) and its README.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_published import DATA, cluster_gpu, parallel_run_model, read_parallel_runs, read_runs, run_model  # noqa: E402

from fasop.cost.roofline import Kernel, Layout, Rates, _head_dims, kernel_gpu_s, unit_work  # noqa: E402
from fasop.inputs.catalogue import GpuSpec  # noqa: E402
from fasop.inputs.cluster import load_cluster  # noqa: E402
from fasop.inputs.model import Model  # noqa: E402

# H100 runs of the dense, context-parallel and MoE tables, bf16 and fp8 (an A100 row cannot run on another GPU)
DEFAULT_ROWS = (
    "Nemotron-4 15B, bf16, 16 GPUs", "Nemotron-4 15B, fp8, 16 GPUs", "GPT-3 175B, bf16, 128 GPUs",
    "GPT-3 175B, fp8, 128 GPUs", "Nemotron-4 340B, bf16, 128 GPUs", "Llama 3.1 8B, bf16, 8 GPUs",
    "Llama 3.1 70B, bf16, 64 GPUs", "Grok-1 314B, bf16, 512 GPUs", "GPT-OSS-120B, bf16, 64 GPUs, 26.02",
    "Qwen3-30B-A3B, fp8, 16 GPUs, 26.02", "Qwen3-30B-A3B, fp8, 16 GPUs, 26.04", "Qwen3-235B-A22B, fp8, 256 GPUs, 26.04",
)
# layers run back to back as training runs them (sustained_layer): dense bf16 and fp8, and an MoE layer
SUSTAINED_ROWS = ("Llama 3.1 8B, bf16, 8 GPUs", "Nemotron-4 15B, bf16, 16 GPUs", "GPT-3 175B, bf16, 128 GPUs",
                  "GPT-3 175B, fp8, 128 GPUs", "Qwen3-235B-A22B, fp8, 256 GPUs, 26.04")



@cache
def runs_by_row() -> dict[str, tuple[Model, int, int, Layout, GpuSpec]]:
    """(model, tp, mbs, layout, the cluster's GPU) of every run, by row name."""
    def gpu(cluster_file: str) -> GpuSpec:
        return cluster_gpu(load_cluster(str(DATA / cluster_file)))

    found = {run.row: (run_model(run), run.tp, run.mbs, Layout(), gpu(run.cluster_file)) for run in read_runs()}
    for run in read_parallel_runs():
        found[run.row] = (parallel_run_model(run), run.tp, run.mbs, Layout(run.cp, run.ep, run.etp or 0),
                          gpu(run.cluster_file))
    return found


def layer_of(row: str) -> tuple[Model, int, int, GpuSpec, list[Kernel]]:
    """(model, tp, mbs, GPU, the forward then backward kernels) of the row's first transformer-layer unit."""
    model, tp, mbs, layout, spec = runs_by_row()[row]
    units = unit_work(model, tp, mbs, layout)
    work = next(w for name, w in units.items() if name not in ("embedding", "head"))
    return model, tp, mbs, spec, [*work.forward, *work.backward]


def kernel_class(kernel: Kernel) -> str:
    if kernel.attention is not None:
        return "attention"
    return "matmul" if kernel.output is not None and kernel.flops > 0 else "element-wise"


class StandIn(NamedTuple):
    """A PyTorch step doing one roofline Kernel's work, run `repeat` times (a context-parallel ring's steps)."""

    step: Callable[[], object]
    repeat: int
    text: str


class StandIns:
    """PyTorch stand-ins for roofline Kernels."""

    def __init__(self, torch: ModuleType, dtype) -> None:
        self.torch, self.dtype = torch, dtype
        self.device = torch.device("cuda")

    def random(self, *shape: int, dtype=None):
        return self.torch.randn(*shape, device=self.device, dtype=dtype or self.dtype)

    def of(self, kernel: Kernel, model: Model, tp: int, mbs: int) -> StandIn:
        kind = kernel_class(kernel)
        if kind == "attention":
            return self.attention(kernel, model, tp, mbs)
        return self.matmul(kernel) if kind == "matmul" else self.elementwise(kernel)

    def matmul(self, kernel: Kernel) -> StandIn:
        assert kernel.output is not None  # a matmul
        batch, rows, cols = (max(1, math.ceil(x)) for x in kernel.output)
        inner = max(1, round(kernel.flops / (2.0 * batch * rows * cols)))
        if kernel.fp8:
            return self._fp8(batch, rows, inner, cols)
        if kernel.name.startswith(("scores", "context")):  # the unfused attention's batched matmuls
            a, b = self.random(batch, rows, inner), self.random(batch, inner, cols)
            return StandIn(lambda: self.torch.bmm(a, b), 1, f"bmm {batch}x{rows}x{inner}x{cols}")
        if kernel.name.endswith("weight grad"):
            a, b = self.random(inner, rows).t(), self.random(inner, cols)
        elif kernel.name.endswith("input grad"):
            a, b = self.random(rows, inner), self.random(inner, cols)
        else:
            a, b = self.random(rows, inner), self.random(cols, inner).t()
        pairs = [(a, b)] + [(a.clone(), b.clone()) for _ in range(batch - 1)]

        def step() -> None:
            for x, w in pairs:
                self.torch.matmul(x, w)
        return StandIn(step, 1, f"{batch} x matmul {rows}x{inner}x{cols}")

    def _fp8(self, batch: int, rows: int, inner: int, cols: int) -> StandIn:
        torch, e4m3 = self.torch, self.torch.float8_e4m3fn
        rows, inner, cols = (16 * math.ceil(x / 16) for x in (rows, inner, cols))
        one = torch.ones((), device=self.device, dtype=torch.float32)
        pairs = [(self.random(rows, inner).to(e4m3), self.random(cols, inner).to(e4m3).t()) for _ in range(batch)]

        def step() -> None:
            for a, b in pairs:
                torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return StandIn(step, 1, f"{batch} x _scaled_mm e4m3 {rows}x{inner}x{cols}")

    def attention(self, kernel: Kernel, model: Model, tp: int, mbs: int) -> StandIn:
        from torch.nn.attention import SDPBackend

        shape = kernel.attention
        assert shape is not None  # an attention kernel
        qk, v = _head_dims(model)
        heads = model.num_attention_heads // tp
        groups = heads if model.multi_latent_attention else max(1, model.num_query_groups // tp)
        tokens = int(shape.key_length)
        steps = kernel.launches // 2 if shape.backward else kernel.launches
        q = self.random(mbs, heads, tokens, qk).requires_grad_()
        k = self.random(mbs, groups, tokens, qk).requires_grad_()
        value = self.random(mbs, groups, tokens, v).requires_grad_()
        # keys and values shared by query groups where the backend takes them so, else repeated per head
        full_k, full_v = (x.detach().repeat_interleave(heads // groups, 1).requires_grad_() for x in (k, value))
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for keys, values, gqa in ((k, value, groups != heads), (full_k, full_v, False)):
                try:
                    step = self._sdpa_step(backend, (q, keys, values), gqa, shape.causal, shape.backward)
                    step()
                except RuntimeError:
                    continue
                named = (f"{mbs}x{heads}/{groups if gqa else heads} heads x {tokens} tokens x d {qk}/{v}"
                         f"{' causal' if shape.causal else ''}")
                return StandIn(step, steps, f"sdpa {backend.name.lower()} {named} x {steps}")
        raise RuntimeError(f"no attention backend runs {kernel.name}")

    def _sdpa_step(self, backend, qkv: tuple, gqa: bool, causal: bool, backward: bool) -> Callable[[], object]:
        """One fused attention kernel's forward, or its backward (the gradients of Q, K and V), on `backend`."""
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        def forward():
            with sdpa_kernel([backend]):
                return sdpa(qkv[0], qkv[1], qkv[2], is_causal=causal, enable_gqa=gqa)
        if not backward:
            return forward
        out = forward()
        grad = self.torch.randn_like(out)
        return lambda: self.torch.autograd.grad(out, qkv, grad, retain_graph=True)

    def elementwise(self, kernel: Kernel) -> StandIn:
        elements = max(1, round(kernel.bytes / 2 / kernel.launches / 2))  # bf16 elements read (and written)
        pairs = [(self.random(elements), self.torch.empty(elements, device=self.device, dtype=self.dtype))
                 for _ in range(kernel.launches)]

        def step() -> None:
            for src, dst in pairs:
                dst.copy_(src)
        return StandIn(step, 1, f"{kernel.launches} x copy of {elements} elements")


def burst_s(bench: Callable, stand_in: StandIn) -> float:
    """GPU seconds of a stand-in timed alone (the L2 cache flushed before each run; the median)."""
    return stand_in.repeat * bench(stand_in.step, warmup=10, rep=40, return_mode="median") / 1e3


def audit(torch: ModuleType, bench: Callable, rows: list[str]) -> list[dict]:
    """One record per kernel of every unit of every row."""
    found, records = runs_by_row(), []
    for row in rows:
        model, tp, mbs, layout, spec = found[row]
        rates = Rates.of(spec.timed_alone(), model)  # as the stand-ins are timed
        stand_ins = StandIns(torch, torch.float16 if model.precision == "fp16" else torch.bfloat16)
        for unit, work in unit_work(model, tp, mbs, layout).items():
            for pass_name, kernels in (("forward", work.forward), ("backward", work.backward)):
                for kernel in kernels:
                    try:
                        stand_in = stand_ins.of(kernel, model, tp, mbs)
                        measured, text = burst_s(bench, stand_in), stand_in.text
                    except (RuntimeError, ValueError) as error:  # recorded, not fatal: one stand-in the GPU lacks
                        measured, text = math.nan, f"failed: {error}".splitlines()[0][:200]
                    records.append({"row": row, "gpu": spec.name, "unit": unit, "pass": pass_name,
                                    "kernel": kernel.name, "class": kernel_class(kernel), "launches": kernel.launches,
                                    "flops": f"{kernel.flops:.6g}", "bytes": f"{kernel.bytes:.6g}",
                                    "roofline_s": f"{kernel_gpu_s(kernel, rates):.6g}", "measured_s": f"{measured:.6g}",
                                    "stand_in": text})
                    torch.cuda.empty_cache()
        print(f"timed {row}", flush=True)
    return records


def sustained_layer(torch: ModuleType, bench: Callable, row: str, seconds: float = 15.0) -> dict:
    """One transformer layer's kernels (forward, then backward) back to back for `seconds`, as a training run
    keeps the GPU busy: seconds per layer against the sum of the same kernels timed alone, SM clock and power."""
    model, tp, mbs, _, kernels = layer_of(row)
    stand_ins = StandIns(torch, torch.float16 if model.precision == "fp16" else torch.bfloat16)
    steps = [stand_ins.of(kernel, model, tp, mbs) for kernel in kernels]
    alone_s = sum(burst_s(bench, s) for s in steps)
    layers, state, started = 0, device_state(torch), time.perf_counter()
    torch.cuda.synchronize()
    while time.perf_counter() - started < seconds:
        for stand_in in steps:
            for _ in range(stand_in.repeat):
                stand_in.step()
        layers += 1
        if layers % 20 == 0:
            torch.cuda.synchronize()
            state = device_state(torch)
    torch.cuda.synchronize()
    per_layer_s = (time.perf_counter() - started) / layers
    return {"kind": f"sustained layer: {row}", "alone_s": f"{alone_s:.6g}", "seconds": f"{per_layer_s:.6g}",
            "ratio": f"{per_layer_s / alone_s:.3f}", **state}


def sustained(torch: ModuleType, bench: Callable, fp8: bool, seconds: float = 20.0, size: int = 8192) -> list[dict]:
    """A size^3 GEMM (bf16, or e4m3 through torch._scaled_mm): first timed alone after the GPU idled (a burst,
    as benchmarks time it), then back to back for `seconds`: TFLOP/s, SM clock and power in windows of about 2 s."""
    stand_ins = StandIns(torch, torch.bfloat16)
    kernel = Kernel("gemm", 2.0 * size**3, 0.0, output=(1, size, size), fp8=fp8)
    step, kind = stand_ins.matmul(kernel).step, f"{'fp8' if fp8 else 'bf16'} gemm {size}"
    time.sleep(5.0)  # let the clocks and the power settle back to idle
    burst = kernel.flops / burst_s(bench, StandIn(step, 1, kind)) / 1e12
    windows, started = [{"kind": f"burst {kind}", "tflops": f"{burst:.1f}", **device_state(torch)}], time.perf_counter()
    while time.perf_counter() - started < seconds:
        count, begin = 0, time.perf_counter()
        torch.cuda.synchronize()
        while time.perf_counter() - begin < 2.0:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            count += 20
        elapsed = time.perf_counter() - begin
        windows.append({"kind": f"sustained {kind}", "at_s": f"{time.perf_counter() - started:.1f}",
                        "tflops": f"{kernel.flops * count / elapsed / 1e12:.1f}", **device_state(torch)})
    return windows


def device_state(torch: ModuleType) -> dict:
    """The SM clock (MHz) and board power (W) now, where NVML answers."""
    try:
        return {"sm_clock_mhz": torch.cuda.clock_rate(), "power_w": f"{torch.cuda.power_draw() / 1e3:.0f}"}
    except Exception as error:  # noqa: BLE001 - NVML missing or refused: the throughput still counts
        return {"sm_clock_mhz": f"unread: {type(error).__name__}", "power_w": ""}


def elementwise_kernels(torch: ModuleType, bench: Callable, tokens: int = 8192, hidden: int = 8192) -> list[dict]:
    """Achieved bandwidth of real element-wise kernels on a tokens x hidden bf16 tensor, bytes counted as the
    roofline counts them (every input read once, every output written once)."""
    f = torch.nn.functional
    x, y = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gate = torch.randn(tokens, 2 * hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    n = tokens * hidden * 2  # bytes of one tensor
    cases = {"copy": (lambda: y.copy_(x), 2 * n), "add": (lambda: torch.add(x, y), 3 * n),
             "layer_norm": (lambda: f.layer_norm(x, (hidden,), weight, weight), 2 * n),
             "rms_norm": (lambda: f.rms_norm(x, (hidden,), weight), 2 * n), "gelu": (lambda: f.gelu(x), 2 * n),
             "swiglu": (lambda: f.silu(gate[:, :hidden]) * gate[:, hidden:], 3 * n),
             "dropout": (lambda: f.dropout(x, 0.1, training=True), 2 * n + n // 2)}
    found = []
    for name, (step, counted) in cases.items():
        ms = bench(step, warmup=10, rep=40, return_mode="median")
        found.append({"kind": f"element-wise {name}", "bytes": counted, "seconds": f"{ms / 1e3:.6g}",
                      "gb_per_s": f"{counted / ms / 1e6:.0f}"})
    return found


def class_table(records: list[dict]) -> None:
    """Each kernel class timed alone against the roofline at the timed-alone figures (the records' own column)."""
    print("| kernels | count | roofline, timed-alone figures, ms | measured alone, ms | measured / roofline |")
    print("|---|---:|---:|---:|---:|")
    timed = [r for r in records if not math.isnan(float(r["measured_s"]))]
    for kind in ("matmul", "attention", "element-wise"):
        own = [r for r in timed if r["class"] == kind]
        roofline, measured = (sum(float(r[c]) for r in own) for c in ("roofline_s", "measured_s"))
        print(f"| {kind} | {len(own)} | {roofline * 1e3:.1f} | {measured * 1e3:.1f} | {measured / roofline:.2f} |")
    ratios = [float(r["measured_s"]) / float(r["roofline_s"]) for r in timed if r["class"] == "matmul"]
    print(f"\nmatmul kernels: median measured / roofline {statistics.median(ratios):.2f}")


def report(kernels_csv: Path, extras_csv: Path) -> None:
    """Measured against today's roofline: each kernel class timed alone, each layer alone and back to back."""
    records = list(csv.DictReader(kernels_csv.open()))
    class_table(records)
    extras = list(csv.DictReader(extras_csv.open()))
    print("\n| layer | roofline alone ms | measured alone ms | roofline at the power limit ms | back to back ms "
          "(each machine) | roofline alone / back to back | at the power limit / back to back |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in dict.fromkeys(e["kind"].removeprefix("sustained layer: ") for e in extras
                             if e["kind"].startswith("sustained layer: ")):
        model, _, _, spec, kernels = layer_of(row)
        alone_s, limited_s = (sum(kernel_gpu_s(k, Rates.of(gpu, model)) for k in kernels)
                              for gpu in (spec.timed_alone(), spec))
        unit = next(r["unit"] for r in records if r["row"] == row and r["unit"] not in ("embedding", "head"))
        measured = sum(float(r["measured_s"]) for r in records if r["row"] == row and r["unit"] == unit)
        runs = [float(e["seconds"]) for e in extras if e["kind"] == f"sustained layer: {row}"]
        mean = statistics.mean(runs)
        print(f"| {row} | {alone_s * 1e3:.2f} | {measured * 1e3:.2f} | {limited_s * 1e3:.2f} | "
              f"{', '.join(f'{r * 1e3:.2f}' for r in runs)} | {alone_s / mean - 1:+.1%} | {limited_s / mean - 1:+.1%} |")


def write_csv(path: Path, records: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="CSV of every kernel's roofline and measured time")
    parser.add_argument("--row", action="append", help="a run's row name (repeatable; default: the H100 runs listed)")
    parser.add_argument("--extras", type=Path, help="CSV of the sustained GEMMs and layers and the element-wise kernels")
    parser.add_argument("--report", type=Path, nargs=2, metavar=("KERNELS", "EXTRAS"),
                        help="print the tables of two CSVs measured before (no GPU needed)")
    args = parser.parse_args(argv)
    if args.report:
        report(*args.report)
        return 0
    import torch  # after --help, which needs no GPU
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = list(args.row or DEFAULT_ROWS)
    if args.out:
        records = audit(torch, do_bench, rows)
        write_csv(args.out, records)
        class_table(records)
    if args.extras:
        extras = [*elementwise_kernels(torch, do_bench), *sustained(torch, do_bench, fp8=False),
                  *sustained(torch, do_bench, fp8=True)]
        for row in SUSTAINED_ROWS:
            extras.append(sustained_layer(torch, do_bench, row))
            print(extras[-1], flush=True)
        write_csv(args.extras, [{k: e.get(k, "") for k in sorted({k for e in extras for k in e})} for e in extras])
        for e in extras:
            print(e, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
