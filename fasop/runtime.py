"""Training with an uneven batch split (plan kinds ddp, zero1, zero2, zero3): which samples each rank takes and
how its loss is weighted. torch is imported only when the sampler is used; docs/uneven-ddp.md has an example.

Ranks follow the plan's node order: rank r runs on node r // gpus_per_node, whose node type sets its samples
per step, micro-batch size and gradient-accumulation count.

DDP (and FSDP / ZeRO) average the gradients over the W ranks. When rank r holds b_r of the B samples of a step,
the plain average weighs every rank alike, which is not the gradient of the global batch. Scaling the mean loss
of each micro-batch of n samples by W * n / B makes the average exactly (1/B) * sum of the per-sample
gradients, whatever the split and the accumulation.
"""

from __future__ import annotations

import itertools
import os

from fasop.errors import InputError
from fasop.plans import Plan, TypeShare, read_plan_file


def load_plan(path: str | os.PathLike, rank: int = 1) -> Plan:
    """The plan in `path`: one plan object (fasop emit's plan.json) or plan `rank` of a plan list."""
    plan = read_plan_file(path, rank)
    check_plan(plan, str(path))
    return plan


def check_plan(plan: Plan, where: str) -> None:
    """A data-parallel plan whose per-type samples add up to its global batch."""
    if plan.per_type is None or plan.gpus_per_node is None:
        raise InputError(where, "not a data-parallel plan (kind ddp, zero1, zero2 or zero3) with per_type batches")
    for item in plan.per_type:
        if -(-item.samples_per_gpu // item.micro_batch_size) != item.accumulation_steps:
            raise InputError(f"{where}: per_type", "accumulation_steps must be samples_per_gpu / micro_batch_size "
                                                   "rounded up")
    gpus = {item.node_type: item.gpus for item in plan.per_type}
    if not set(plan.placement) <= set(gpus):
        raise InputError(f"{where}: placement", "expected a list of the node types named in per_type")
    for name, count in gpus.items():
        if plan.placement.count(name) * plan.gpus_per_node != count:
            raise InputError(f"{where}: per_type", f"{name} has {count} GPUs, the placement "
                                                   f"{plan.placement.count(name) * plan.gpus_per_node}")
    total = sum(item.gpus * item.samples_per_gpu for item in plan.per_type)  # every rank's: the GPUs match the placement
    if total != plan.gbs:
        raise InputError(f"{where}: per_type", f"the samples of all ranks add up to {total}, "
                                               f"not the global batch {plan.gbs}")


def _by_type(plan: Plan) -> dict[str, TypeShare]:
    return {item.node_type: item for item in plan.per_type or []}


def _rank_type(plan: Plan, rank: int) -> TypeShare:
    """The node type share of rank `rank`: its node's, rank // gpus_per_node."""
    return _by_type(plan)[plan.placement[rank // (plan.gpus_per_node or 1)]]


def world_size(plan: Plan) -> int:
    return len(plan.placement) * (plan.gpus_per_node or 0)


def rank_batches(plan: Plan) -> list[int]:
    """Samples per step of every rank, in rank order."""
    by_type = _by_type(plan)
    return [by_type[name].samples_per_gpu for name in plan.placement for _ in range(plan.gpus_per_node or 0)]


def rank_offset(plan: Plan, rank: int) -> int:
    """Samples per step of ranks 0 .. rank-1: those of the nodes before rank's and of the GPUs before it on its
    node (node by node, so no list as long as the ranks)."""
    by_type, gpus = _by_type(plan), plan.gpus_per_node or 1
    before = sum(by_type[name].samples_per_gpu for name in itertools.islice(plan.placement, rank // gpus))
    return before * gpus + rank % gpus * _rank_type(plan, rank).samples_per_gpu


def micro_batches(plan: Plan, rank: int) -> list[int]:
    """Sizes of rank `rank`'s micro-batches in one step: full micro-batches, the last one holding the rest."""
    item = _rank_type(plan, rank)
    samples, size = item.samples_per_gpu, item.micro_batch_size
    return [size] * (samples // size) + ([samples % size] if samples % size else [])


def loss_scale(plan: Plan, micro_batch_samples: int) -> float:
    """Factor on the mean loss of a micro-batch of `micro_batch_samples` so that the ranks' averaged gradient is
    the gradient of the global batch: world_size * samples / global batch."""
    return world_size(plan) * micro_batch_samples / plan.gbs


def _sampler_class():
    import torch
    from torch.utils.data import Sampler

    class UnevenBatchSampler(Sampler):
        """Yields rank `rank`'s micro-batches (lists of dataset indices), step after step.

        Every epoch shuffles the dataset with the same seed on every rank (seed + epoch); step k takes the
        global batch k of that order and gives rank r the b_r samples after those of ranks 0 .. r-1, so the
        ranks never overlap and together cover each index of an epoch once. A last global batch short of B
        samples is dropped. Use it as a DataLoader's batch_sampler; call set_epoch(e) at each epoch."""

        def __init__(self, plan: Plan, rank: int, dataset_size: int, seed: int = 0):
            if not 0 <= rank < world_size(plan):
                raise InputError("rank", f"expected 0 to {world_size(plan) - 1}, got {rank}")
            item = _rank_type(plan, rank)
            self.offset, self.size = rank_offset(plan, rank), item.micro_batch_size
            # full micro-batches and the rest, not a list of sizes: a rank may take millions of samples a step
            self.full, self.rest = divmod(item.samples_per_gpu, self.size)
            self.batch, self.dataset_size, self.seed, self.epoch = plan.gbs, dataset_size, seed, 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        @property
        def steps(self) -> int:
            return self.dataset_size // self.batch

        def __len__(self) -> int:
            return self.steps * (self.full + (self.rest > 0))

        def __iter__(self):
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator)
            for step in range(self.steps):
                start = step * self.batch + self.offset
                for k in range(self.full + (self.rest > 0)):
                    size = self.size if k < self.full else self.rest
                    yield order[start:start + size].tolist()
                    start += size

    return UnevenBatchSampler


def __getattr__(name: str):
    if name == "UnevenBatchSampler":  # defined on first use: it needs torch
        globals()[name] = _sampler_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
