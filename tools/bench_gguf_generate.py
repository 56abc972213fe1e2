#!/usr/bin/env python3
"""A GGUF MoE model in transformers on CPU: transformers' own load against apex_ffn's packed experts.

    python tools/bench_gguf_generate.py                      # Qwen3-MoE-shaped, Q4_0 experts, 1 and 2 threads
    python tools/bench_gguf_generate.py --type Q8_0 --reps 5

Writes one random Qwen3-MoE model as a llama.cpp GGUF file (examples/python/
make_tiny_gguf.py; default d 1024, f 512, 32 experts, top-4, 4 layers,
vocabulary 8192), then loads it, each load in a fresh process so its memory
is its own, alternating the two ways over --reps rounds:

  transformers   AutoModelForCausalLM.from_pretrained(folder, gguf_file=...): every tensor
                 dequantized to float32 (its CPU path), experts run by transformers
  apex_ffn       apex_ffn.gguf_model.load_model(file): the experts packed from the file's
                 blocks (never dequantized), the rest dequantized as transformers does

and reports, as medians: the load's wall time, the process's peak resident
memory (VmHWM) and resident memory after the load (VmRSS) beside the
process's resident memory before it (Python, torch, transformers imported),
and greedy generate's tokens per second (--prompt tokens in, --tokens out).
The kernel path (ISA) is printed first.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def status_bytes(key):
    """VmRSS (resident now) or VmHWM (its peak) of this process. The peak is the address space's own:
    ru_maxrss would carry the parent's peak across fork and exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(args):
    """One load and one generate in this process; prints a JSON line."""
    import torch
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    import apex_ffn
    from apex_ffn.gguf_model import load_model
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    if args.child == "transformers":
        folder, name = os.path.split(args.file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, moe_intermediate_size=args.f,
                                                     dtype=torch.float32).eval()
    else:
        apex_ffn.set_num_threads(args.threads)
        model = load_model(args.file)
    load_s = time.perf_counter() - t0
    after = status_bytes("VmRSS")
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        tok_s = args.tokens / (time.perf_counter() - t0)
    print(json.dumps(dict(load_s=load_s, before=before, after=after, tok_s=tok_s,
                          peak=status_bytes("VmHWM"),
                          tokens=out[0, args.prompt:].tolist())))


def run_child(args, way, threads, path):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", way, "--file", path, "--threads", str(threads),
           "--tokens", str(args.tokens), "--prompt", str(args.prompt), "--f", str(args.f), "--vocab", str(args.vocab)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def expert_bytes(path):
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if "_exps." in t.name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q4_0", choices=["F32", "Q8_0", "Q4_0", "MXFP4"])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--f", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", choices=["transformers", "apex_ffn"], help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.threads = args.threads[0]
        return child(args)

    import apex_ffn
    sys.path.insert(0, os.path.join(HERE, "..", "examples", "python"))
    from make_tiny_gguf import make_tiny_qwen3_moe_gguf, tiny_qwen3_moe
    print(f"kernel path {apex_ffn.isa()}")
    with tempfile.TemporaryDirectory(prefix="apex-ffn-bench-gguf-") as folder:
        path = os.path.join(folder, "model.gguf")
        model = tiny_qwen3_moe(hidden=args.d, experts=args.experts, ffn=args.f, layers=args.layers,
                               vocab=args.vocab, top_k=args.k)
        make_tiny_qwen3_moe_gguf(path, args.type, model)
        del model
        mb = 1 / 2**20
        print(f"file {os.path.getsize(path) * mb:.0f} MiB, experts {expert_bytes(path) * mb:.0f} MiB in {args.type}; "
              f"d {args.d}, f {args.f}, {args.experts} experts top-{args.k}, {args.layers} layers, vocab {args.vocab}")
        for threads in args.threads:
            runs = {"transformers": [], "apex_ffn": []}
            for _ in range(args.reps):
                for way in runs:  # alternated, so drift on a shared machine falls on both
                    runs[way].append(run_child(args, way, threads, path))
            same = runs["transformers"][0]["tokens"] == runs["apex_ffn"][0]["tokens"]
            med = {w: {k: statistics.median(r[k] for r in rs) for k in ("load_s", "before", "after", "peak", "tok_s")}
                   for w, rs in runs.items()}
            for w, m in med.items():
                print(f"{threads} thr  {w:12s} load {m['load_s']:6.2f} s  resident: before {m['before'] * mb:6.0f} MiB,"
                      f" after load {m['after'] * mb:6.0f} MiB, peak {m['peak'] * mb:6.0f} MiB  generate"
                      f" {m['tok_s']:6.1f} tokens/s")
            t, a = med["transformers"], med["apex_ffn"]
            print(f"{threads} thr  apex_ffn / transformers: tokens/s {a['tok_s'] / t['tok_s']:.2f}x, peak resident "
                  f"{a['peak'] / t['peak']:.2f}x, model's own resident (after - before) "
                  f"{(a['after'] - a['before']) / (t['after'] - t['before']):.2f}x; greedy tokens "
                  + ("identical" if same else "differ"))


if __name__ == "__main__":
    main()
