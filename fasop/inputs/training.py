"""A model's training hyperparameters: the `[training]` table of its model file (docs/formats.md), with
overrides, in Megatron-LM's argument names. A key left out is not passed, so Megatron-LM's own default applies
(megatron/training/arguments.py); `lr` has none there and a full run needs one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fasop.errors import ArgumentError, InputError
from fasop.inputs import bundled
from fasop.inputs.tomlfile import Range, Table, Text, read_toml, validated

Rate = Annotated[float, Range(0.0, 10.0, low_allowed=False)]
Fraction = Annotated[float, Range(0.0, 1.0)]
Beta = Annotated[float, Range(0.0, 1.0, low_allowed=False)]


class TrainingTable(Table):
    """The [training] table; each key is the Megatron-LM argument of that name."""

    lr: Rate | None = None
    min_lr: Annotated[float, Range(0.0, 10.0)] | None = None
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] | None = None
    lr_warmup_fraction: Fraction | None = None
    lr_warmup_iters: Annotated[int, Range(0, 2**31 - 1)] | None = None
    weight_decay: Annotated[float, Range(0.0, 10.0)] | None = None
    adam_beta1: Beta | None = None
    adam_beta2: Beta | None = None
    adam_eps: Annotated[float, Range(0.0, 1.0, low_allowed=False)] | None = None
    clip_grad: Annotated[float, Range(0.0, 1e6)] | None = None
    init_method_std: Annotated[float, Range(0.0, 10.0, low_allowed=False)] | None = None
    source: Text | None = None  # where the values come from


class _TrainingOf(Table):
    """The model file as this module reads it: its [training] table alone."""

    training: TrainingTable


def _number(text: str) -> Any:
    """A command-line value as TOML would read it: an integer or a number where it is one, else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def training_settings(model: Any, overrides: Mapping[str, str] | None = None) -> TrainingTable:
    """The model file's [training] table (none for a model made in Python), with `overrides` (key -> value as
    text, e.g. from `training=lr=3e-4`) over it; errors name the file and key, or the `training` argument."""
    table: dict[str, Any] = {}
    file = getattr(model, "file", "")
    warmup = {"lr_warmup_fraction", "lr_warmup_iters"}
    if file:
        path = bundled.resolve("models", file, ".toml")
        raw = {"training": read_toml(path).get("training", {})}
        table = validated(_TrainingOf, raw, str(path)).training.model_dump(exclude_none=True)
        if warmup <= set(table):
            raise InputError(f"{path}: training", "gives both lr_warmup_fraction and lr_warmup_iters; Megatron-LM "
                                                  "takes one")
    for key, text in (overrides or {}).items():
        if key not in TrainingTable.model_fields or key == "source":
            known = ", ".join(k for k in TrainingTable.model_fields if k != "source")
            raise ArgumentError("training", f"unknown key {key!r} (known: {known})", f"{key}={text}")
        table[key] = _number(text)
    try:
        settings = validated(TrainingTable, table, "training")
    except InputError as err:  # an override: the file's own values were read above
        raise ArgumentError("training", f"{err.where.removeprefix('training: ')}: {err.problem}") from None
    if settings.lr_warmup_fraction is not None and settings.lr_warmup_iters is not None:
        raise ArgumentError("training", "gives both lr_warmup_fraction and lr_warmup_iters (with the model file's "
                                        "[training] table); Megatron-LM takes one")
    return settings
