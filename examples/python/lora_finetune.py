"""LoRA fine-tune of a small MoE model's packed experts on a text, saved as a
peft adapter and loaded back by peft.

    python examples/python/lora_finetune.py [--type q8_0] [--steps 30] [--out adapter-folder]

A small random Qwen3-MoE model (make_tiny_gguf.py: no download) gets its
experts packed in --type and LoRA adapters (r = 8) on every expert's
gate_up and down projections; AdamW trains them on a paragraph of text,
one byte a token. The adapter is saved in peft's layout, then

  - peft loads it onto the float model (PeftModel.from_pretrained) — the
    outputs differ from the packed model's only by the type's rounding of
    the frozen base weights (none for f32);
  - apex_ffn loads it back onto a fresh packed model: the same outputs.
"""
import argparse
import copy
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_gguf import tiny_qwen3_moe  # noqa: E402

from apex_ffn.lora import add_lora, load_peft, save_peft  # noqa: E402
from apex_ffn.packed import pack_experts  # noqa: E402

TEXT = (b"The mixture of experts routes every token to a few of its experts, and the few it picks "
        b"do the work of the whole layer. Packed in blocks of quantized weights, the experts stay "
        b"small; adapters of low rank learn what the frozen weights do not know.")


def rel(a, b):
    """The median over tokens of max |a - b| / max |b| (a quantized base can flip a near tie of the router)."""
    return ((a - b).abs().amax(-1) / b.abs().amax(-1)).median().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="q8_0", help="the packed experts' storage type (apex_ffn.storage_types())")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None, help="the adapter folder (default: a new temporary one)")
    args = ap.parse_args()
    import peft

    base = tiny_qwen3_moe()  # vocabulary 512: one byte a token
    tokens = torch.tensor([list(TEXT)])
    model = copy.deepcopy(base)
    pack_experts(model, args.type)
    add_lora(model, r=8, lora_alpha=16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(f"experts packed as {args.type}; {sum(p.numel() for p in trainable)} trainable adapter weights")
    opt = torch.optim.AdamW(trainable, lr=3e-3)
    for step in range(args.steps):
        opt.zero_grad()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    out = args.out or tempfile.mkdtemp(prefix="apex-ffn-lora-")
    save_peft(model, out)
    print(f"saved {sorted(os.listdir(out))} to {out}")
    with torch.no_grad():
        ours = model(tokens).logits
        theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), out)(tokens).logits
        again = copy.deepcopy(base)
        pack_experts(again, args.type)
        load_peft(again, out)
        back = again(tokens).logits
    print(f"peft on the float model vs the packed model: {rel(theirs, ours):.2e} (the {args.type} rounding)")
    print(f"loaded back by apex_ffn: {rel(back, ours):.2e}")


if __name__ == "__main__":
    main()
