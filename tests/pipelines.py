"""fasop's closed-form 1F1B pipeline time of one plan (fasop.cost.pipeline), called with the per-stage lists the
event simulations and the exact schedule take, so that tests compare the code itself with them."""

from __future__ import annotations

import numpy as np

from fasop.cost.pipeline import pipeline_terms


def closed_form_terms(forward, backward, send, m: int) -> dict[str, float]:
    """pipeline_time_s, bubble_s and p2p_s; forward[i], backward[i]: seconds of one micro-batch on stage i;
    send[j]: one transfer across boundary j (entries past the last boundary are ignored)."""
    compute = np.add(forward, backward)
    boundary = np.asarray(send[: len(compute) - 1], dtype=float)
    # what each stage waits for in its steady state: the sends to and from both neighbours (blocking)
    exchange = np.concatenate([[0.0], boundary]) + np.concatenate([boundary, [0.0]])
    terms = pipeline_terms(compute[None, :], exchange[None, :], boundary[None, :], np.array([m]))
    return {name: float(value[0]) for name, value in terms.items()}


def closed_form(forward, backward, send, m: int) -> float:
    return closed_form_terms(forward, backward, send, m)["pipeline_time_s"]
