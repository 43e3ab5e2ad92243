"""Properties of the data-parallel plan kinds (DDP, ZeRO-1, -2 and -3, each with an even and an uneven batch
split) on random valid models and clusters (tests/strategies.py), run as tests/test_properties.py runs its own:
`ci` examples in the default run, `slow` ones under `python -m pytest -m slow`."""

from __future__ import annotations

import contextlib
import math
import tempfile

from hypothesis import assume
from hypothesis import strategies as st
from strategies import specs
from test_properties import check, examples, written

from fasop.inputs.profiles import load_profiles
from fasop.search.dataparallel import KINDS, NoPlan, plan_row

RELATIVE_TOLERANCE = 1e-9


def plans_of(w, batch: int, overlap: bool) -> dict[tuple[str, bool], object]:
    """Each kind's plan with an even and with an uneven split, where it has one."""
    profiles = load_profiles(w.model, [t.gpu for t in w.cluster.node_types.values()], str(w.profiles))
    plans = {}
    for kind in KINDS:
        for even in (True, False):
            with contextlib.suppress(NoPlan):  # the kind has no plan here: nothing to check
                plans[kind, even] = plan_row(w.model, w.cluster, profiles, kind, batch, even, overlap=overlap)
    return plans


def check_split(plan, batch: int) -> None:
    """Every sample of the global batch is on exactly one GPU, in micro-batches that cover it."""
    shares = plan.per_type or []
    assert sum(t.gpus * t.samples_per_gpu for t in shares) == batch
    assert sum(t.gpus for t in shares) == plan.dp
    for t in shares:
        assert t.micro_batch_size <= t.samples_per_gpu
        assert (t.accumulation_steps - 1) * t.micro_batch_size < t.samples_per_gpu <= t.accumulation_steps * t.micro_batch_size
        assert t.compute_s <= plan.compute_s * (1 + RELATIVE_TOLERANCE)
    assert math.isclose(plan.step_time_s, plan.compute_s + plan.dp_exposed_s + plan.optimizer_s,
                        rel_tol=RELATIVE_TOLERANCE)
    assert math.isclose(plan.throughput_samples_per_s, batch / plan.step_time_s, rel_tol=RELATIVE_TOLERANCE)


@examples(ci=60, slow=800)
def test_data_parallel_plans_split_the_batch_shard_memory_and_restate(max_examples, derandomize):
    def prop(spec, samples_per_gpu, extra, overlap):
        with tempfile.TemporaryDirectory() as root:
            w = written(spec, root)
            batch = w.cluster.num_gpus * samples_per_gpu + extra
            plans = plans_of(w, batch, overlap)
            assume(plans)
            for (kind, even), plan in plans.items():
                check_split(plan, batch)
                assert plan.kind == kind and plan.batch_split == ("even" if even else "uneven")
                # the same split asked for by its samples per GPU is the same plan (what emit and validate do)
                samples = {t.node_type: t.samples_per_gpu for t in plan.per_type or []}
                profiles = load_profiles(w.model, [t.gpu for t in w.cluster.node_types.values()], str(w.profiles))
                again = plan_row(w.model, w.cluster, profiles, kind, batch, even, samples, overlap=overlap)
                assert again.record() == plan.record()
            for kind in KINDS:
                even, uneven = plans.get((kind, True)), plans.get((kind, False))
                if even is not None:  # the uneven split considers the even one
                    assert uneven is not None
                    assert uneven.step_time_s <= even.step_time_s * (1 + RELATIVE_TOLERANCE)
            # ZeRO-1 and -2 shard more of the model state than DDP and nothing else changes: on the same (even)
            # split they never hold more (ZeRO-3 adds gather buffers, which a small world may not pay back)
            evens = [plans.get((kind, True)) for kind in ("ddp", "zero1", "zero2")]
            for lighter, heavier in zip(evens[1:], evens[:-1]):
                if lighter is not None and heavier is not None:
                    for a, b in zip(lighter.per_type or [], heavier.per_type or []):
                        assert a.micro_batch_size != b.micro_batch_size or a.memory_gib <= b.memory_gib * (1 + 1e-12)

    check(max_examples, derandomize, prop, specs(), st.integers(1, 8), st.integers(0, 7), st.booleans())
