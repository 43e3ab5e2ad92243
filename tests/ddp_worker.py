"""One rank of the uneven-batch DDP test (tests/test_dataparallel_runtime.py starts three): one SGD step with
fasop.runtime's sampler and loss weighting, gradient accumulation under no_sync, parameters saved to a file."""

import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

from fasop import runtime

plan_file, data_file, out_file = sys.argv[1:4]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
plan = runtime.load_plan(plan_file)
inputs, targets = torch.load(data_file)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).double())
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
sampler = runtime.UnevenBatchSampler(plan, rank, len(inputs), seed=7)
steps = len(runtime.micro_batches(plan, rank))
for index, batch in enumerate(sampler):
    last = index == steps - 1
    with nullcontext() if last else model.no_sync():
        loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        (loss * runtime.loss_scale(plan, len(batch))).backward()
    if last:
        break
optimizer.step()
torch.save([p.detach() for p in model.module.parameters()], out_file)
dist.barrier()  # no rank tears its connections down while another still uses them
del model  # DDP's reducer before its process group
dist.destroy_process_group()
# The step is saved: leave without the interpreter's teardown, where a thread gloo left joinable now and then
# aborts the process ("terminate called without an active exception") after the work is done.
sys.stdout.flush()
os._exit(0)
