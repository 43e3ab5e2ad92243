"""Measured layer profiles: `fasop profile layers` times each unit (embedding, transformer layer, head) of a
model in PyTorch, forward and backward apart, at every tensor degree and micro-batch size asked for.

Each tensor degree tp runs in tp processes, one per rank (on GPUs: cuda:0 .. cuda:tp-1, NCCL; on the
processor: gloo, the cores shared between the ranks), so the tensor-parallel all-reduces are inside the
times. For every (micro-batch size, unit) each rank runs `warmup` untimed forward + backward passes, then
`repeat` timed ones; a barrier lines the ranks up before each pass. A pass's forward and backward are timed
apart: CUDA events recorded around them and read after a synchronisation on GPUs, time.perf_counter on the
processor. The profile keeps the median over the repetitions, the largest median over the ranks.

The host floor: each unit is timed again, the same way, at a tiny shape whose GPU work is negligible
(fasop.profile.hostfloor), so that its time is what the host takes to run the unit's code and launch its kernels;
over the kernels fasop.cost.roofline counts for those tiny units, that is the host's time per kernel
(`kernel_launch_us=` on the profile's identity line), with which fasop splits the measured times into the host's
part and the GPU's (fasop.inputs.profiles, docs/cost-model.md section 2.1).

peak_memory_bytes (GPUs only): the most memory the caching allocator had allocated during the unit's
passes, counted from what was allocated before the unit's weights (torch.cuda.max_memory_allocated after
reset_peak_memory_stats): weights, their gradients, the inputs, the kept activations and workspace of one
micro-batch, on the rank that used most. A micro-batch size that runs out of GPU memory ends that tensor
degree's sizes; the header says which.

This module imports torch: only `fasop profile layers` loads it.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fasop.files import comment_line, write_atomically
from fasop.inputs.model import Model
from fasop.inputs.profiles import COLUMNS, MEMORY_COLUMN, identity_line, required_kinds
from fasop.profile.hostfloor import TINY, host_floor_us, tiny_model
from fasop.profile.torchlayers import Group, build_unit, output_gradient

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
CPU_DTYPE = torch.float32  # half-precision matmuls on processors are slow or emulated: time in float32


class MeasureError(Exception):
    """A measurement that could not be made (a rank failed, no size fitted in memory)."""


@dataclass(frozen=True)
class Settings:
    device: str  # "cuda" or "cpu"
    repeat: int
    warmup: int
    seed: int = 0

    def dtype(self, model: Model) -> torch.dtype:
        return DTYPES[model.high_precision] if self.device == "cuda" else CPU_DTYPE


class Measured(NamedTuple):
    tp: int
    mbs: int
    kind: str
    forward_s: float
    backward_s: float
    peak_memory_bytes: int | None


# -- one rank ----------------------------------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_passes(unit, mbs: int, settings: Settings, group: Group, device: torch.device) -> tuple[float, float]:
    """Median forward and backward seconds of one micro-batch over `repeat` passes after `warmup`."""
    generator = torch.Generator().manual_seed(settings.seed + mbs)
    forward_s, backward_s = [], []
    cuda = device.type == "cuda"
    grad = None
    for index in range(settings.warmup + settings.repeat):
        inputs = unit.make_inputs(mbs, generator)
        unit.module.zero_grad(set_to_none=True)
        _synchronize(device)
        if group.size > 1:
            dist.barrier()
        if cuda:
            start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
        else:
            start = time.perf_counter()
        output = unit.module(*inputs)
        if cuda:
            middle.record()
        else:
            middle = time.perf_counter()
        if grad is None:
            grad = output_gradient(output, generator)
        output.backward(grad)
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            passes = (start.elapsed_time(middle) / 1e3, middle.elapsed_time(end) / 1e3)
        else:
            end = time.perf_counter()
            passes = (middle - start, end - middle)
        if index >= settings.warmup:
            forward_s.append(passes[0])
            backward_s.append(passes[1])
        del inputs, output
    return statistics.median(forward_s), statistics.median(backward_s)


def _largest_over_ranks(values: list[float], group: Group, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    return group.all_reduce(tensor, dist.ReduceOp.MAX).tolist()


def measure_rank(model: Model, tp: int, mbss: tuple[int, ...], settings: Settings, group: Group,
                 report: Callable[[tuple], None]) -> None:
    """Time every unit at every micro-batch size on this rank; rank 0 reports ("rows", mbs, rows) after each
    size, or ("oom", mbs) when a size does not fit (larger sizes are then skipped)."""
    cuda = settings.device == "cuda"
    device = torch.device("cuda", group.rank) if cuda else torch.device("cpu")
    dtype = settings.dtype(model)
    if cuda:
        torch.cuda.set_device(device)  # initialises CUDA on this rank's GPU before its memory statistics are read
    for mbs in mbss:
        rows = []
        for kind in required_kinds(model):
            unit, out_of_memory = None, 0.0
            forward_s = backward_s = peak = 0.0
            try:
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                    base_bytes = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                unit = build_unit(model, kind, group, dtype, device, settings.seed)
                forward_s, backward_s = _time_passes(unit, mbs, settings, group, device)
                if cuda:
                    peak = float(torch.cuda.max_memory_allocated(device) - base_bytes)
            except torch.cuda.OutOfMemoryError:
                out_of_memory = 1.0
            except RuntimeError as err:  # the processor's allocator says so in words, with no error type of its own
                if "can't allocate memory" not in str(err):
                    raise
                out_of_memory = 1.0
            finally:
                del unit
            # every rank learns the slowest rank's times and whether any rank ran out of memory
            forward_s, backward_s, peak, out_of_memory = _largest_over_ranks(
                [forward_s, backward_s, peak, out_of_memory], group, device)
            if out_of_memory:
                if group.rank == 0:
                    report(("oom", mbs))
                return
            rows.append(Measured(tp, mbs, kind, forward_s, backward_s, int(peak) if cuda else None))
        if group.rank == 0:
            report(("rows", mbs, rows))


def _rank_main(rank: int, tp: int, port: int, model: Model, mbss, settings: Settings, queue) -> None:
    """Entry of one spawned rank: join the group, measure, report through `queue`."""
    try:
        cuda = settings.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)  # before NCCL starts, so that each rank talks from its own GPU
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=tp)
        try:
            measure_rank(model, tp, mbss, settings, Group(rank, tp), queue.put)
        finally:
            dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 (handed to the parent, which reports it)
        queue.put(("error", rank, f"{type(err).__name__}: {err}"))
        raise SystemExit(1) from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(tp: int, target, args: tuple, on_message: Callable[[tuple], None]) -> None:
    """Run target(rank, tp, port, *args, queue) in tp new processes; pass what they put on the queue to
    `on_message` until all have ended. A rank that fails raises MeasureError with its message."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=target, args=(rank, tp, port, *args, queue), daemon=True)
                 for rank in range(tp)]
    for process in processes:
        process.start()
    errors = []
    try:
        while any(p.is_alive() for p in processes) or not queue.empty():
            died = [(r, p.exitcode) for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
            if died and queue.empty():  # a rank died without a word: the others would wait for it
                errors.append(f"rank {died[0][0]} ended with exit code {died[0][1]}")
                break
            try:
                message = queue.get(timeout=0.2)
            except Empty:
                continue
            if message[0] == "error":
                errors.append(f"rank {message[1]}: {message[2]}")
                break
            on_message(message)
    finally:
        for process in processes:
            if errors and process.is_alive():
                process.terminate()
            process.join()
    if errors:
        raise MeasureError(errors[0])


def measure(model: Model, tps, mbss, settings: Settings, on_size: Callable[[int, int], None] = lambda tp, mbs: None):
    """(rows, out_of_memory): measured rows ordered by tp, mbs, kind, and the (tp, mbs) that did not fit.

    `on_size(tp, mbs)` is called after each size is measured (or found not to fit), for a progress bar.
    """
    rows: list[Measured] = []
    out_of_memory: list[tuple[int, int]] = []
    for tp in tps:
        def on_message(message, tp=tp):
            what, mbs = message[0], message[1]
            if what == "rows":
                rows.extend(message[2])
                on_size(tp, mbs)
            else:  # out of memory: the sizes from mbs on are skipped
                out_of_memory.append((tp, mbs))
                for skipped in mbss[mbss.index(mbs):]:
                    on_size(tp, skipped)

        if tp == 1:
            measure_rank(model, tp, mbss, settings, Group(), on_message)
        else:
            spawn_ranks(tp, _rank_main, (model, mbss, settings), on_message)
        if not any(r.tp == tp for r in rows):
            raise MeasureError(f"tp={tp}: even micro-batch size {mbss[0]} does not fit in GPU memory")
    return rows, out_of_memory


def measure_host_floor(model: Model, settings: Settings) -> float:
    """Microseconds the host takes per kernel the roofline counts: every unit of `model` at the tiny shape
    (fasop.profile.hostfloor), forward + backward at micro-batch 1 (median of `repeat` after `warmup`, on the
    first GPU or the processor), over those units' kernel launches."""
    tiny = tiny_model(model)
    device = torch.device("cuda", 0) if settings.device == "cuda" else torch.device("cpu")
    seconds = {}
    for kind in required_kinds(tiny):
        unit = build_unit(tiny, kind, Group(), settings.dtype(model), device, settings.seed)
        seconds[kind] = sum(_time_passes(unit, 1, settings, Group(), device))
    return host_floor_us(tiny, seconds)


# -- the profile file ------------------------------------------------------------------------------------------------
def device_description(settings: Settings) -> tuple[str, str]:
    """(device, driver) as the header names them."""
    if settings.device == "cuda":
        name = torch.cuda.get_device_name(0)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30, check=True).stdout.split()[0]
            driver = f"NVIDIA driver {driver}"
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = "NVIDIA driver unknown (nvidia-smi not found)"
        return f"{name} (CUDA {torch.version.cuda})", driver
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"processor {cpu}, {os.cpu_count()} logical cores", "none (processor)"


def header_lines(model: Model, gpu: str, tps, mbss, settings: Settings, out_of_memory, command: str,
                 kernel_launch_us: float, date: str | None = None) -> list[str]:
    device, driver = device_description(settings)
    dtype = str(settings.dtype(model)).removeprefix("torch.")
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Measured profile of {model.name} for GPU type {gpu}: each unit timed in PyTorch (fasop.profile.measure), "
        f"forward and backward apart, median of {settings.repeat} passes after {settings.warmup} warm-up passes.",
        f"Device: {device}; driver: {driver}; torch {torch.__version__}; measured {date}.",
    ]
    if settings.device == "cuda":
        derived = (" (plain torch: FP8 plans derive their times from these by the roofline's FP8-over-bf16 ratio, "
                   "fasop.cost.fp8)" if model.fp8 else "")
        lines.append(f"Precision: {dtype} weights and activations (the model trains in {model.precision}{derived}); "
                     "CUDA events around each pass, read after torch.cuda.synchronize.")
    else:
        lines.append(f"Precision: {dtype} on the processor (the model trains in {model.precision} on GPUs); "
                     "time.perf_counter around each pass. Processor times are not GPU times: this file is for "
                     "testing the tool, not for planning.")
    lines += [
        f"Tensor parallelism: tp processes per degree ({'NCCL' if settings.device == 'cuda' else 'gloo'}), "
        "Megatron-style column- and row-parallel layers; the all-reduces are inside the times; "
        "the slowest rank's median is kept.",
        "Units: fasop.profile.torchlayers (attention through torch.nn.functional.scaled_dot_product_attention; no fused "
        "bias-GELU or masked-softmax kernels; no fp32 main gradients).",
    ]
    if settings.device == "cuda":
        lines.append(f"{MEMORY_COLUMN}: peak bytes allocated during the unit's passes (weights, gradients, "
                     "inputs, kept activations, workspace), on the rank that used most.")
    for tp, mbs in out_of_memory:
        lines.append(f"tp={tp}: micro-batch size {mbs} ran out of GPU memory; larger sizes were not measured.")
    lines.append(f"Host floor: {kernel_launch_us:.4g} us per kernel (kernel_launch_us below): every unit at hidden "
                 f"{TINY['hidden_size']}, {TINY['seq']} tokens, micro-batch 1, timed as above, over the kernels "
                 "fasop.cost.roofline counts for them; fasop splits the times above into the host's part and the "
                 "GPU's with it.")
    lines.append(f"Regenerate: {command}")
    precision = model.high_precision if settings.device == "cuda" else None  # processor times are for tests
    # format_measured adds the comment mark
    lines.append(identity_line(model.name, gpu, precision, kernel_launch_us).removeprefix("# "))
    return lines


def _number(value: float) -> str:
    return f"{value:.6g}"


def format_measured(rows: list[Measured], comment_lines: list[str]) -> str:
    """The profile CSV: '# ' comments, the header (with peak_memory_bytes when memory was recorded), rows."""
    with_memory = all(r.peak_memory_bytes is not None for r in rows)
    columns = COLUMNS + ((MEMORY_COLUMN,) if with_memory else ())
    out = [comment_line(line) for line in comment_lines] + [",".join(columns)]  # a path's newline stays escaped
    for row in rows:
        cells = [str(row.tp), str(row.mbs), row.kind, _number(row.forward_s), _number(row.backward_s)]
        out.append(",".join(cells + ([str(row.peak_memory_bytes)] if with_memory else [])))
    return "\n".join(out) + "\n"


def write_measured(path: Path, rows: list[Measured], comment_lines: list[str]) -> None:
    write_atomically(Path(path), format_measured(rows, comment_lines))
