#!/usr/bin/env python3
"""Per-op time of tiny ops on PyTorch's own (Python) DTensor vs plain tensors.

Run by bench_dispatch (one process, a 1-rank Gloo group on loopback) so both libraries are
measured on the same machine in the same run. Prints one JSON line: {op: [plain_us, dtensor_us]}.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def per_call_us(fn, iters, blocks, sync=lambda: None):
    samples = []
    for _ in range(blocks):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        sync()  # CUDA kernels run asynchronously: count until they ran
        samples.append((time.perf_counter_ns() - t0) / iters / 1000.0)
    return statistics.median(samples)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    cuda = args.device == "cuda"
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=0,
                            world_size=1)
    mesh = init_device_mesh(args.device, (1,))
    torch.manual_seed(0)
    a, b = torch.randn(8, 8, device=args.device), torch.randn(8, 8, device=args.device)
    bias = torch.randn(8, device=args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # Same placements as bench_dispatch.cpp: no redistribution, dispatch only.
    da, db = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()])
    da2 = distribute_tensor(b, mesh, [Shard(0)])
    dbias = distribute_tensor(bias, mesh, [Replicate()])
    ops = {
        "add": (lambda: a + b, lambda: da + da2),
        "mul": (lambda: a * 2.0, lambda: da * 2.0),
        "addmm": (lambda: torch.addmm(bias, a, b), lambda: torch.addmm(dbias, da, db)),
        "view": (lambda: a.view(64), lambda: da.view(64)),
        "sum": (lambda: a.sum(), lambda: da.sum()),
    }
    out = {}
    with torch.no_grad():
        for name, (plain, dt) in ops.items():
            for f in (plain, dt):  # warm up (fills DTensor's sharding cache)
                for _ in range(50):
                    f()
            # interleave plain and DTensor blocks so machine noise hits both
            ps, ds = [], []
            for _ in range(3):
                ps.append(per_call_us(plain, args.iters, 1, sync))
                ds.append(per_call_us(dt, max(args.iters // 10, 50), 1, sync))
            out[name] = [statistics.median(ps), statistics.median(ds)]
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
