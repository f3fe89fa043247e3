#!/usr/bin/env python3
"""Training steps of dtensor-cpp's Llama model under PyTorch's own (Python) tensor parallelism.

The reference for bench_train_step: the same architecture as include/dtensor/models/transformer.h
(module and parameter names, rotary formulation, RMSNorm eps, GQA through SDPA, SwiGLU), the
same torchtitan TP plan as apply_tensor_parallel() (sequence parallel + loss parallel) applied
with parallelize_module on a CPU Gloo group, AdamW, and the same initial parameters and token
batches, read from a safetensors file the C++ benchmark writes (--inputs).

With --tp 1 the model runs as plain PyTorch (no DTensor), in this process.

Two ways to run it:
  --serve       driven by bench_train_step over stdin/stdout, one line per message:
                  -> "ready tp=<n> params=<count>"
                  <- "run <steps>"
                  -> "ok seconds=<the slowest rank's wall time for the steps> losses=<l1,l2,...>"
                  <- "quit"
                so that its blocks of steps interleave with the C++ variants' in one run.
  (default)     standalone: --warmup steps, then --rounds blocks of --steps steps; prints a
                table and the line "PYTORCH_TP step_ms=<median> tokens_per_s=<...> first_loss=<...>".
"""
import argparse
import json
import os
import socket
import statistics
import struct
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Inputs: a safetensors file (parsed here; the `safetensors` package is not needed).

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_header(path):
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}, ...}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def load_safetensors(path):
    """Returns ({name: tensor}, metadata)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        if end == begin:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
        else:
            buf = bytearray(data[begin:end])
            tensors[name] = torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])
    return tensors, metadata


# ---------------------------------------------------------------------------------------------
# The model: same names and math as src/models/transformer.cpp.


class Config:
    def __init__(self, d):
        self.vocab_size = d["vocab_size"]
        self.dim = d["dim"]
        self.n_layers = d["n_layers"]
        self.n_heads = d["n_heads"]
        self.n_kv_heads = d.get("n_kv_heads") or self.n_heads
        self.multiple_of = d.get("multiple_of", 32)
        hidden = d.get("ffn_hidden_dim") or 0
        if not hidden:  # Llama's rule (DecoderConfig::hidden_dim)
            hidden = 2 * (4 * self.dim) // 3
            if d.get("ffn_dim_multiplier"):
                hidden = int(d["ffn_dim_multiplier"] * hidden)
            hidden = self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
        self.hidden_dim = hidden
        self.max_seq_len = d["max_seq_len"]
        self.norm_eps = d["norm_eps"]
        self.rope_theta = d["rope_theta"]
        self.tie_embeddings = d.get("tie_embeddings", False)
        self.head_dim = self.dim // self.n_heads


def apply_rotary(x, rope):
    """x: (B, S, H, head_dim); rope: (S, head_dim/2, 2) cos and sin. Rotates consecutive pairs
    (x0, x1) as the complex number x0 + i x1 times cos + i sin."""
    seqlen = x.size(1)
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos = rope[..., 0].view(1, seqlen, 1, -1)
    sin = rope[..., 1].view(1, seqlen, 1, -1)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)


def repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand(b, s, h, n_rep, d).reshape(b, s, -1, d)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.head_dim = c.head_dim
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x, rope):
        bs, seqlen = x.shape[0], x.shape[1]
        # -1: the heads this rank holds (all of them without TP), as torchtitan does.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq = apply_rotary(xq, rope)
        xk = apply_rotary(xk, rope)
        n_rep = xq.size(2) // xk.size(2)
        xk = repeat_kv(xk, n_rep)
        xv = repeat_kv(xv, n_rep)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.feed_forward = FeedForward(c.dim, c.hidden_dim)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        if c.tie_embeddings:
            raise SystemExit("pytorch_tp_train_step: tie_embeddings is not supported here")
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(TransformerBlock(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        # Rotation angle of position p for pair i: p * theta^(-2i / head_dim), in float64.
        hd = c.head_dim
        freqs = torch.pow(c.rope_theta, -torch.arange(0, hd, 2, dtype=torch.float64).div(hd))
        angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float64), freqs)
        self.rope_table = torch.stack((angles.cos(), angles.sin()), -1)  # not a parameter

    def forward(self, tokens):
        seqlen = tokens.size(1)
        h = self.tok_embeddings(tokens)
        local = h.to_local() if hasattr(h, "to_local") else h
        rope = self.rope_table[:seqlen].to(local.dtype)
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: torchtitan's plan, as apply_tensor_parallel() applies it (SP + loss
# parallel; wk/wv Colwise when the KV heads split over the ranks).


def parallelize(model, mesh, c):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = mesh.size()
    if c.n_heads % tp or c.hidden_dim % tp or c.n_kv_heads % tp:
        raise SystemExit(
            f"pytorch_tp_train_step: tp={tp} must divide n_heads={c.n_heads}, "
            f"n_kv_heads={c.n_kv_heads} and the FFN hidden size {c.hidden_dim}"
        )
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


# ---------------------------------------------------------------------------------------------
# One rank (or the single process at --tp 1).


class Trainer:
    def __init__(self, args, rank, world):
        torch.set_num_threads(1)  # one intra-op thread per rank
        self.args, self.rank, self.world = args, rank, world
        if args.inputs:
            tensors, meta = load_safetensors(args.inputs)
            self.config = Config(json.loads(meta["config"]))
            self.batches = tensors.pop("bench.tokens")  # (n_batches, B, S + 1)
            params = tensors
        else:
            from_preset = {"vocab_size": 4096, "dim": 512, "n_layers": 8, "n_heads": 8,
                           "n_kv_heads": 4, "multiple_of": 256, "max_seq_len": 512,
                           "norm_eps": 1e-5, "rope_theta": 10000.0}  # the "bench" preset
            self.config = Config(from_preset)
            g = torch.Generator().manual_seed(args.seed)
            self.batches = torch.randint(
                0, self.config.vocab_size, (4, args.batch, args.seq + 1), generator=g
            )
            params = None
        torch.manual_seed(args.seed)
        model = Transformer(self.config)
        if params is not None:
            names = {n for n, _ in model.named_parameters()}
            if names != set(params):
                raise SystemExit(
                    "pytorch_tp_train_step: parameters differ from the inputs file: "
                    f"missing {sorted(names - set(params))}, unexpected {sorted(set(params) - names)}"
                )
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params[n])
        self.num_params = sum(p.numel() for p in model.parameters())
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh("cpu", (world,))
            parallelize(model, self.mesh, self.config)
        self.model = model
        # The for-loop AdamW, as LibTorch's torch::optim::AdamW (the CPU default too).
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
            foreach=False,
        )
        self.step_count = 0

    def step(self):
        batch = self.batches[self.step_count % self.batches.size(0)]
        self.step_count += 1
        tokens, targets = batch[:, :-1], batch[:, 1:]
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(tokens)
        if self.world > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
            value = loss.to_local().item()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            value = loss.item()
        self.opt.step()
        return value

    def sync(self):
        if self.world > 1:
            dist.barrier()

    def run(self, steps):
        """(the slowest rank's seconds for `steps` steps, their losses)."""
        self.sync()
        t0 = time.perf_counter()
        losses = [self.step() for _ in range(steps)]
        elapsed = time.perf_counter() - t0
        if self.world > 1:
            t = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            elapsed = t.item()
        return elapsed, losses


def rank_main(rank, world, port, args, commands, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainer = Trainer(args, rank, world)
        if rank == 0:
            results.put(("ready", trainer.num_params))
        while True:
            cmd = commands.get()
            if cmd is None:
                break
            out = trainer.run(cmd)
            if rank == 0:
                results.put(("ok", out))
    except BaseException as e:  # the controller must not wait forever
        results.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """`world` rank processes (spawned) or, at world 1, a Trainer in this process."""

    def __init__(self, args, world):
        self.world = world
        if world == 1:
            self.trainer = Trainer(args, 0, 1)
            self.num_params = self.trainer.num_params
            return
        ctx = mp.get_context("spawn")
        port = free_port()
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(
                target=rank_main, args=(r, world, port, args, self.commands[r], self.results)
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        kind, value = self.results.get()
        if kind != "ready":
            self.close()
            raise SystemExit(f"pytorch_tp_train_step: {value}")
        self.num_params = value

    def run(self, steps):
        if self.world == 1:
            return self.trainer.run(steps)
        for q in self.commands:
            q.put(steps)
        kind, value = self.results.get()
        if kind != "ok":
            self.close()
            raise SystemExit(f"pytorch_tp_train_step: {value}")
        return value

    def close(self):
        if self.world == 1:
            return
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def serve(ranks, args):
    print(f"ready tp={args.tp} params={ranks.num_params}", flush=True)
    while True:
        line = sys.stdin.readline()
        if not line:  # EOF: the benchmark went away
            break
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] != "run" or len(words) != 2:
            print(f"error unknown command {line.strip()!r}", flush=True)
            continue
        seconds, losses = ranks.run(int(words[1]))
        print(f"ok seconds={seconds:.6f} losses={','.join(f'{l:.9g}' for l in losses)}",
              flush=True)


def standalone(ranks, args, tokens_per_step):
    _, warm = ranks.run(args.warmup)
    per_step = []
    for _ in range(args.rounds):
        seconds, _ = ranks.run(args.steps)
        per_step.append(seconds / args.steps)
    ms = statistics.median(per_step) * 1000
    print(f"PyTorch TP={args.tp}: params {ranks.num_params}, {tokens_per_step} tokens/step")
    print("ms/step per round: " + " ".join(f"{s * 1000:.1f}" for s in per_step))
    first = warm[0] if warm else float("nan")
    print(f"PYTORCH_TP step_ms={ms:.3f} tokens_per_s={tokens_per_step / ms * 1000:.1f} "
          f"first_loss={first:.9g}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--inputs", help="safetensors file from bench_train_step: parameters "
                   "(torchtitan names), 'bench.tokens' (n, B, S+1) and the config in metadata")
    p.add_argument("--tp", type=int, default=2, help="ranks (1: plain PyTorch, no DTensor)")
    p.add_argument("--serve", action="store_true", help="take commands on stdin (see above)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=4, help="without --inputs")
    p.add_argument("--seq", type=int, default=128, help="without --inputs")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    ranks = Ranks(args, args.tp)
    try:
        if args.serve:
            serve(ranks, args)
        else:
            tokens = args.batch * args.seq
            if args.inputs:
                _, b, s1 = read_header(args.inputs)["bench.tokens"]["shape"]
                tokens = b * (s1 - 1)
            standalone(ranks, args, tokens)
    finally:
        ranks.close()


if __name__ == "__main__":
    main()
