"""Site options of `fasop emit`: what differs between sites (Slurm partition, GRES types, paths, container,
tokenizer), from a cluster's `[launch]` table and the command line, checked so that every value can be
written into a script unquoted where Slurm reads it."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import MAX_CPUS_PER_NODE, MAX_GPUS_PER_NODE
from fasop.plans import MAX_PLAN_INT

# Characters Slurm reads unquoted in "#SBATCH --key=value" lines; always applied with fullmatch (a pattern
# ending in "$" would also accept a trailing newline, which ends the directive and starts a shell line).
FLAVORS = ("stock", "fasop-fork")


PIPELINE_SPLITS = ("auto", "layout", "first-last")


SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


SLURM_LIST = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")


# Paths that FlagScale's runner writes unquoted into the scripts it runs on every node, and Hydra reads as
# override values (fasop.launch.flagscale_scripts)
SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")
SAFE_PATH_RULE = "a path of letters, digits and _ . / + -"


SLURM_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}", re.ASCII)
# Slurm's controller gives a job without a time limit an end time 365 days after its start (YEAR_SECONDS in its
# sources): no job needs a longer limit, nor a longer stop margin.
MAX_TIME_LIMIT_S = 365 * 86400
# The integer options' maxima. Iterations as a plan's train_steps: sbatch.sh compares them in bash's signed 64-bit
# arithmetic, where a larger number may wrap to a negative one.
INTEGER_MAXIMA = {"gpus_per_node": MAX_GPUS_PER_NODE, "cpus_per_task": MAX_CPUS_PER_NODE, "train_iters": MAX_PLAN_INT,
                  "save_interval": MAX_PLAN_INT, "stop_margin_s": MAX_TIME_LIMIT_S}
# Options that Megatron-LM, torchrun or FlagScale's runner take as a flag's argument (or cd as its directory): a
# value starting with "-" would be read as a flag of its own.
FLAG_ARGUMENTS = ("checkpoint_dir", "megatron_path", "data_path", "tokenizer_type", "vocab_file", "merge_file",
                  "tokenizer_model", "flagscale_dir")


@dataclass(frozen=True)
class LaunchOptions:
    """What differs between sites. Defaults may come from the cluster file's `[launch]` table."""

    partition: str | None = None  # Slurm partition for every node type
    partitions: Mapping[str, str] = field(default_factory=dict)  # node-type or GPU name -> partition
    gres_type: str | None = None  # GRES type for every node type
    gres_types: Mapping[str, str] = field(default_factory=dict)  # node-type or GPU name -> GRES type
    gpus_per_node: int | None = None  # override of the cluster's gpus_per_node
    cpus_per_task: int | None = None  # CPUs for the one task per node (torchrun and its workers)
    account: str | None = None
    exclusive: bool = True
    job_name: str | None = None  # default fasop-<model>
    time_limit: str = "01:00:00"
    megatron_path: str = "Megatron-LM"
    entry_script: str | None = None  # default by architecture; relative paths are inside megatron_path
    data_path: str | None = None  # None: --mock-data
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    container_image: str | None = None  # enroot/pyxis image; None: no container
    container_mounts: str | None = None  # pyxis --container-mounts, besides the run directory
    extra_flags: tuple[str, ...] = ()  # appended to the Megatron-LM flags (later flags win)
    train_iters: int | None = None  # default: the plan's train_steps (fasop.launch.resume)
    smoke_test: bool = False  # a short run (mock data without a data path), the only run without train_steps
    checkpoint_dir: str = "checkpoints"  # Megatron-LM --save and --load; relative: to the run directory
    save_interval: int | None = None  # iterations between checkpoints (default: about an hour's)
    stop_margin_s: int = 600  # each job saves and stops this long before its time limit
    training: Mapping[str, str] = field(default_factory=dict)  # [training] keys over the model file's
    master_port: int = 6000
    megatron_flavor: str = "stock"
    pipeline_split: str = "auto"
    flagscale_dir: str = "FlagScale"  # stage-group plans: the FlagScale checkout; relative: to the run directory


def _check_slurm_names(opts: LaunchOptions, bad: Callable[[str, str], InputError]) -> None:
    """Partitions, GRES types (empty: none), account and job name: what #SBATCH lines hold unquoted."""
    def slurm_name(value: Any, pattern: re.Pattern, empty_ok: bool) -> bool:
        return isinstance(value, str) and (bool(pattern.fullmatch(value)) or (empty_ok and value == ""))

    for key, pattern in (("partition", SLURM_LIST), ("gres_type", SLURM_NAME), ("account", SLURM_NAME),
                         ("job_name", SLURM_NAME)):
        value = getattr(opts, key)
        if value is not None and not slurm_name(value, pattern, key == "gres_type"):
            raise bad(key, f"expected a Slurm name (letters, digits, _ . + -), got {value!r}")
    for key, pattern in (("partitions", SLURM_LIST), ("gres_types", SLURM_NAME)):
        for name, value in getattr(opts, key).items():
            if not slurm_name(value, pattern, key == "gres_types"):
                raise bad(f"{key[:-1]}.{name}", f"expected a Slurm name (letters, digits, _ . + -), got {value!r}")


def _refusal(where: str | None) -> Callable[[str, str], InputError]:
    """The error of a bad option `key`: naming `where` and the key (a cluster file's [launch] table), or without
    `where` the argument that gave it (a per-node-type entry such as partition.A100 is one of `partitions`)."""
    def bad(key: str, problem: str) -> InputError:
        if where is None:
            argument, _, entry = key.partition(".")
            return ArgumentError(argument + ("s" if entry else ""), f"{entry}: {problem}" if entry else problem)
        return InputError(f"{where}{key}", problem)

    return bad


def check_options(opts: LaunchOptions, where: str | None = None) -> None:
    """The options checked; errors name `where` and the key, or the argument that gave it (_refusal)."""
    bad = _refusal(where)

    if opts.megatron_flavor not in FLAVORS:
        raise bad("megatron_flavor", f"expected one of {', '.join(FLAVORS)}, got {opts.megatron_flavor!r}")
    if opts.pipeline_split not in PIPELINE_SPLITS:
        raise bad("pipeline_split", f"expected one of {', '.join(PIPELINE_SPLITS)}, got {opts.pipeline_split!r}")
    _check_numbers(opts, bad)
    _check_slurm_names(opts, bad)
    _check_paths(opts, bad)
    for key in ("exclusive", "smoke_test"):
        if not isinstance(getattr(opts, key), bool):
            raise bad(key, f"expected true or false, got {getattr(opts, key)!r}")
    if any(not isinstance(f, str) or "\n" in f or "\0" in f for f in opts.extra_flags):
        raise bad("extra_flags", "expected one-line strings")


def time_limit_s(text: str) -> int:
    """Seconds of a Slurm time (SLURM_TIME): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hms = (parts + [0, 0])[:3]
        return int(days) * 86400 + hms[0] * 3600 + hms[1] * 60 + hms[2]
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def _slurm_time(value: Any) -> bool:
    """Whether `value` is a Slurm time of at most MAX_TIME_LIMIT_S."""
    if not isinstance(value, str) or not SLURM_TIME.fullmatch(value):
        return False
    try:
        return time_limit_s(value) <= MAX_TIME_LIMIT_S
    except ValueError:  # a number of more digits than int() reads (sys.get_int_max_str_digits): far beyond it
        return False


def _check_numbers(opts: LaunchOptions, bad: Callable[[str, str], InputError]) -> None:
    """The integer options in their ranges, the port and the time limit: every number a script holds."""
    for key, maximum in INTEGER_MAXIMA.items():
        value = getattr(opts, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum):
            raise bad(key, f"expected an integer from 1 to {maximum:,}, got {value!r}")
    port = opts.master_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise bad("master_port", f"expected a port number 1-65535, got {port!r}")
    if not _slurm_time(opts.time_limit):
        raise bad("time_limit", f"expected a Slurm time of at most {MAX_TIME_LIMIT_S // 86400} days such as 90, 01:30:00 "
                                f"or 1-12:00:00, got {opts.time_limit!r}")


def _check_paths(opts: LaunchOptions, bad: Callable[[str, str], InputError]) -> None:
    """Paths and names that reach scripts quoted: one line each, and none that a program would take for a flag
    (FLAG_ARGUMENTS); the FlagScale checkout: a SAFE_PATH."""
    if not isinstance(opts.flagscale_dir, str) or not SAFE_PATH.fullmatch(opts.flagscale_dir):
        raise bad("flagscale_dir", f"expected {SAFE_PATH_RULE}, got {opts.flagscale_dir!r}")
    for key in ("checkpoint_dir", "megatron_path", "entry_script", "data_path", "tokenizer_type", "vocab_file", "merge_file",
                "tokenizer_model", "container_image", "container_mounts"):
        value = getattr(opts, key)
        if value is not None and (not isinstance(value, str) or not value or "\n" in value or "\0" in value):
            raise bad(key, f"expected a non-empty one-line string, got {value!r}")
    for key in FLAG_ARGUMENTS:
        value = getattr(opts, key)
        if value is not None and value.startswith("-"):
            raise bad(key, f"{value!r} would be read as a flag; expected a value not starting with '-' (a relative "
                           f"path as ./{value})")


def _str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InputError(where, "expected a string or a table of strings keyed by node-type or GPU name")
    return dict(value)


def split_flags(value: Any, where: str) -> tuple[str, ...]:
    """Extra Megatron-LM flags: a list of arguments, or one string split as a shell would."""
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as err:
            raise InputError(where, f"cannot split {value!r} into arguments ({err})") from None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InputError(where, f"expected a string or a list of strings, got {value!r}")


LAUNCH_KEYS = (
    "partition", "gres_type", "gpus_per_node", "cpus_per_task", "account", "exclusive", "job_name", "time_limit",
    "megatron_path", "entry_script", "data_path", "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
    "container_image", "container_mounts", "extra_flags", "train_iters", "master_port", "megatron_flavor",
    "pipeline_split", "checkpoint_dir", "save_interval", "stop_margin_s", "flagscale_dir",
)


def launch_options(launch: Mapping[str, Any] | None = None, where: str = "[launch]", **overrides: Any) -> LaunchOptions:
    """LaunchOptions from a cluster's `[launch]` table, then `overrides` (None values are ignored).

    `partition` and `gres_type` in the table may be a string (every node type) or a table keyed by node-type
    or GPU name. Overrides `partitions` / `gres_types` are merged over the table's; `extra_flags` are appended
    to the table's.
    """
    launch = dict(launch or {})
    prefix = f"{where}."
    values: dict[str, Any] = {}
    for key, value in launch.items():
        if key not in LAUNCH_KEYS:
            raise InputError(f"{prefix}{key}", f"unknown key (known: {', '.join(sorted(LAUNCH_KEYS))})")
        if key in ("partition", "gres_type") and not isinstance(value, str):
            values[key + "s"] = _str_map(value, f"{prefix}{key}")
        elif key == "extra_flags":
            values[key] = split_flags(value, f"{prefix}{key}")
        else:
            values[key] = value
    opts = LaunchOptions(**values)
    check_options(opts, prefix)
    known = {f.name for f in fields(LaunchOptions)}
    merged: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in known:
            raise TypeError(f"unknown launch option {key!r}")
        if value is None:
            continue
        if key in ("partitions", "gres_types"):
            merged[key] = {**getattr(opts, key), **value}
        elif key == "extra_flags":
            merged[key] = tuple(opts.extra_flags) + tuple(value)
        else:
            merged[key] = value
    opts = replace(opts, **merged)
    check_options(opts)
    return opts
