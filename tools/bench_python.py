#!/usr/bin/env python3
"""apex_ffn's experts against transformers' own, one MoE block, on CPU.

    python tools/bench_python.py                 # Qwen3-30B-A3B-shaped: E 128, K 8, d 2048, f 768
    python tools/bench_python.py --experts 32    # smaller, same widths
    python tools/bench_python.py --lora-only / --no-lora

One Qwen3MoeExperts module of transformers, given routing (random top-K ids,
softmax weights), at N = 1, 16, 512 tokens and 1 and 2 threads, in float32
and bf16:

  eager, grouped_mm     transformers' experts implementations
  apex_ffn              the same module through the "apex_ffn" experts implementation (apex_ffn.hf):
                        float32 weights run float; bf16 weights packed once as bf16
  packed <type>         apex_ffn.packed.PackedExpertsModule (q8_0, q4_k; the model's dtype at its edges)

and the LoRA training step of the block (forward + backward, N = 512, r = 8):
peft's LoRA on the fused experts (target_parameters) in bf16 and float32
against apex_ffn.lora on the experts packed as bf16. Each cell: the median
of --reps timed calls after one warm-up; ratios within the same run; the
kernel path (ISA) printed first.

At N = 1 and 16 each packed module's call from Python is also timed
against the same forward timed inside C++ (PackedExperts.forward_seconds),
and once at a tiny shape where the call's own cost is all there is.
"""
import argparse
import copy
import random
import statistics
import time

import torch

import apex_ffn
import apex_ffn.hf  # noqa: F401  (registers "apex_ffn")
from apex_ffn.lora import add_lora
from apex_ffn.packed import pack_experts


def block(experts, d, f, k, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=d, moe_intermediate_size=f, num_experts=experts,
                               num_experts_per_tok=k, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=64, vocab_size=32, intermediate_size=f)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    experts_module = model.model.layers[0].mlp.experts.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in experts_module.parameters():
            p.normal_(0.0, 0.02)
    return model, experts_module


def routing(n, experts, k, d, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)
    return x, ids, w


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpp_overhead(module, n, args, dtype, threads, reps):
    """The module's forward from Python (its dtype casts, the op's checks and call) against the same forward
    timed inside C++ (PackedExperts.forward_seconds, one call). 30·reps rounds, each on fresh routing (the
    same experts again would be an L3-warm artefact), the two in alternating order so neither always runs
    after the other; medians: 'C++ t ms, Python/C++ ratio'."""
    cases = []
    for seed in range(16):
        x, ids, w = routing(n, args.experts, args.k, args.d, dtype, seed=100 + seed)
        cases.append((x, ids, w, x.float().contiguous(), ids.long().contiguous(), w.float().contiguous()))
    y = torch.empty(n, args.d)  # y_sorted None: the extension's scratch, as the module's forward passes
    py, cpp = [], []
    bf16_activations = dtype == torch.bfloat16  # as the module's forward tells the op

    def python_call(c):
        t0 = time.perf_counter()
        module(*c[:3])
        py.append(time.perf_counter() - t0)

    def cpp_call(c):
        cpp.append(module.packed.forward_seconds(c[3], c[4], c[5], False, y, None, threads, 1, bf16_activations))

    with torch.no_grad():
        module(*cases[0][:3])
        for i in range(30 * reps):
            first, second = (python_call, cpp_call) if i % 2 == 0 else (cpp_call, python_call)
            first(cases[i % len(cases)])
            second(cases[(i + 7) % len(cases)])
    return f"C++ {statistics.median(cpp) * 1e3:.3f} ms, Python/C++ {statistics.median(py) / statistics.median(cpp):.3f}"


def call_cost():
    """The Python call's own cost, where the compute is too small to hide it: a packed experts module of
    8 experts of 64 x 64 at N = 1, its call from Python against the forward timed inside C++ (medians of
    3000 each, 1 thread): 'Python t µs, C++ t µs'."""
    torch.set_num_threads(1)
    _, module = block(8, 64, 64, 2, torch.float32)
    holder = torch.nn.Module()
    holder.experts = module
    pack_experts(holder, "q8_0")
    m = holder.experts
    x, ids, w = routing(1, 8, 2, 64, torch.float32)
    y = torch.empty(1, 64)
    py, cpp = [], []
    with torch.no_grad():
        for _ in range(3000):
            t0 = time.perf_counter()
            m(x, ids, w)
            py.append(time.perf_counter() - t0)
            cpp.append(m.packed.forward_seconds(x, ids, w, False, y, None, 1, 1))
    return f"Python {statistics.median(py) * 1e6:.1f} µs, C++ {statistics.median(cpp) * 1e6:.1f} µs"


def call_breakdown(args, types, reps=400):
    """Where the N = 1 call's overhead goes once a step has left the caches cold: each call below runs right
    after a C++-timed forward of other experts (fresh routing every call, 16 routings cycled, the calls in
    shuffled order, one thread), medians: the module's call, the call through nn.Module's own __call__ (which
    the module's skips when no hook is set), its forward() called directly, the extension's one-crossing entry
    (PackedExperts.infer), the C++-timed entry's own wall time, torch.empty of the output."""
    torch.set_num_threads(1)
    _, module = block(args.experts, args.d, args.f, args.k, torch.float32)
    holder = torch.nn.Module()
    holder.experts = module
    pack_experts(holder, types)
    m = holder.experts
    p = m.packed
    cases = [routing(1, args.experts, args.k, args.d, torch.float32, seed=100 + s) for s in range(16)]
    y = torch.empty(1, args.d)
    calls = {"module call": lambda c: m(*c), "nn.Module.__call__": lambda c: torch.nn.Module.__call__(m, *c),
             "forward()": lambda c: m.forward(*c),
             "infer": lambda c: p.infer(c[0], c[1], c[2], False, 1),
             "forward_seconds wall": lambda c: p.forward_seconds(c[0], c[1], c[2], False, y, None, 1, 1),
             "torch.empty alone": lambda c: torch.empty(1, args.d)}
    times, cpp, order, n = {k: [] for k in calls}, [], list(calls.items()), 0
    rng = random.Random(1)
    with torch.no_grad():
        for _ in range(reps):
            rng.shuffle(order)
            for name, fn in order:
                c = cases[n % 16]
                cpp.append(p.forward_seconds(c[0], c[1], c[2], False, y, None, 1, 1))
                c = cases[(n + 1) % 16]
                n += 2
                t0 = time.perf_counter()
                fn(c)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(cpp)
    return f"{types}: C++ forward {base * 1e3:.3f} ms; " + "  ".join(
        f"{k} {statistics.median(v) * 1e6:.0f} µs" + ("" if k == "torch.empty alone" else
                                                     f" (+{(statistics.median(v) - base) * 1e6:.0f})")
        for k, v in times.items())


def forward_cells(args, dtype):
    model, module = block(args.experts, args.d, args.f, args.k, dtype)
    impls = {}
    for name in ("eager", "grouped_mm", "apex_ffn"):
        m = copy.copy(module)
        m.config = copy.copy(module.config)
        m.config._experts_implementation = name
        impls[name] = m
    for types in args.types:
        holder = torch.nn.Module()
        holder.experts = copy.deepcopy(module)
        holder.experts.config = module.config
        pack_experts(holder, types)
        impls[f"packed {types}"] = holder.experts
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n in (1, 16, 512):
            x, ids, w = routing(n, args.experts, args.k, args.d, dtype)
            reps = args.reps if n < 512 else max(3, args.reps // 4)
            cell = {}
            with torch.no_grad():
                for name, m in impls.items():
                    if name == "eager" and n == 512 and args.skip_slow:
                        continue
                    cell[name] = timed(lambda: m(x, ids, w), reps)
            rows.append((threads, n, cell))
            base = cell["grouped_mm"]
            print(f"{str(dtype)[6:]:8s} threads {threads} N {n:3d}  " + "  ".join(
                f"{name} {t * 1e3:8.2f} ms ({base / t:4.2f}x)" for name, t in cell.items()), flush=True)
            if n < 512:
                print(" " * 9 + "the Python call against the same forward timed in C++: " + "  ".join(
                    f"{name} {cpp_overhead(m, n, args, dtype, threads, reps)}" for name, m in impls.items()
                    if name.startswith("packed")), flush=True)
    return rows


def lora_cells(args):
    import peft
    n, r = 512, 8
    torch.set_num_threads(args.lora_threads)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = block(args.experts, args.d, args.f, args.k, dtype)
        pm = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=16, init_lora_weights=False,
                                                        target_parameters=["mlp.experts.gate_up_proj",
                                                                           "mlp.experts.down_proj"]))
        experts = pm.base_model.model.model.layers[0].mlp.experts
        x, ids, w = routing(n, args.experts, args.k, args.d, dtype)
        x.requires_grad_()

        def step():
            y = experts(x, ids, w)
            y.float().pow(2).mean().backward()
        out[f"peft {str(dtype)[6:]}"] = timed(step, max(2, args.reps // 4))
    model, _ = block(args.experts, args.d, args.f, args.k, torch.bfloat16)
    pack_experts(model, "bf16")
    add_lora(model, r, 16)
    experts = model.model.layers[0].mlp.experts
    x, ids, w = routing(n, args.experts, args.k, args.d, torch.bfloat16)
    x.requires_grad_()

    def ours():
        y = experts(x, ids, w)
        y.float().pow(2).mean().backward()
    out["apex_ffn packed bf16"] = timed(ours, max(2, args.reps // 4))
    base = out["peft bfloat16"]
    print(f"LoRA step N {n} r {r} threads {args.lora_threads}  " + "  ".join(
        f"{k} {t * 1e3:9.1f} ms ({base / t:4.2f}x vs peft bf16)" for k, t in out.items()), flush=True)
    return out


def tensor_reads_ab(args, rounds):
    """The N = 1 call's overhead (cpp_overhead) with PackedExperts.infer reading tensors through torch's
    DLPack exchange table against reading their attributes (older torch's way), the two alternated in one
    process, `rounds` rounds per cell, medians: '% over the C++ forward, exchange / attributes'."""
    from apex_ffn import _core
    if not _core._exchange_reads(True):
        print("this torch has no __dlpack_c_exchange_api__: nothing to compare", flush=True)
        return
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for types in args.types:
            _, module = block(args.experts, args.d, args.f, args.k, dtype)
            holder = torch.nn.Module()
            holder.experts = module
            pack_experts(holder, types)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                cell = {True: [], False: []}
                for r in range(rounds):
                    for on in ((True, False) if r % 2 == 0 else (False, True)):
                        _core._exchange_reads(on)
                        out = cpp_overhead(holder.experts, 1, args, dtype, threads, args.reps)
                        cell[on].append(float(out.split()[-1]))
                _core._exchange_reads(True)
                print(f"{str(dtype)[6:]:8s} {types} threads {threads}: % over the C++ forward, exchange "
                      f"{(statistics.median(cell[True]) - 1) * 100:.1f} / attributes "
                      f"{(statistics.median(cell[False]) - 1) * 100:.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=768)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--types", nargs="*", default=["q8_0", "q4_k"])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"], help="the model's dtypes")
    ap.add_argument("--lora-threads", type=int, default=2)
    ap.add_argument("--skip-slow", action="store_true", help="leave out eager at N = 512")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--lora-only", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="only where the N = 1 call's overhead goes, from cold caches, for each of --types")
    ap.add_argument("--tensor-reads-ab", type=int, metavar="ROUNDS", default=0,
                    help="only the N = 1 call's overhead, tensors read through the exchange table against their "
                         "attributes, alternated for ROUNDS rounds, for each of --dtypes and --types")
    args = ap.parse_args()
    print(f"apex_ffn {apex_ffn.__version__}, kernel path {apex_ffn.isa()} (best {apex_ffn.best_isa()}), "
          f"torch {torch.__version__}; block E {args.experts} K {args.k} d {args.d} f {args.f}", flush=True)
    if args.tensor_reads_ab:
        tensor_reads_ab(args, args.tensor_reads_ab)
        return
    if args.breakdown:
        for types in args.types:
            print(call_breakdown(args, types), flush=True)
        return
    if not args.lora_only:
        print(f"the call's own cost (8 experts of 64 x 64, N = 1): {call_cost()}", flush=True)
        for dtype in (getattr(torch, name) for name in args.dtypes):
            forward_cells(args, dtype)
    if not args.no_lora:
        lora_cells(args)


if __name__ == "__main__":
    main()
