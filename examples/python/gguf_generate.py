"""A GGUF MoE model in transformers, its experts packed: generate on CPU.

    python examples/python/gguf_generate.py [--type Q8_0|Q4_0|MXFP4|F32] [--tokens 16]

Writes a small random Qwen3-MoE model as a GGUF file (make_tiny_gguf.py: no
download) and loads it twice: by transformers, which on a CPU dequantizes
every tensor, and by apex_ffn.gguf_model.load_model, which builds the model
from the file with its experts packed from the file's blocks (never
dequantized) and only the rest dequantized. Prints the logits' difference,
both greedy continuations, the experts' bytes and the tokens per second of
each. tools/bench_gguf_generate.py measures the same at a larger size, with
resident memory, each load in its own process.
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_gguf import make_tiny_qwen3_moe_gguf  # noqa: E402

import apex_ffn  # noqa: E402
from apex_ffn.gguf_model import load_model  # noqa: E402


def tokens_per_second(model, prompt, n):
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out, n / (time.perf_counter() - t0)


def experts_bytes(model):
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q8_0", choices=["F32", "Q8_0", "Q4_0", "MXFP4"])
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="apex-ffn-gguf-") as folder:
        run(args, folder)


def run(args, folder):
    from transformers import AutoModelForCausalLM
    path = os.path.join(folder, "tiny-qwen3-moe.gguf")
    make_tiny_qwen3_moe_gguf(path, args.type)
    print(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB, experts in {args.type}")

    # transformers' qwen3moe GGUF mapping has no expert_feed_forward_length: give the experts' width
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=os.path.basename(path), moe_intermediate_size=256,
                                               dtype=torch.float32).eval()
    ours = load_model(path)
    packed = [m for _, m in ours.named_modules() if isinstance(m, apex_ffn.packed.PackedExpertsModule)]
    print(f"experts: {experts_bytes(ref) / 1e6:.1f} MB as float32 (transformers) -> "
          f"{sum(m.packed.nbytes for m in packed) / 1e6:.1f} MB packed ({packed[0].packed.types}), "
          f"kernel path {apex_ffn.isa()}")

    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        a, b = ref(prompt).logits, ours(prompt).logits
    print(f"logits: max |packed - dequantized| / max |dequantized| = {((a - b).abs().max() / a.abs().max()).item():.2e}")
    out_ref, tps_ref = tokens_per_second(ref, prompt, args.tokens)
    out, tps = tokens_per_second(ours, prompt, args.tokens)
    print(f"transformers (dequantized): {out_ref[0, prompt.shape[1]:].tolist()}  {tps_ref:.1f} tokens/s")
    print(f"apex_ffn packed experts:    {out[0, prompt.shape[1]:].tolist()}  {tps:.1f} tokens/s")
    print("same greedy tokens" if torch.equal(out, out_ref) else "greedy tokens differ (the type's rounding)")


if __name__ == "__main__":
    main()
