"""fasop.runtime: the uneven-batch sampler and loss weighting, checked with real torch DDP on CPU (gloo)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fasop import runtime  # noqa: E402
from fasop.errors import InputError  # noqa: E402
from fasop.plans import Plan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _plan(items, gpus_per_node=1):
    """A data-parallel plan record: items are (node type, nodes, samples per GPU, micro-batch size); the figures
    the runtime does not read are zero."""
    per_type = [{"node_type": name, "gpu": name, "gpus": nodes * gpus_per_node, "samples_per_gpu": s,
                 "micro_batch_size": b, "accumulation_steps": -(-s // b), "compute_s": 0.0, "memory_gib": 0.0,
                 "memory_capacity_gib": 0.0} for name, nodes, s, b in items]
    placement = [name for name, nodes, _, _ in items for _ in range(nodes)]
    gbs = sum(nodes * gpus_per_node * s for _, nodes, s, _ in items)
    return {"kind": "ddp", "gbs": gbs, "mbs": min(b for *_, b in items), "tp": 1, "dp": len(placement) * gpus_per_node,
            "pp": 1, "placement": placement, "gpus_per_node": gpus_per_node, "layers_per_stage": [1],
            "per_type": per_type}


# three ranks with 2, 3 and 5 samples; the third runs micro-batches of 2, 2 and 1
PLAN = _plan([("a", 1, 2, 2), ("b", 1, 3, 3), ("c", 1, 5, 2)])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference_step(inputs, targets, indices, weights=None):
    """One SGD step of one process; weights: per micro-batch factors instead of the whole batch's mean."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if weights is None:
        torch.nn.functional.mse_loss(model(inputs[indices]), targets[indices]).backward()
    else:
        for batch, weight in weights:
            (weight * torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])).backward()
    optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_uneven_ddp_step_equals_one_process_on_the_global_batch(tmp_path):
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(30, 4, generator=generator, dtype=torch.float64)
    targets = torch.randn(30, 2, generator=generator, dtype=torch.float64)
    torch.save((inputs, targets), tmp_path / "data.pt")
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    port = _free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "3", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "ddp_worker.py"), str(tmp_path / "plan.json"),
                                       str(tmp_path / "data.pt"), str(tmp_path / f"rank{rank}.pt")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for proc in procs:
        output, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, output.decode()
    step = [list(runtime.UnevenBatchSampler(Plan.model_validate(PLAN), rank, 30, seed=7)) for rank in range(3)]
    first = [batches[: len(runtime.micro_batches(Plan.model_validate(PLAN), rank))] for rank, batches in enumerate(step)]
    indices = [i for batches in first for batch in batches for i in batch]
    assert len(indices) == len(set(indices)) == 10
    expected = _reference_step(inputs, targets, indices)
    for rank in range(3):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for g, e in zip(got, expected):
            assert torch.allclose(g, e, rtol=0, atol=1e-6), (rank, g, e)
    # without the weighting, DDP's plain average of the ranks' accumulated gradients is another step
    plain = _reference_step(inputs, targets, indices, [(b, 1 / 3) for batches in first for b in batches])
    assert max(float((p - e).abs().max()) for p, e in zip(plain, expected)) > 1e-3


def test_micro_batches_and_loss_scale():
    assert runtime.rank_batches(Plan.model_validate(PLAN)) == [2, 3, 5]
    assert runtime.micro_batches(Plan.model_validate(PLAN), 2) == [2, 2, 1]
    assert runtime.loss_scale(Plan.model_validate(PLAN), 2) == pytest.approx(3 * 2 / 10)


plans = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 4)), min_size=1, max_size=3).map(
    lambda items: [(f"t{i}", nodes, s, b) for i, (nodes, s, b) in enumerate(items)])


@settings(max_examples=60, deadline=None)
@given(plans, st.integers(1, 3), st.integers(0, 5), st.integers(0, 7), st.integers(0, 3))
def test_sampler_covers_every_index_of_an_epoch_once(items, gpus_per_node, steps, extra, epoch):
    plan = _plan(items, gpus_per_node)
    size = steps * plan["gbs"] + extra % plan["gbs"]  # a short last batch is dropped
    seen = []
    for rank in range(runtime.world_size(Plan.model_validate(plan))):
        sampler = runtime.UnevenBatchSampler(Plan.model_validate(plan), rank, size, seed=1)
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == steps * len(runtime.micro_batches(Plan.model_validate(plan), rank))
        assert [len(b) for b in batches] == runtime.micro_batches(Plan.model_validate(plan), rank) * steps
        seen += [i for b in batches for i in b]
    assert len(seen) == len(set(seen)) == steps * plan["gbs"]
    if extra % plan["gbs"] == 0:
        assert sorted(seen) == list(range(size))


def test_epochs_shuffle_differently_and_reproducibly():
    sampler = runtime.UnevenBatchSampler(Plan.model_validate(PLAN), 2, 30, seed=0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_load_plan_refuses_a_split_that_misses_the_batch(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**PLAN, "gbs": 11}))
    with pytest.raises(InputError, match="add up to 10, not the global batch 11"):
        runtime.load_plan(path)
    path.write_text(json.dumps([{**PLAN, "rank": 1}]))
    assert runtime.load_plan(path).gbs == 10
