"""GPU specification tables: the bundled clusters/catalogue/gpus.toml, with the user's own GPUs merged over it.

A user's GPUs come from `[[gpu]]` tables in a file passed with `--catalogue FILE`, or in the cluster file
itself; either adds GPUs or replaces a bundled GPU of the same name whole. Every table, bundled or not, is
read with the same rules: known fields only, names in the character set of fasop.names, and numbers finite
and within the bounds below (wide enough for any GPU sold, narrow enough to catch a figure in the wrong unit,
such as FLOP/s for TFLOP/s or bytes for GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from fasop.errors import ArgumentError, InputError
from fasop.inputs import bundled
from fasop.inputs.bandwidth import MIN_BANDWIDTH_BYTES_PER_S, bandwidth_bytes_per_s
from fasop.inputs.names import Name
from fasop.inputs.tomlfile import Range, Table, Text, expected, read_toml, validated

GPU_TABLE = "clusters/catalogue/gpus.toml"  # the bundled table, named by its place in the source tree
# Seconds each kernel launch adds when kernels are too short to hide it (docs/cost-model.md section 2.1): the
# value of the bundled tables, and the default of a user's table without the field.
DEFAULT_KERNEL_LAUNCH_US = 5.0


@dataclass(frozen=True)
class GpuSpec:
    """One [[gpu]] table."""

    name: str
    dense_fp16_tflops: float
    dense_bf16_tflops: float
    memory_gib: float
    memory_bandwidth_gb_per_s: float
    intra_node_link: str
    link_bytes_per_s: float
    matmul_efficiency: float
    source: str
    date: str
    kernel_launch_us: float = DEFAULT_KERNEL_LAUNCH_US
    sm_count: int | None = None
    allreduce_busbw: tuple[tuple[float, float], ...] = ()
    dense_fp8_tflops: float = 0.0  # 0: no FP8 tensor cores
    fp8_matmul_efficiency: float | None = None  # achievable fraction of the FP8 peak (given with dense_fp8_tflops)
    # what a large GEMM keeps run back to back at the board's power limit, as training runs: fractions of the peaks
    sustained_matmul_efficiency: float | None = None
    sustained_fp8_matmul_efficiency: float | None = None
    compute_capability: str | None = None  # "9.0": which FP8 recipes Transformer Engine runs (fasop.cost.fp8)
    nvlink_domain_gpus: int | None = None  # GPUs sharing one NVLink domain across nodes (GB200 NVL72: 72)
    attention_tflops: tuple[tuple[float, float, float, float, float], ...] = ()  # fused attention's measured speeds
    file: str = ""

    def peak_flops(self, precision: str, model_name: str = "") -> float:
        """Dense tensor-core FLOP/s for a model trained in `precision` (fp8: of the bf16 work around its GEMMs)."""
        precision = "bf16" if precision == "fp8" else precision
        if precision == "fp32":
            raise InputError(f"model {model_name}".strip(),
                             "precision fp32: the GPU table gives only fp16 and bf16 tensor-core peaks")
        tflops = self.dense_bf16_tflops if precision == "bf16" else self.dense_fp16_tflops
        if tflops <= 0:
            raise InputError(f"gpu {self.name}",
                             f"has no {precision} peak in {self.file} (dense_{precision}_tflops = 0); "
                             f"model {model_name} trains in {precision}")
        return tflops * 1e12

    @property
    def training_matmul_efficiency(self) -> float:
        """The fraction of the bf16/fp16 peak matmuls reach in training: sustained at the power limit where the
        table measured it, else the benchmark's."""
        return self.sustained_matmul_efficiency or self.matmul_efficiency

    @property
    def training_fp8_matmul_efficiency(self) -> float | None:
        return self.sustained_fp8_matmul_efficiency or self.fp8_matmul_efficiency

    def timed_alone(self) -> GpuSpec:
        """This GPU as benchmarks time a kernel alone, at boost clock: without its sustained efficiencies."""
        return replace(self, sustained_matmul_efficiency=None, sustained_fp8_matmul_efficiency=None)

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_bandwidth_gb_per_s * 1e9

    @property
    def kernel_launch_s(self) -> float:
        return self.kernel_launch_us * 1e-6


def _link(text: Any) -> Any:
    bandwidth_bytes_per_s(text)  # refuses what is not a bandwidth
    return text


def _pairs(value: Any) -> Any:
    """TOML arrays as tuples (strict mode takes a tuple only as a tuple); anything else is left to be refused."""
    if isinstance(value, list) and all(isinstance(point, list) for point in value):
        return tuple(tuple(point) for point in value)
    return value


def _increasing_payloads(curve: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    payloads = [payload for payload, _ in curve]
    if any(later <= earlier for earlier, later in zip(payloads, payloads[1:])):
        raise ValueError("payload sizes must increase from one point to the next")
    return curve


# Least figures of a GPU table: far below any GPU that trains (the bundled table's slowest: T4, 65 TFLOP/s; L4, 300
# GB/s of memory), yet large enough that every time the roofline divides by them stays finite and readable (1e-300
# TFLOP/s gives steps of 300 digits; times an efficiency as small, a division by 0).
MIN_TFLOPS = 0.01
MIN_EFFICIENCY = 0.01  # of peak
MIN_MEMORY_GB_PER_S = 1.0
# A measured all-reduce's bus bandwidth, GB/s, may be as low as the slowest link a file gives (1 kB/s): at its
# tiniest payloads a measured curve is latency-bound (some microseconds for 8 bytes: about 0.001 GB/s).
MIN_BUSBW_GB_PER_S = MIN_BANDWIDTH_BYTES_PER_S / 1e9


def _none_or_at_least_min(tflops: float) -> float:
    """A peak of 0 says the GPU has none; any other is at least MIN_TFLOPS."""
    if 0 < tflops < MIN_TFLOPS:
        raise ValueError(f"expected 0 (none) or a number >= {MIN_TFLOPS:g}, got {tflops!r}")
    return tflops


NoneOrAtLeastMin = AfterValidator(_none_or_at_least_min)


# [payload_bytes, busbw_gb_per_s] points of a measured all-reduce (nccl-tests' bus bandwidth), 2 to 64 of them
BusbwPoint = tuple[Annotated[float, Range(1.0, 2.0**50)], Annotated[float, Range(MIN_BUSBW_GB_PER_S, 1e5)]]
BusbwCurve = Annotated[tuple[BusbwPoint, ...], Field(min_length=2, max_length=64), BeforeValidator(_pairs),
                       AfterValidator(_increasing_payloads),
                       expected("an array of 2 to 64 [payload_bytes, busbw_gb_per_s] pairs, payloads increasing "
                                f"from 1 to 2^50 bytes, bandwidths >= {MIN_BUSBW_GB_PER_S:g} and <= 100000")]


def _attention_rows(rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    for head_dim in {row[0] for row in rows}:
        lengths = [row[1] for row in rows if row[0] == head_dim]
        if len(lengths) < 2 or any(later <= earlier for earlier, later in zip(lengths, lengths[1:])):
            raise ValueError(f"head dim {head_dim:g}: 2 or more sequence lengths, increasing from row to row")
    return rows


# [head_dim, seq_length, forward_causal_tflops, forward_tflops, backward_tflops] of a fused attention kernel
_Speed = Annotated[float, Range(MIN_TFLOPS, 1e5)]
AttentionPoint = tuple[Annotated[float, Range(1.0, 4096.0)], Annotated[float, Range(1.0, 2.0**24)], _Speed, _Speed,
                       _Speed]
AttentionTable = Annotated[tuple[AttentionPoint, ...], Field(min_length=2, max_length=64), BeforeValidator(_pairs),
                           AfterValidator(_attention_rows),
                           expected("an array of 2 to 64 [head_dim, seq_length, forward_causal_tflops, "
                                    "forward_tflops, backward_tflops] rows, each head dim at 2 or more lengths, "
                                    f"increasing, speeds >= {MIN_TFLOPS:g} and <= 100000")]


class GpuTable(Table):
    """One [[gpu]] table."""

    name: Name
    dense_fp16_tflops: Annotated[float, Range(MIN_TFLOPS, 1e4)]
    dense_bf16_tflops: Annotated[float, Range(0.0, 1e4), NoneOrAtLeastMin]  # 0 means "no bf16"
    memory_gib: Annotated[float, Range(0.0, 1024.0, low_allowed=False)]
    memory_bandwidth_gb_per_s: Annotated[float, Range(MIN_MEMORY_GB_PER_S, 1e5)]
    intra_node_link: Annotated[str, BeforeValidator(_link)]
    matmul_efficiency: Annotated[float, Range(MIN_EFFICIENCY, 1.0)]
    kernel_launch_us: Annotated[float, Range(0.0, 1000.0)] = DEFAULT_KERNEL_LAUNCH_US
    sm_count: Annotated[int, Range(1, 4096)] | None = None
    allreduce_busbw: BusbwCurve = ()
    dense_fp8_tflops: Annotated[float, Range(0.0, 1e5), NoneOrAtLeastMin] = 0.0  # 0 means "no FP8 tensor cores"
    fp8_matmul_efficiency: Annotated[float, Range(MIN_EFFICIENCY, 1.0)] | None = None
    sustained_matmul_efficiency: Annotated[float, Range(MIN_EFFICIENCY, 1.0)] | None = None
    sustained_fp8_matmul_efficiency: Annotated[float, Range(MIN_EFFICIENCY, 1.0)] | None = None
    compute_capability: Annotated[str, Field(pattern=r"^[0-9]{1,2}\.[0-9]$"), expected("a compute capability such as "
                                                                                      "9.0")] | None = None
    nvlink_domain_gpus: Annotated[int, Range(1, 2**16)] | None = None
    attention_tflops: AttentionTable = ()
    source: Text = ""
    date: Text = ""

    @model_validator(mode="after")
    def _fp8_needs_its_figures(self) -> GpuTable:
        if self.dense_fp8_tflops > 0 and (self.fp8_matmul_efficiency is None or self.compute_capability is None):
            raise ValueError("a GPU with dense_fp8_tflops > 0 gives fp8_matmul_efficiency and compute_capability too")
        return self

    @model_validator(mode="after")
    def _sustained_at_most_burst(self) -> GpuTable:
        """A power limit slows a GEMM, never speeds it up; an FP8 figure needs FP8 tensor cores."""
        if self.sustained_fp8_matmul_efficiency is not None and self.dense_fp8_tflops <= 0:
            raise ValueError("sustained_fp8_matmul_efficiency needs dense_fp8_tflops > 0")
        for sustained, burst in (("sustained_matmul_efficiency", "matmul_efficiency"),
                                 ("sustained_fp8_matmul_efficiency", "fp8_matmul_efficiency")):
            if (getattr(self, sustained) or 0.0) > (getattr(self, burst) or 1.0):
                raise ValueError(f"{sustained} {getattr(self, sustained):g} is above {burst} {getattr(self, burst):g}: "
                                 "a GEMM run back to back at the power limit is never faster than one timed alone")
        return self


class GpuFile(Table):
    gpu: list[GpuTable] = Field(min_length=1)


def gpu_tables(entries: Any, file: str) -> dict[str, GpuSpec]:
    """The [[gpu]] tables of one file (`entries`, the value of its `gpu` key), by name."""
    return _specs(validated(GpuFile, {"gpu": entries}, file), file)


def _specs(tables: GpuFile, file: str) -> dict[str, GpuSpec]:
    specs: dict[str, GpuSpec] = {}
    for table in tables.gpu:
        if table.name in specs:
            raise InputError(f"{file}: gpu.{table.name}.name", f"GPU {table.name!r} is listed twice")
        specs[table.name] = GpuSpec(**dict(table), link_bytes_per_s=bandwidth_bytes_per_s(table.intra_node_link),
                                    file=file)
    return specs


def gpu_table_path() -> Path:
    return bundled.data_dir("clusters") / "catalogue" / "gpus.toml"


def load_gpu_specs(path: Path | None = None) -> dict[str, GpuSpec]:
    """Every GPU of a spec file (default: the bundled clusters/catalogue/gpus.toml), by name."""
    path = Path(path) if path is not None else gpu_table_path()
    shown = GPU_TABLE if path == gpu_table_path() else str(path)
    return _specs(validated(GpuFile, read_toml(path), shown), shown)


def merged_specs(catalogue: Path | None = None, own: dict[str, GpuSpec] | None = None) -> dict[str, GpuSpec]:
    """The bundled GPUs, then those of a --catalogue file, then `own` (a cluster file's), later ones winning."""
    specs = load_gpu_specs()
    if catalogue is not None:
        specs.update(load_gpu_specs(catalogue))
    specs.update(own or {})
    return specs


def load_gpu_spec(gpu: str, catalogue: Path | None = None, own: dict[str, GpuSpec] | None = None) -> GpuSpec:
    """The spec of the GPU named `gpu`; an unknown name is refused with the list of known ones."""
    specs = merged_specs(catalogue, own)
    if gpu not in specs:
        hint = [known for known in specs if known.lower() == gpu.lower()]
        did_you_mean = f"; did you mean {hint[0]}?" if hint else ""
        where = f"the bundled {GPU_TABLE}" + (f", {catalogue}" if catalogue else "") + \
                (" or the cluster file" if own else "")
        raise ArgumentError("gpu", f"not in {where} (known: {', '.join(specs)}){did_you_mean}", gpu)
    return specs[gpu]


