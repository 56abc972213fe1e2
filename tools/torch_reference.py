#!/usr/bin/env python3
"""PyTorch reference for apex-ffn checkpoints, in both directions.

Defines apex-ffn's MoEFFN (docs/math.md#mixture-of-experts) as a PyTorch
module (router Linear(d, E, bias=False);
routed and shared experts, each a SwiGLU DenseFFN with w_gate, w_up, w_down
Linear(bias=False); top-K over router scores + balancing bias; softmax over
the selected scores) and reads and writes safetensors files with nothing but
the standard library and torch (the format is written by hand with struct
and json, the `safetensors` package is not needed).

Commands
  write DIR [--layer moe|swiglu] [--dtype F64|F32|BF16] [--seed N] [sizes]
        Random weights (rounded to DTYPE), a fixed input x and the float64
        output y = layer(x):  DIR/<name>.safetensors (the state_dict, with the
        layer's configuration under __metadata__ "apex.config") and
        DIR/<name>_io.safetensors (x and y, F64).  <name> = <layer>_<dtype>
        unless --name is given.
  check WEIGHTS IO [--tol 1e-10]
        Builds the layer described by WEIGHTS' metadata, loads WEIGHTS with
        load_state_dict(strict=True), runs IO's x through it in float64 and
        compares with IO's y (norm-wise relative error). Exit status 0 if
        within --tol, 1 otherwise.
  fixtures DIR [--seed-base N]
        The whole fixture set of tests/data (swiglu_f64, moe_f64, moe_f32,
        moe_bf16, moe_unbiased_f64) with seeds N+1 … N+5; N = 0 reproduces
        the committed files.
  check-dir DIR [--tol 1e-10]
        `check` for every X.safetensors in DIR that has an X_io.safetensors.
  show FILE
        Prints the header of a safetensors file.

`expert_bias` (docs/math.md#load-balancer) is a persistent buffer, so it is
part of the state_dict (a plain attribute, as the APEX-1 documents keep it,
would be silently dropped by a checkpoint). It is still not a Parameter and
gets no gradient.
"""

import argparse
import ctypes
import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# ───────────────────────────── safetensors by hand ─────────────────────────────

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the reference implementation's cap


class FormatError(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise FormatError(f"duplicate key {k!r} in the header")
        out[k] = v
    return out


def _tensor_bytes(t):
    t = t.detach().contiguous().cpu()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def save_file(path, tensors, metadata=None):
    """Writes {name: tensor} (and string metadata) to `path`, atomically."""
    if sys.byteorder != "little":
        raise RuntimeError("this writer assumes a little-endian host")
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        if t.dtype not in NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
        data = _tensor_bytes(t)
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # 8 + N is a multiple of 8
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for b in blobs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_file(path):
    """Returns ({name: tensor}, metadata) after checking the file's structure."""
    if sys.byteorder != "little":
        raise RuntimeError("this reader assumes a little-endian host")
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise FormatError("shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER or n > len(raw) - 8:
        raise FormatError(f"header length {n} does not fit")
    text = raw[8:8 + n]
    if not text.startswith(b"{"):
        raise FormatError("header does not start with '{'")
    header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates)
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {}) or {}
    tensors, spans = {}, []
    for name, info in header.items():
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise FormatError(f"{name}: unsupported dtype {info.get('dtype')!r}")
        shape = info["shape"]
        begin, end = info["data_offsets"]
        if any(not isinstance(s, int) or s < 0 for s in shape) or not (0 <= begin <= end <= len(data)):
            raise FormatError(f"{name}: bad shape or offsets")
        size = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        if end - begin != size:
            raise FormatError(f"{name}: {end - begin} bytes for shape {shape}")
        spans.append((begin, end))
        if size == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).reshape(shape).clone()
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise FormatError("tensors overlap or leave a gap")
        pos = end
    if pos != len(data):
        raise FormatError("tensors do not cover the data buffer")
    return tensors, metadata


# ─────────────────────────────── the reference layer ──────────────────────────


class DenseFFN(nn.Module):
    """SwiGLU: w_down(SiLU(w_gate(x)) * w_up(x)), no biases."""

    def __init__(self, d_model, d_ffn):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ffn, bias=False)
        self.w_up = nn.Linear(d_model, d_ffn, bias=False)
        self.w_down = nn.Linear(d_ffn, d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoEFFN(nn.Module):
    """The 3-tier MoE of docs/math.md#mixture-of-experts: shared experts + top-K routed experts."""

    def __init__(self, d_model, d_ffn, n_experts, n_active, n_shared, weights_from_unbiased=False):
        super().__init__()
        self.n_experts, self.n_active = n_experts, n_active
        self.weights_from_unbiased = weights_from_unbiased
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList([DenseFFN(d_model, d_ffn) for _ in range(n_experts)])
        self.shared_experts = nn.ModuleList([DenseFFN(d_model, d_ffn) for _ in range(n_shared)])
        self.register_buffer("expert_bias", torch.zeros(n_experts))

    def route(self, x_flat):
        logits = self.router(x_flat)                       # [N, E], unbiased
        scores = logits + self.expert_bias.unsqueeze(0)    # selection uses the bias
        top_vals, top_idx = scores.topk(self.n_active, dim=-1)
        chosen = logits.gather(-1, top_idx) if self.weights_from_unbiased else top_vals
        return scores, top_idx, torch.softmax(chosen, dim=-1)

    def forward(self, x):
        shape = x.shape
        x_flat = x.reshape(-1, shape[-1])                  # [N, d]
        _, top_idx, top_w = self.route(x_flat)
        out = torch.zeros_like(x_flat)
        for e in range(self.n_experts):
            rows, slots = (top_idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.experts[e](x_flat[rows])
            out.index_add_(0, rows, y * top_w[rows, slots].unsqueeze(-1))
        for shared in self.shared_experts:
            out = out + shared(x_flat)
        return out.reshape(shape)


def build(config):
    layer = config["layer"]
    if layer == "SwiGLU":
        return DenseFFN(config["d_model"], config["d_ffn"])
    if layer == "MoEFFN":
        return MoEFFN(config["d_model"], config["d_ffn"], config["n_experts"], config["n_active"],
                      config["n_shared"], bool(config.get("weights_from_unbiased", False)))
    raise SystemExit(f"unknown layer {layer!r} in apex.config")


def routing_margin(model, x):
    """Smallest gap between the K-th and (K+1)-th score over tokens (inf if K = E)."""
    if not isinstance(model, MoEFFN) or model.n_active == model.n_experts:
        return math.inf
    scores, _, _ = model.route(x)
    s = scores.sort(dim=-1, descending=True).values
    return float((s[:, model.n_active - 1] - s[:, model.n_active]).min())


# ─────────────────────────────────── commands ─────────────────────────────────


def cmd_write(a):
    torch.manual_seed(a.seed)
    if a.layer == "swiglu":
        config = {"layer": "SwiGLU", "d_model": a.d_model, "d_ffn": a.d_ffn}
    else:
        config = {"layer": "MoEFFN", "d_model": a.d_model, "d_ffn": a.d_ffn, "n_experts": a.n_experts,
                  "n_active": a.n_active, "n_shared": a.n_shared,
                  "weights_from_unbiased": a.weights_from_unbiased}
    model = build(config).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5)
        if isinstance(model, MoEFFN):
            model.expert_bias.copy_(torch.rand(model.n_experts, dtype=torch.float64) * 0.4 - 0.2)
        # What the file stores is what the output is computed from.
        storage = DTYPES[a.dtype]
        for t in model.state_dict().values():
            t.copy_(t.to(storage).to(torch.float64))
    # Redraw x until no token sits near a top-K tie, so that rounding
    # differences between implementations cannot flip a selection.
    for _ in range(100):
        x = torch.randn(a.tokens, a.d_model, dtype=torch.float64)
        if routing_margin(model, x) > 1e-6:
            break
    with torch.no_grad():
        y = model(x)
    os.makedirs(a.dir, exist_ok=True)
    name = a.name or f"{a.layer}_{a.dtype.lower()}"
    weights = os.path.join(a.dir, f"{name}.safetensors")
    io = os.path.join(a.dir, f"{name}_io.safetensors")
    meta = {"format": "pt", "apex.config": json.dumps(config, sort_keys=True)}
    save_file(weights, {k: v.to(storage) for k, v in model.state_dict().items()}, meta)
    save_file(io, {"x": x, "y": y}, {"format": "pt", "producer": f"torch {torch.__version__}", "seed": str(a.seed)})
    print(f"wrote {weights} and {io}")


def cmd_check(a):
    state, meta = load_file(a.weights)
    if "apex.config" not in meta:
        raise SystemExit(f"{a.weights}: no 'apex.config' in __metadata__")
    model = build(json.loads(meta["apex.config"])).double()
    model.load_state_dict(state, strict=True)  # names and shapes must match exactly
    io, _ = load_file(a.io)
    x, y_ref = io["x"].double(), io["y"].double()
    with torch.no_grad():
        y = model(x)
    scale = float(y_ref.norm())
    err = float((y - y_ref).norm()) / (scale if scale > 0 else 1.0)
    ok = err <= a.tol
    print(f"{'ok' if ok else 'MISMATCH'}: {a.weights}: relative error {err:.3e} (tolerance {a.tol:.0e}), "
          f"routing margin {routing_margin(model, x):.2e}, {len(state)} tensors")
    return 0 if ok else 1


FIXTURES = [  # (name, write arguments)
    ("swiglu_f64", ["--layer", "swiglu"]),
    ("moe_f64", []),
    ("moe_f32", ["--dtype", "F32"]),
    ("moe_bf16", ["--dtype", "BF16"]),
    ("moe_unbiased_f64", ["--weights-from-unbiased", "--n-experts", "6", "--n-active", "3", "--n-shared", "2"]),
]


def cmd_fixtures(a):
    for i, (name, args) in enumerate(FIXTURES, start=1):
        main(["write", a.dir, "--seed", str(a.seed_base + i), "--name", name] + args)


def cmd_check_dir(a):
    pairs = sorted(f[:-len(".safetensors")] for f in os.listdir(a.dir)
                   if f.endswith(".safetensors") and not f.endswith("_io.safetensors")
                   and os.path.exists(os.path.join(a.dir, f[:-len(".safetensors")] + "_io.safetensors")))
    if not pairs:
        print(f"no checkpoint/_io pairs in {a.dir}")
        return 1
    failed = 0
    for stem in pairs:
        ns = argparse.Namespace(weights=os.path.join(a.dir, stem + ".safetensors"),
                                io=os.path.join(a.dir, stem + "_io.safetensors"), tol=a.tol)
        failed += cmd_check(ns)
    return 1 if failed else 0


def cmd_show(a):
    with open(a.file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        print(json.dumps(json.loads(f.read(n).decode("utf-8")), indent=2))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a reference checkpoint and its input/output")
    w.add_argument("dir")
    w.add_argument("--layer", choices=["moe", "swiglu"], default="moe")
    w.add_argument("--dtype", choices=["F64", "F32", "BF16"], default="F64")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--d-model", type=int, default=8)
    w.add_argument("--d-ffn", type=int, default=12)
    w.add_argument("--n-experts", type=int, default=4)
    w.add_argument("--n-active", type=int, default=2)
    w.add_argument("--n-shared", type=int, default=1)
    w.add_argument("--tokens", type=int, default=6)
    w.add_argument("--weights-from-unbiased", action="store_true")
    w.add_argument("--name", help="file name stem (default <layer>_<dtype>)")
    c = sub.add_parser("check", help="load a checkpoint into PyTorch and compare outputs")
    c.add_argument("weights")
    c.add_argument("io")
    c.add_argument("--tol", type=float, default=1e-10)
    fx = sub.add_parser("fixtures", help="write the test fixture set")
    fx.add_argument("dir")
    fx.add_argument("--seed-base", type=int, default=0)
    cd = sub.add_parser("check-dir", help="check every checkpoint/_io pair in a folder")
    cd.add_argument("dir")
    cd.add_argument("--tol", type=float, default=1e-10)
    s = sub.add_parser("show", help="print a file's header")
    s.add_argument("file")
    a = p.parse_args(argv)
    commands = {"write": cmd_write, "check": cmd_check, "fixtures": cmd_fixtures, "check-dir": cmd_check_dir,
                "show": cmd_show}
    return commands[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
