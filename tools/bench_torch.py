#!/usr/bin/python3
"""Times the reference PyTorch MoEFFN (the tutorial's algorithm) at the shapes,
token counts, routings and thread counts of benchmarks/bench_moe.cpp, so the
performance tables (docs/performance.md) can compare apex-ffn with PyTorch on the same machine.

Needs Debian's python3-torch (run with /usr/bin/python3). Writes JSON lines:
{"shape", "N", "routing", "threads", "mode": "forward"|"forward_backward", "seconds"}
with the median of --reps repetitions.

    /usr/bin/python3 tools/bench_torch.py --out torch.jsonl [--shapes small,fine,coarse]
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {  # d, f, E, K, shared — as in bench_moe.cpp
    "small": (512, 1376, 8, 2, 1),
    "medium": (2048, 5504, 64, 4, 2),
    "fine": (1024, 512, 64, 8, 2),
    "coarse": (1024, 3584, 8, 2, 0),
}
ROUTINGS = ["uniform", "zipf", "one"]


class DenseFFN(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w_gate = nn.Linear(d, f, bias=False)
        self.w_up = nn.Linear(d, f, bias=False)
        self.w_down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoEFFN(nn.Module):
    """The tutorial's MoEFFN.forward, unchanged in algorithm."""

    def __init__(self, d, f, n_experts, n_active, n_shared):
        super().__init__()
        self.n_experts, self.n_active = n_experts, n_active
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([DenseFFN(d, f) for _ in range(n_experts)])
        self.shared_experts = nn.ModuleList([DenseFFN(d, f) for _ in range(n_shared)])
        self.expert_bias = torch.zeros(n_experts)

    def forward(self, x_flat):
        scores = self.router(x_flat) + self.expert_bias.unsqueeze(0)
        topk_vals, topk_idx = scores.topk(self.n_active, dim=-1)
        topk_weights = torch.softmax(topk_vals, dim=-1)
        output = torch.zeros_like(x_flat)
        for e in range(self.n_experts):
            token_rows, slot_ranks = (topk_idx == e).nonzero(as_tuple=True)
            if token_rows.numel() == 0:
                continue
            expert_out = self.experts[e](x_flat[token_rows].unsqueeze(0)).squeeze(0)
            weights_e = topk_weights[token_rows, slot_ranks].unsqueeze(-1)
            output.index_add_(0, token_rows, expert_out * weights_e)
        for shared_expert in self.shared_experts:
            output = output + shared_expert(x_flat.unsqueeze(0)).squeeze(0)
        return output


def routing_bias(kind, n_experts):
    b = torch.zeros(n_experts)
    for e in range(n_experts):
        if kind == "zipf":
            b[e] = -0.5 * math.log(e + 1)
        if kind == "one":
            b[e] = 1.0 if e == 0 else -1.0
    return b


def median_time(fn, reps, before=None):
    times = []
    for _ in range(reps):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="small,fine,coarse", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--tokens", default="1,4,16,128,2048")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    # Decode forwards (N <= 16) start with cold caches, as in bench_moe: a
    # 1 GiB buffer is rewritten before each (untimed).
    evict_buffer = torch.ones(1 << 28)

    def evict():
        evict_buffer.add_(1.0)

    with open(args.out, "w") as out:
        for shape in args.shapes.split(","):
            d, f, e, k, s = SHAPES[shape]
            model = MoEFFN(d, f, e, k, s)
            for routing in ROUTINGS:
                model.expert_bias = routing_bias(routing, e)
                for n in map(int, args.tokens.split(",")):
                    gen = torch.Generator().manual_seed(100 + n)
                    x = torch.rand(n, d, generator=gen) * 2 - 1
                    dy = torch.rand(n, d, generator=gen) * 2 - 1
                    for threads in map(int, args.threads.split(",")):
                        torch.set_num_threads(threads)
                        reps = min(args.reps, 3) if n >= 2048 else args.reps

                        def fwd():
                            with torch.no_grad():
                                model(x)

                        def fwd_bwd():
                            xg = x.clone().requires_grad_(True)
                            model(xg).backward(dy)

                        for mode, fn in (("forward", fwd), ("forward_backward", fwd_bwd)):
                            fn()  # warm-up
                            cold = mode == "forward" and n <= 16
                            t = median_time(fn, reps, evict if cold else None)
                            model.zero_grad(set_to_none=True)
                            rec = dict(shape=shape, N=n, routing=routing, threads=threads, mode=mode, seconds=t)
                            out.write(json.dumps(rec) + "\n")
                            out.flush()
                            print(rec, file=sys.stderr)


if __name__ == "__main__":
    main()
