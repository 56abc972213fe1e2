#!/usr/bin/env python3
"""PyTorch reference runs of AdamW and gradient clipping, for apex-ffn's tests.

    python3 tools/optim_reference.py fixtures DIR [--seed-base N]

writes DIR/optim_adamw_f32.safetensors and DIR/optim_adamw_f64.safetensors:
a few parameters trained for STEPS steps with fixed gradients by
torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW (single-tensor
implementation), in float32 and in float64. N = 0 reproduces the committed
files in tests/data/. Each file holds

    init.<name>             the parameter before the first step (PyTorch shape: biases and gains 1-D)
    grad.<k>.<name>         its gradient at step k, before clipping
    after.<k>.<name>        the parameter after step k
    state.<name>.exp_avg    AdamW's moments after the last step
    state.<name>.exp_avg_sq
    lr                      F64 [STEPS], the learning rate of each step
    norm                    F64 [STEPS], clip_grad_norm_'s return value at each step
    schedule.lr             F64 [S + 1], SequentialLR(LinearLR, CosineAnnealingLR) at steps 0 … S

and under __metadata__ the options (beta1, beta2, eps, weight_decay,
max_norm), the parameter names in order (`params`, a JSON array), the ones
without weight decay (`no_decay`), and the schedule's warmup, total, peak and
floor fraction.

Weight decay follows apex-ffn's default rule (decays_by_default in
include/apex/ffn/optim/adamw.hpp): norm gains and biases go to a parameter
group with weight_decay 0. ε is 1e-4 and the gradients span 1e-5 … 1, so ε's
place in the denominator changes the result well beyond the tolerances. The
target norms make clip_grad_norm_ scale some steps and leave others.
"""

import argparse
import json
import math
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import save_file  # noqa: E402  (the hand-written safetensors writer)

SHAPES = {"fc.weight": (3, 5), "fc.bias": (3,), "norm.weight": (5,), "out.weight": (2, 3)}
OPTIONS = dict(beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.1, max_norm=1.0)
LRS = [1e-2, 3e-2, 2e-2, 5e-2, 1e-2]
TARGET_NORMS = [2.5, 0.6, 1.8, 0.3, 4.0]  # > max_norm: clipped; < max_norm: left
SCHEDULE = dict(warmup=3, total=10, peak=0.5, floor=0.1)


def decays(name):
    return not (name.endswith("norm.weight") or name.endswith("bias") or name.endswith("kappa_alpha"))


def magnitudes(shape, gen, lo, hi):
    """Random signs times values log-uniform in [10^lo, 10^hi]."""
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int64) * 2 - 1
    exp = torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    return sign * torch.pow(10.0, exp)


def draw(gen):
    init = {n: (torch.rand(s, generator=gen, dtype=torch.float64) + 0.5)
            * (torch.randint(0, 2, s, generator=gen) * 2 - 1) for n, s in SHAPES.items()}
    grads = []
    for target in TARGET_NORMS:
        g = {n: magnitudes(s, gen, -5.0, 0.0) for n, s in SHAPES.items()}
        g["fc.weight"][0, 0] = 0.0  # a weight that never gets a gradient: m = v = 0, and 0/(0 + ε) = 0
        total = math.sqrt(sum(float((t * t).sum()) for t in g.values()))
        grads.append({n: t * (target / total) for n, t in g.items()})
    return init, grads


def schedule_lrs():
    """The learning rates PyTorch's own schedulers give for warmup_cosine's curve."""
    w, s, peak, f = SCHEDULE["warmup"], SCHEDULE["total"], SCHEDULE["peak"], SCHEDULE["floor"]
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=peak)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / w, end_factor=1.0, total_iters=w - 1),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=s - w, eta_min=f * peak)], milestones=[w])
    out = []
    with warnings.catch_warnings():  # SequentialLR passes an epoch to CosineAnnealingLR at the milestone
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(s + 1):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    return torch.tensor(out, dtype=torch.float64)


def run(dtype, init, grads):
    params = {n: torch.nn.Parameter(t.to(dtype).clone()) for n, t in init.items()}
    groups = [{"params": [p for n, p in params.items() if decays(n)], "weight_decay": OPTIONS["weight_decay"]},
              {"params": [p for n, p in params.items() if not decays(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LRS[0], betas=(OPTIONS["beta1"], OPTIONS["beta2"]), eps=OPTIONS["eps"],
                            foreach=False)
    tensors = {f"init.{n}": p.detach().clone() for n, p in params.items()}
    norms = []
    for k, (lr, g) in enumerate(zip(LRS, grads)):
        for n, p in params.items():
            p.grad = g[n].to(dtype).clone()
            tensors[f"grad.{k}.{n}"] = p.grad.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params.values(), OPTIONS["max_norm"])))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        tensors.update({f"after.{k}.{n}": p.detach().clone() for n, p in params.items()})
    for n, p in params.items():
        tensors[f"state.{n}.exp_avg"] = opt.state[p]["exp_avg"].clone()
        tensors[f"state.{n}.exp_avg_sq"] = opt.state[p]["exp_avg_sq"].clone()
    tensors["lr"] = torch.tensor(LRS, dtype=torch.float64)
    tensors["norm"] = torch.tensor(norms, dtype=torch.float64)
    return tensors


def write_fixtures(out_dir, seed):
    init, grads = draw(torch.Generator().manual_seed(seed))
    meta = {k: repr(v) for k, v in OPTIONS.items()}
    meta.update({f"schedule_{k}": repr(v) for k, v in SCHEDULE.items()})
    meta.update({"params": json.dumps(list(SHAPES)), "no_decay": json.dumps([n for n in SHAPES if not decays(n)]),
                 "steps": str(len(LRS)), "torch": torch.__version__})
    paths = []
    for dtype, tag in [(torch.float32, "f32"), (torch.float64, "f64")]:
        tensors = run(dtype, init, grads)
        tensors["schedule.lr"] = schedule_lrs()
        path = os.path.join(out_dir, f"optim_adamw_{tag}.safetensors")
        save_file(path, tensors, meta)
        paths.append(path)
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fx = sub.add_parser("fixtures", help="write optim_adamw_f32/_f64.safetensors")
    fx.add_argument("dir")
    fx.add_argument("--seed-base", type=int, default=0)
    a = ap.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    for path in write_fixtures(a.dir, a.seed_base + 301):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
