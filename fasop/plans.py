"""The plan record and plan files: `Plan` (with its `Stage` rows, or the `TypeShare` rows of data-parallel kinds)
is what a search or an estimate returns, what `fasop search --output` writes (JSON or CSV) and what `fasop emit`,
`fasop plot`, calibration and fasop.runtime read back (docs/formats.md publishes its JSON schema)."""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, WrapValidator, model_validator

from fasop.errors import ArgumentError, InputError
from fasop.files import MIB, PLANS_LIMIT_BYTES, check_finite, read_json, write_atomically
from fasop.inputs.cluster import MAX_GPUS_PER_NODE
from fasop.inputs.model import MAX_LAYERS, MAX_SEQ_LENGTH
from fasop.inputs.names import NAME, NAME_RULE
from fasop.inputs.tomlfile import Range, Table, expected, validated

MAX_PLAN_INT = 2**53  # ranks, degrees, batch sizes and layer counts of a plan file: exact in any JSON reader
DATA_PARALLEL_KINDS = ("ddp", "zero1", "zero2", "zero3")
# the decimals the ranked table prints each ranking figure with: a search that keeps the table's first rows keeps
# every plan whose figure prints as one of theirs (fasop.search.evaluation.Cut)
PRINTED_DECIMALS = {"step_time_s": 4, "cost_per_step_usd": 5}
CSV_LISTS = ("synthesised_profiles", "placement", "layers_per_stage", "layers_per_virtual_stage")
# Joins the items of a list in one CSV cell: a space is outside the character set of names (fasop.inputs.names),
# so every node-type name reads back whole ("-" is inside it).
CSV_LIST_SEPARATOR = " "
# Nodes a placement text may expand to (`A10*N`), as many as the GPUs a searched plan may span
# (fasop.search.space.MAX_PLAN_GPUS): reading one then takes work and memory bounded by the placement it gives,
# not by the counts written in it.
MAX_PLACEMENT_NODES = 2**18
MAX_PLAN_LAYERS = 2 * MAX_LAYERS  # an encoder-decoder model's encoder and decoder hold up to MAX_LAYERS each


def _listed(what: str, least: int, value: Any, handler: Callable[[Any], Any]) -> Any:
    if not isinstance(value, list) or len(value) < least:
        raise ValueError(f"expected a list of {'one or more ' if least else ''}{what}, got {value!r:.60}")
    return handler(value)


def listed(what: str, least: int = 0) -> WrapValidator:
    """Annotated metadata of a list field: another type, or fewer than `least` entries, reads `expected a list of
    [one or more] <what>, got ...`, in a JSON file's words (the schema's own error names TOML's [[tables]]); an
    error of one entry still names the entry."""
    return WrapValidator(partial(_listed, what, least))


Count = Annotated[int, Range(1, MAX_PLAN_INT)]
Index = Annotated[int, Range(0, MAX_PLAN_INT)]
# names are held to the rule of the input files they come from (fasop.inputs.names): they reach charts, pages and
# emitted scripts
NAME_PATTERN = f"^{NAME.pattern}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN), expected(NAME_RULE)]
NodeType = Annotated[str, Field(pattern=NAME_PATTERN), expected(f"a node-type name, {NAME_RULE}")]
# a stage's GPU type, or the types its ranks span joined by + ("A100+A10")
GpuTypes = Annotated[str, Field(pattern=f"^{NAME.pattern}(\\+{NAME.pattern})*$"),
                     expected(f"GPU type names joined by +, each {NAME_RULE}")]
# Megatron-LM's --recompute-modules that fasop models (fasop.cost.roofline.RECOMPUTE_MODULES)
RecomputeModule = Literal["core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "shared_experts"]


class Chunk(Table):
    """One model chunk of a stage of an interleaved plan: seconds per micro-batch."""

    forward_s: float
    recompute_s: float  # forwards recomputed right before the backward
    backward_s: float  # the backward itself, without the recomputed forwards


class Stage(Table):
    """One pipeline stage of a 3D or stage-group plan: seconds per micro-batch, memory of its most loaded GPU."""

    stage: Index
    gpu: GpuTypes  # the stage's GPU type; "A100+A10" for a stage whose ranks span two types
    nodes: Annotated[list[Index], listed("node positions")]  # node ranks (positions in the placement) holding the stage
    layers: Index
    # stage-group plans: the stage's own tensor- and data-parallel degrees and each of its GPUs' micro-batch
    tp: Count | None = None
    dp: Count | None = None
    mbs: Count | None = None
    compute_s: float  # forward and backward of one micro-batch, with the forwards it recomputes
    forward_s: float | None = None  # the forward part of compute_s
    recompute_s: float | None = None  # the recomputed forwards in compute_s
    send_s: float | None = None  # one micro-batch's activation sent to the next stage (0 on the last)
    p2p_s: float  # its sends and receives per micro-batch
    dp_allreduce_s: float
    memory_gib: float
    memory_capacity_gib: float
    # interleaved plans: each model chunk of the stage, in chunk order
    chunks: Annotated[list[Chunk], listed("chunk objects")] | None = None


class TypeShare(Table):
    """The GPUs of one node type in a data-parallel plan and their share of the global batch."""

    node_type: NodeType
    gpu: Name
    gpus: Count
    samples_per_gpu: Count
    micro_batch_size: Count
    accumulation_steps: Count  # samples_per_gpu / micro_batch_size rounded up; the last micro-batch holds the rest
    compute_s: float
    memory_gib: float
    memory_capacity_gib: float


class Plan(Table):
    """One plan. The shape (degrees, batch sizes, placement, layers per stage) is required; every figure is
    optional (a plan file may state only some, and `fasop emit` fills in the rest from a fresh estimate).
    Fields are declared in the order plan files write them; a field is written only when it was given."""

    rank: Count | None = None
    family: str | None = None  # fasop compare: the strategies this plan is the best of
    model: Name | None = None
    model_file: str | None = None
    # tokens per sample where not the model file's (--seq-length)
    seq_length: Annotated[int, Range(1, MAX_SEQ_LENGTH)] | None = None
    cluster: Name | None = None
    cluster_file: str | None = None
    profiles: str | None = None  # the --profiles folder as given; absent: the bundled profiles of the model
    # GPU types without a profile, synthesised from the roofline
    synthesised_profiles: Annotated[list[Name], listed("GPU names")] | None = None
    kind: Literal["3d", "stage-groups", "ddp", "zero1", "zero2", "zero3"] = "3d"
    batch_split: Literal["even", "uneven"] | None = None
    gbs: Count
    mbs: Count  # stage-group plans: the first stage's (each stage's GPUs take mbs x dp / its own dp)
    tp: Count  # stage-group plans: the first stage's (each stage row has its own)
    dp: Count
    pp: Count
    cp: Count | None = None  # context-parallel degree (absent: 1); world = tp cp dp pp
    ep: Count | None = None  # MoE models: expert-parallel degree (absent: 1)
    etp: Count | None = None  # MoE models: expert-tensor-parallel degree (absent: tp)
    num_microbatches: Count | None = None
    placement: Annotated[list[NodeType], Field(min_length=1), listed("node-type names", 1)]
    gpus_per_node: Count | None = None
    layers_per_stage: Annotated[list[Index], Field(min_length=1), listed("layer counts", 1)]
    encoder_stages: Index = 0
    distributed_optimizer: bool | None = None
    overlap_grad_reduce: bool | None = None  # Megatron's --overlap-grad-reduce
    overlap_param_gather: bool | None = None  # Megatron's --overlap-param-gather
    virtual_stages: Count | None = None  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    # layers of each virtual stage, chunk-major (chunk c of stage i is entry c * pp + i); each stage's layers split
    # as evenly as can be, the first chunks taking one more
    layers_per_virtual_stage: Annotated[list[Index], listed("layer counts")] | None = None
    # how step_time_s was found: "exact-schedule", Megatron's 1F1B schedule timed exactly (docs/cost-model.md 4.1)
    timing: Literal["exact-schedule"] | None = None
    recompute: Literal["none", "selective", "full"] | None = None  # --recompute-granularity (none: left out)
    recompute_method: Literal["uniform", "block"] | None = None  # full only
    recompute_num_layers: Count | None = None  # full only
    # selective only: --recompute-modules (absent: Megatron-LM's default, the attention core)
    recompute_modules: Annotated[list[RecomputeModule], Field(min_length=1), listed("module names", 1)] | None = None
    sequence_parallel: bool | None = None
    tp_comm_overlap: bool | None = None  # Megatron's --tp-comm-overlap (Transformer Engine's userbuffers)
    # an fp8 plan's precision, scaling recipe and --fp8-param-gather (absent: the model file's precision, not fp8)
    precision: Literal["fp16", "bf16", "fp32", "fp8"] | None = None
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] | None = None
    fp8_param_gather: bool | None = None
    step_time_s: float | None = None
    throughput_samples_per_s: float | None = None
    tokens_per_s: float | None = None
    compute_s: float | None = None
    pipeline_time_s: float | None = None
    bubble_s: float | None = None
    p2p_s: float | None = None
    dp_allreduce_s: float | None = None
    embedding_allreduce_s: float | None = None
    dp_exposed_s: float | None = None  # data-parallel traffic the overlap leaves exposed on the slowest stage
    optimizer_s: float | None = None  # the optimizer step of the slowest stage
    closed_form_step_s: float | None = None  # the closed form the partitioner optimised (an estimate, not a bound)
    wrap_send_s: float | None = None  # interleaved plans: one micro-batch's send from the last stage to the first
    recompute_s: float | None = None  # forwards the bottleneck stage (largest compute) recomputes per step
    peak_memory_gib: float | None = None
    memory_capacity_gib: float | None = None
    cost_per_hour_usd: float | None = None
    cost_per_step_usd: float | None = None
    placement_search: Literal["exhaustive", "type-blocks", "ilp"] | None = None
    # the integer program's relative gap, (found - bound) / found: of its own plan ("ilp"), or the bound it puts
    # on a type-blocks plan's placement
    optimality_gap: float | None = None
    stages: Annotated[list[Stage], listed("stage objects")] | None = None
    per_type: Annotated[list[TypeShare], Field(min_length=1), listed("node-type objects", 1)] | None = None
    train_steps: Count | None = None
    train_hours: float | None = None
    train_cost_usd: float | None = None
    fits_memory: bool | None = None  # fasop estimate: whether the plan fits with the cluster's memory margin

    @model_validator(mode="after")
    def _parts_agree(self) -> Plan:
        """The rows its kind needs, and the parts that state one thing twice agree (docs/formats.md): an error
        names the field first, as the schema's errors do."""
        if self.kind in DATA_PARALLEL_KINDS and (self.per_type is None or self.gpus_per_node is None):
            raise ValueError(f"a {self.kind} plan needs per_type and gpus_per_node")
        if self.kind == "stage-groups" and (self.stages is None or any(
                s.tp is None or s.dp is None for s in self.stages)):
            raise ValueError("a stage-groups plan needs stages, each with its gpu, tp and dp")
        _check_layers(self)
        _check_stages(self)
        if self.is_stage_groups:
            _check_group_batch(self)
            _check_group_nodes(self)
        return self

    @classmethod
    def trusted(cls, record: dict[str, Any]) -> Plan:
        """A plan from a record the search or an estimate built itself (not checked again: searches build many)."""
        fields = dict(record)
        if "stages" in fields:
            fields["stages"] = [_unchecked(Stage, s if "chunks" not in s else
                                           {**s, "chunks": [Chunk.model_construct(**c) for c in s["chunks"]]})
                                for s in fields["stages"]]
        if "per_type" in fields:
            fields["per_type"] = [TypeShare.model_construct(**t) for t in fields["per_type"]]
        return cls.model_construct(**fields)

    def record(self) -> dict[str, Any]:
        """The plan as plan files hold it: the fields it was given, in declaration order."""
        return self.model_dump(exclude_unset=True)

    @property
    def is_data_parallel(self) -> bool:
        return self.kind in DATA_PARALLEL_KINDS

    @property
    def is_stage_groups(self) -> bool:
        return self.kind == "stage-groups"


def _unchecked(cls: type[Stage], values: dict[str, Any]) -> Stage:
    """`cls.model_construct(**values)` for the stage rows of a search, three times as fast: a 1,024-GPU search
    builds half a million of them. Sets what model_construct sets (the fields, defaults for the rest, which
    fields were given); tests/test_plans.py checks that the two agree."""
    row = cls.__new__(cls)
    object.__setattr__(row, "__dict__", {**_STAGE_DEFAULTS, **values})
    object.__setattr__(row, "__pydantic_fields_set__", set(values))
    object.__setattr__(row, "__pydantic_extra__", None)
    object.__setattr__(row, "__pydantic_private__", None)
    return row


_STAGE_DEFAULTS = {name: field.default for name, field in Stage.model_fields.items() if not field.is_required()}


def _check_layers(plan: Plan) -> None:
    """One entry of layers_per_stage per pipeline stage, as many layers as a model holds; and, where given, the
    layers of each stage's model chunks adding up to its own."""
    counts, pp = plan.layers_per_stage, plan.pp
    if len(counts) != pp:
        raise ValueError(f"layers_per_stage: {len(counts)} entries, expected one per pipeline stage (pp = {pp})")
    if sum(counts) > MAX_PLAN_LAYERS:
        raise ValueError(f"layers_per_stage: {sum(counts):,} layers in all, expected at most {MAX_PLAN_LAYERS:,}")
    if not plan.encoder_stages < pp:
        raise ValueError(f"encoder_stages: expected fewer than the {pp} stages, got {plan.encoder_stages}")
    chunks, v = plan.layers_per_virtual_stage, plan.virtual_stages or 1
    if chunks is None:
        return
    if len(chunks) != v * pp:
        raise ValueError(f"layers_per_virtual_stage: {len(chunks)} entries, expected virtual_stages x pp = {v * pp}")
    for i, layers in enumerate(counts):
        if sum(chunks[i::pp]) != layers:
            raise ValueError(f"layers_per_virtual_stage: the chunks of stage {i} hold {sum(chunks[i::pp])} layers, "
                             f"expected layers_per_stage[{i}] = {layers}")


def _check_stages(plan: Plan) -> None:
    """One row of stages per pipeline stage, in pipeline order, holding the layers of layers_per_stage (a row
    that holds another share of them is a stale figure, which fasop emit refuses), the times of each model chunk
    where given, on increasing positions of the placement."""
    if plan.stages is None:
        return
    if len(plan.stages) != plan.pp:
        raise ValueError(f"stages: {len(plan.stages)} rows, expected one per pipeline stage (pp = {plan.pp})")
    layers = sum(stage.layers for stage in plan.stages)
    if layers != sum(plan.layers_per_stage):
        raise ValueError(f"stages: {layers:,} layers in all, expected the {sum(plan.layers_per_stage):,} of "
                         "layers_per_stage")
    v, nodes = plan.virtual_stages or 1, len(plan.placement)
    for i, stage in enumerate(plan.stages):
        if stage.stage != i:
            raise ValueError(f"stages[{i}].stage: expected {i} (the rows in pipeline order), got {stage.stage}")
        if stage.chunks is not None and len(stage.chunks) != v:
            raise ValueError(f"stages[{i}].chunks: {len(stage.chunks)} entries, expected virtual_stages = {v}")
        increasing = all(a < b for a, b in zip(stage.nodes, stage.nodes[1:]))
        if not increasing or (stage.nodes and stage.nodes[-1] >= nodes):
            raise ValueError(f"stages[{i}].nodes: expected increasing positions among the placement's {nodes} nodes")


def _check_group_batch(plan: Plan) -> None:
    """A stage-group plan's plan-level degrees are the first stage's, and num_microbatches micro-batches of mbs x dp
    samples make the global batch (whether each stage's dp divides the micro-batch, the estimate checks against its
    cluster)."""
    assert plan.stages  # _check_stages checked that it has pp >= 1 rows
    first = plan.stages[0]
    if (plan.tp, plan.dp) != (first.tp, first.dp):
        raise ValueError(f"tp: expected the first stage's tp and dp ({first.tp}, {first.dp}), got ({plan.tp}, {plan.dp})")
    batch = plan.mbs * plan.dp
    if plan.num_microbatches is not None and plan.num_microbatches * batch != plan.gbs:
        raise ValueError(f"num_microbatches: expected gbs / (mbs x dp) = {plan.gbs} / {batch}, got {plan.num_microbatches}")


def _check_group_nodes(plan: Plan) -> None:
    """Each stage of a stage-group plan sits on a run of nodes of one type that can hold its tp x dp ranks (that
    they follow the previous stage's, the estimate and the emitter check against the cluster's nodes)."""
    for i, stage in enumerate(plan.stages or []):
        assert stage.tp is not None and stage.dp is not None  # _parts_agree checked them
        nodes = stage.nodes
        if not nodes or nodes[-1] - nodes[0] + 1 != len(nodes) or len({plan.placement[n] for n in nodes}) > 1:
            raise ValueError(f"stages[{i}].nodes: expected a run of consecutive nodes of one type")
        if stage.tp * stage.dp > MAX_GPUS_PER_NODE * len(nodes):
            raise ValueError(f"stages[{i}].dp: its tp x dp = {stage.tp * stage.dp:,} GPUs do not fit on its "
                             f"{len(nodes)} nodes of at most {MAX_GPUS_PER_NODE} GPUs")


def placement_runs(placement: Sequence[str]) -> list[tuple[str, int]]:
    """Runs of consecutive nodes of one type, in placement order: [A10, A100, A100, A10] -> 3 runs."""
    return [(name, len(list(run))) for name, run in itertools.groupby(placement)]


def compress_placement(placement: Sequence) -> str:
    """['A100', 'A10', 'A10'] -> 'A100,A10*2' (runs of one node type; numbers are joined as they are)."""
    return ",".join(str(name) if count == 1 else f"{name}*{count}" for name, count in placement_runs(placement))


def expand_placement(text: str, where: str) -> list[str]:
    """'A100,A10*2' -> ['A100', 'A10', 'A10'], the inverse of compress_placement: comma-separated items, each a
    node-type name or NAME*N (N nodes of that type in a row), spaces around names and counts ignored. An error
    names `where` and the item."""
    runs = []
    total = 0
    for number, item in enumerate(text.split(","), start=1):
        if not item.strip():
            raise InputError(where, f"item {number} is empty: expected NAME or NAME*N items separated by commas")
        shown = f"item {number} ({item.strip()!r})"
        name, star, digits = (part.strip() for part in item.partition("*"))
        if not NAME.fullmatch(name):
            raise InputError(where, f"{shown}: expected NAME or NAME*N, where NAME is {NAME_RULE}")
        if star and not (digits.isascii() and digits.isdigit() and digits.strip("0")):
            raise InputError(where, f"{shown}: expected a positive integer after '*', got {digits!r}")
        too_many = f"{shown}: more than {MAX_PLACEMENT_NODES:,} nodes in all"
        if len(digits.lstrip("0")) > len(str(MAX_PLACEMENT_NODES)):  # over the bound: never int() a long number
            raise InputError(where, too_many)
        count = int(digits) if star else 1
        total += count
        if total > MAX_PLACEMENT_NODES:
            raise InputError(where, too_many)
        runs.append((name, count))
    return [name for name, count in runs for _ in range(count)]


class PlanFile:
    """A plan list as `fasop search --output` writes it, made plan by plan while it is written (a large search's
    plans do not fit in memory as one text): JSON, best plan first, up to PLANS_LIMIT_BYTES, what fasop reads back,
    the plans ranked below that left out; or CSV, every plan, with every field any plan has (in the schema's
    order; empty where a plan has none), lists joined with spaces and the per-stage breakdown as compact JSON. A
    number that is not finite is refused (the search builds its plans unchecked); errors name `argument`."""

    def __init__(self, plans: Sequence[Plan], output: Path, argument: str = "output"):
        if output.suffix not in (".json", ".csv"):
            raise ArgumentError(argument, "expected a file name ending in .json or .csv", output)
        self.plans, self.output = plans, output
        self.written = 0  # plans written so far

    def chunks(self) -> Iterator[str]:
        return self._json() if self.output.suffix == ".json" else self._csv()

    def _records(self) -> Iterator[dict[str, Any]]:
        for plan in self.plans:
            record = plan.record()
            check_finite(record, str(self.output))
            yield record

    def _json(self) -> Iterator[str]:
        """The text json.dumps(records, indent=1) gives, one plan at a time (ASCII: its length is its size)."""
        size, end = 0, "\n]\n"
        for record in self._records():
            text = (",\n " if self.written else "[\n ") + json.dumps(record, indent=1, allow_nan=False).replace("\n", "\n ")
            size += len(text)
            if self.written and size + len(end) > PLANS_LIMIT_BYTES:
                break
            yield text
            self.written += 1
        yield end if self.written else "[]\n"

    def _csv(self) -> Iterator[str]:
        given = set().union(*(plan.model_fields_set for plan in self.plans))  # the keys of every record
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=[name for name in Plan.model_fields if name in given], lineterminator="\n")
        writer.writeheader()
        for record in self._records():
            flat = dict(record)
            for key in CSV_LISTS:
                if key in record:
                    flat[key] = CSV_LIST_SEPARATOR.join(map(str, record[key]))
            flat["stages"] = json.dumps(record["stages"], separators=(",", ":"))
            writer.writerow(flat)
            self.written += 1
            yield out.getvalue()
            out.seek(0)
            out.truncate()
        if not self.written:
            yield out.getvalue()

    def left_out(self) -> str:
        """What the CLI says when plans were left out of a JSON file, else nothing."""
        if self.written == len(self.plans):
            return ""
        return (f"; the {len(self.plans) - self.written} ranked below them are left out: a plan file holds what fasop "
                f"reads back, {PLANS_LIMIT_BYTES // MIB} MiB (a .csv file holds every plan)")


def write_plans(plans: Sequence[Plan], output: Path) -> PlanFile:
    """Write `plans` to `output` (.json or .csv) as `fasop search --output` does; what it returns counts the plans
    written."""
    plan_file = PlanFile(plans, output)
    write_atomically(output, plan_file.chunks(), str(output))
    return plan_file


class _LongInteger:
    """An integer of a plan file too long for int() (sys.get_int_max_str_digits), kept as its length: the schema
    then refuses it in the field that holds it, with that field's range, rather than the parser the whole file."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits:,} digits"


def _integer(text: str) -> int | _LongInteger:
    try:
        return int(text)
    except ValueError:  # the text of a JSON integer: too many digits
        return _LongInteger(len(text.lstrip("-")))


def read_plan_json(path: str | os.PathLike, what: str) -> Any:
    """The JSON value of a plan file (fasop.files.read_json), an integer too long for int() left to the schema,
    which names its field."""
    return read_json(path, PLANS_LIMIT_BYTES, what, missing="no such plan file", parse_int=_integer)


def read_plan(data: Any, where: str) -> Plan:
    """A plan object read from a file, checked against the schema: one line naming `where` and the field."""
    if not isinstance(data, dict):
        raise InputError(where, "not a fasop plan: expected a JSON object")
    return validated(Plan, data, where)


def load_plans(path: str | os.PathLike) -> list[Plan]:
    """The plan list a search writes (plans.json), checked to be one."""
    where = str(path)
    if str(path).endswith(".csv"):
        raise InputError(where, "expected the JSON plan list a search writes (plans.json), not its CSV")
    data = read_plan_json(path, "a fasop plan list")
    if not isinstance(data, list) or not data:
        raise InputError(where, "not a fasop plan list: expected a non-empty JSON list of plan objects")
    plans = _plan_list(data, where)
    for index, plan in enumerate(plans):
        if plan.rank is None:  # what --rank selects
            raise InputError(f"{where}: entry {index}: rank", "missing")
    return plans


def _plan_list(data: list, where: str) -> list[Plan]:
    """The plans of a plan list, no two of the same rank."""
    plans = [read_plan(plan, f"{where}: entry {index}") for index, plan in enumerate(data)]
    first: dict[int, int] = {}  # entry of each rank
    for index, plan in enumerate(plans):
        if plan.rank is not None and first.setdefault(plan.rank, index) != index:
            raise InputError(f"{where}: entry {index}: rank", f"{plan.rank} is also the rank of entry "
                                                              f"{first[plan.rank]}: expected each rank once")
    return plans


def select_plan(plans: Sequence[Plan], rank: int, where: str) -> Plan:
    """The plan whose `rank` is `rank` (1 = best)."""
    for plan in plans:
        if plan.rank == rank:
            return plan
    ranks = sorted(p.rank for p in plans if p.rank is not None)
    held = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no ranks"
    raise ArgumentError("rank", f"no such plan in {where} (it holds {len(plans)} plans, {held})", rank)


def read_plan_file(path: str | os.PathLike, rank: int = 1) -> Plan:
    """The plan in `path`: one plan object (the plan.json of `fasop emit`) or plan `rank` of a plan list."""
    data = read_plan_json(path, "a fasop plan")
    if isinstance(data, list):
        return select_plan(_plan_list(data, str(path)), rank, str(path))
    return read_plan(data, str(path))
