#!/usr/bin/env python3
"""Hugging Face transformers' side of bench_generate: greedy prefill + decode with the KV cache.

bench_generate saves its model with save_hf and the prompts as lines of token ids, then
runs this script. It loads the checkpoint with AutoModelForCausalLM (the family config.json
names: Llama, Qwen3, ...; float32, PyTorch eager, HF's
default attention; --device cuda --dtype bfloat16 for bench_cuda), one intra-op thread, and
times what generate() in C++ times: the prefill
(one forward over the prompts, first new token by argmax) and the decode steps (one forward of
one token per row, reusing past_key_values). A plain loop, not model.generate(), so HF pays no
logits-processor overhead. Prints one line:
  ok prefill_tps=<prompt tokens/s> decode_tps=<new tokens/s> tokens=<row 0's new tokens, comma-separated>
or "skip <reason>" when transformers is not installed.
"""
import argparse
import statistics
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="directory written by save_hf")
    p.add_argument("--prompts", required=True, help="one prompt per line, token ids separated by spaces")
    p.add_argument("--new", type=int, required=True, help="new tokens per prompt")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"skip {e}")
        return 0
    torch.set_num_threads(1)
    with open(a.prompts) as f:
        rows = [[int(t) for t in line.split()] for line in f if line.strip()]
    if len({len(r) for r in rows}) != 1:
        print("skip prompts of different lengths are not supported here")
        return 0
    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    ids = torch.tensor(rows, dtype=torch.long, device=a.device)
    # CUDA runs asynchronously: wait for the GPU before reading the clock.
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    prefill, decode = [], []
    tokens = []
    with torch.inference_mode():
        for r in range(a.rounds + 1):
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
            sync()
            t1 = time.perf_counter()
            past = out.past_key_values
            new = [nxt]
            for _ in range(a.new - 1):
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
                new.append(nxt)
            sync()
            t2 = time.perf_counter()
            if r == 0:
                continue  # warm-up
            prefill.append(ids.numel() / (t1 - t0))
            decode.append((a.new - 1) * ids.shape[0] / (t2 - t1))
            tokens = torch.cat(new, dim=1)[0].tolist()
    print(
        f"ok prefill_tps={statistics.median(prefill):.3f} decode_tps={statistics.median(decode):.3f} "
        f"tokens={','.join(str(t) for t in tokens)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
