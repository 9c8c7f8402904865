"""
Check the interconnect before a long run: all_reduce over every rank of a torchrun job, as train.py exchanges its
gradients, at sizes from 1 MiB to 1 GiB (to 16 MiB on CPUs), each result checked and each size timed. Rank 0
prints each size's bus bandwidth (the NCCL tests' busbw: what each link carries, comparable across rank counts),
from the slowest rank's median time. Launch it with the run's own torchrun line, on the same nodes:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 slurm/all_reduce.py

It takes no options; NCCL's environment variables (NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME, ...) apply as they would
to train.py. docs/distributed.md#check-the-interconnect says what to expect.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

TIMED = 10  # timed all_reduces of each size, after 2 that warm up


def timed_all_reduce(size, rank, device):
    """This rank's median seconds for an all_reduce of `size` bytes of float32, and whether every sum was right."""
    x = torch.empty(size // 4, dtype=torch.float32, device=device)
    times, right = [], True
    for _ in range(2 + TIMED):
        x.fill_(rank + 1)  # the sum over the ranks is known: 1 + 2 + ... + world size, exact in float32
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        world = dist.get_world_size()
        right = right and bool((x == world * (world + 1) / 2).all())
    return statistics.median(times[2:]), right


def main():
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"all_reduce over {world} rank(s) ({dist.get_backend()}), float32, the slowest rank's median of {TIMED}")
        print(f"{'size':>10} {'time':>10} {'bus bandwidth':>15}")
    wrong = []
    for size in [2**p for p in range(20, 31 if cuda else 25, 2)]:
        seconds, right = timed_all_reduce(size, rank, device)
        # the slowest rank's time, and whether any rank saw a wrong sum, in one all_reduce
        slowest = torch.tensor([seconds, float(not right)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds, failed = slowest.tolist()
        if failed:
            wrong.append(f"{size / 2**20:g} MiB")
        if rank == 0:
            # each rank sends and receives 2 (n - 1) / n of the data in a ring: the bus bandwidth
            bus = size / seconds * 2 * (world - 1) / world
            print(f"{size / 2**20:>7g} MiB {seconds * 1e3:>7.2f} ms {bus / 1e9:>10.2f} GB/s")
    dist.destroy_process_group()
    if wrong:
        sys.exit(f"all_reduce.py: error: wrong sums at {', '.join(wrong)}: this interconnect corrupts data")


if __name__ == "__main__":
    main()
