"""Price of a plan and the length of a run: dollars per hour and per step, and the steps, hours and dollars of
a whole run given in steps or in tokens."""

from __future__ import annotations

import math

from fasop.errors import ArgumentError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model

# The longest run accepted, in steps and in tokens: 2^53 (9e15) is about 600 times the 1.5e13 tokens of the
# largest published pre-training runs (Llama 3: Meta, 2024), and every step count stays an exact integer in
# any JSON reader.
MAX_TRAIN_STEPS = 2**53
MAX_TRAIN_TOKENS = float(2**53)
SECONDS_PER_HOUR = 3600.0


def price_per_hour_usd(cluster: Cluster, placement: tuple[str, ...] | list[str]) -> float:
    """Dollars per hour of the nodes of a placement."""
    return sum(cluster.node_types[n].price_per_hour_usd for n in placement)


def cost_per_step_usd(hourly_price_usd: float, step_time_s: float) -> float:
    """Dollars of one step of `step_time_s` seconds on nodes that cost `hourly_price_usd` an hour together."""
    return hourly_price_usd * step_time_s / SECONDS_PER_HOUR


def check_run_length(train_steps: int | None, train_tokens: float | None) -> None:
    """A run is given in steps or in tokens, not both, and is positive and finite."""
    if train_steps is not None and train_tokens is not None:
        raise ArgumentError("train_tokens", "give either train_steps or train_tokens, not both")
    if train_steps is not None and not 1 <= train_steps <= MAX_TRAIN_STEPS:
        raise ArgumentError("train_steps", "expected 1 to 2^53 steps", train_steps)
    if train_tokens is not None and not math.isfinite(train_tokens):
        raise ArgumentError("train_tokens", "expected a finite number of tokens", train_tokens)
    if train_tokens is not None and not 0 < train_tokens <= MAX_TRAIN_TOKENS:
        raise ArgumentError("train_tokens", "expected a positive number of tokens up to 2^53", train_tokens)


def run_steps(gbs: int, model: Model, train_tokens: float) -> int:
    """Steps of a run of `train_tokens` tokens, rounded up."""
    return math.ceil(train_tokens / (gbs * model.seq_length))


def add_training_run(row: dict, model: Model, train_steps: int | None, train_tokens: float | None) -> None:
    """Steps, hours and dollars of the whole run, from a step count or a token count."""
    if train_steps is not None:
        steps = train_steps
    elif train_tokens is not None:
        steps = run_steps(row["gbs"], model, train_tokens)
    else:
        return
    row["train_steps"] = int(steps)
    row["train_hours"] = row["step_time_s"] * steps / SECONDS_PER_HOUR
    row["train_cost_usd"] = row["cost_per_step_usd"] * steps
