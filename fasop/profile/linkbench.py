"""Timing of point-to-point and all-reduce transfers with torch.distributed, one process per GPU (NCCL) or per
processor slot (gloo); fasop.profile.links says which ranks take part and fits the times.

Every repetition starts after a barrier of all ranks; each rank times its own part (a ping-pong for sends:
half the round trip; the operation itself for all-reduces) from the barrier's end to the completion of its
transfers (torch.cuda.synchronize on GPUs), the slowest rank counts, and the median over repetitions is kept.
Ranks not taking part in a pattern time nothing and wait at the barrier.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fasop.profile.links import FLOAT32_BYTES, Launch, group_nodes


@dataclass(frozen=True)
class Settings:
    device: str  # cuda | cpu
    sizes: tuple[int, ...]
    repeat: int
    warmup: int


class Bench:
    """One rank's view of the job: its device, the nodes and the groups the patterns use."""

    def __init__(self, launch: Launch, settings: Settings):
        self.launch, self.settings = launch, settings
        self.cuda = settings.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(launch.local_rank)  # before NCCL starts: each rank talks from its own GPU
        dist.init_process_group("nccl" if self.cuda else "gloo", init_method="env://",
                                rank=launch.rank, world_size=launch.world_size)
        self.device = torch.device("cuda", launch.local_rank) if self.cuda else torch.device("cpu")
        keys: list[str] = [""] * launch.world_size
        dist.all_gather_object(keys, f"{socket.gethostname()}#{launch.node_id}")
        self.hosts = sorted({key.split("#")[0] for key in keys})
        self.nodes = group_nodes(keys)
        g = min(len(n) for n in self.nodes)
        # every rank creates every group, in the same order, as torch.distributed requires
        self.node_groups = [dist.new_group(n) for n in self.nodes]
        across = [[n[i] for n in self.nodes] for i in range(g)]
        self.across_groups = [dist.new_group(ranks) for ranks in across] if len(self.nodes) > 1 else []
        self.pairs_intra = [(n[i], n[i + 1]) for n in self.nodes for i in range(0, len(n) - 1, 2)]
        self.pairs_inter = [(self.nodes[0][i], self.nodes[1][i]) for i in range(g)] if len(self.nodes) > 1 else []

    def close(self) -> None:
        dist.destroy_process_group()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _p2p(self, pairs, buffer) -> bool:
        rank = self.launch.rank
        for first, second in pairs:
            if rank == first:
                dist.send(buffer, second)
                dist.recv(buffer, second)
            elif rank == second:
                dist.recv(buffer, first)
                dist.send(buffer, first)
            else:
                continue
            return True
        return False

    def _allreduce(self, groups, ranks_of, buffer) -> bool:
        for group, ranks in zip(groups, ranks_of):
            if self.launch.rank in ranks:
                dist.all_reduce(buffer, group=group)
                return True
        return False

    def _pattern(self, kind: str, buffer) -> tuple[bool, float]:
        """Run `kind` once; (took part, seconds per message: half a round trip for sends)."""
        if kind == "p2p_intra_node":
            return self._p2p(self.pairs_intra, buffer), 0.5
        if kind == "p2p_inter_node":
            return self._p2p(self.pairs_inter, buffer), 0.5
        if kind == "allreduce_intra_node":
            return self._allreduce(self.node_groups, self.nodes, buffer), 1.0
        across = [[n[i] for n in self.nodes] for i in range(len(self.across_groups))]
        return self._allreduce(self.across_groups, across, buffer), 1.0

    def time(self, kind: str, size_bytes: int) -> float:
        """Median over repetitions of the slowest rank's seconds for one message of `kind`."""
        buffer = torch.zeros(size_bytes // FLOAT32_BYTES, dtype=torch.float32, device=self.device)
        settings = self.settings
        samples = []
        for attempt in range(settings.warmup + settings.repeat):
            dist.barrier()
            self._sync()
            start = time.perf_counter()
            took_part, share = self._pattern(kind, buffer)
            self._sync()
            if attempt >= settings.warmup:
                samples.append((time.perf_counter() - start) * share if took_part else 0.0)
        slowest = torch.tensor(samples, dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return statistics.median(slowest.tolist())


def versions(cuda: bool) -> str:
    """torch, and NCCL or gloo, as the file header names them."""
    if cuda:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        return f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.get_device_name()}"
    return f"torch {torch.__version__}, gloo on the processor"
