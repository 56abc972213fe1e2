#!/usr/bin/env python3
"""Turns bench_moe's JSON output (and, optionally, bench_torch.py's) into the
performance tables of docs/performance.md (Markdown) and a plot (SVG). Standard library only.

    bench_moe --benchmark_repetitions=3 --benchmark_out=moe.json --benchmark_out_format=json
    /usr/bin/python3 tools/bench_torch.py --out torch.jsonl
    python3 tools/bench_report.py moe.json --torch torch.jsonl --table docs/performance_table.md \
        --summary summary.md --plot docs/img/moe_dense_ratio.svg

Medians over repetitions are used when the JSON holds aggregates.
"""
import argparse
import json
import math
import re
from collections import defaultdict

SHAPES = ["small", "medium", "fine", "coarse"]
ROUTINGS = ["uniform", "zipf", "one"]
SHAPE_INFO = {"small": (512, 1376, 8, 2, 1), "medium": (2048, 5504, 64, 4, 2),
              "fine": (1024, 512, 64, 8, 2), "coarse": (1024, 3584, 8, 2, 0)}


def load_gbench(path):
    """{(mode, shape, N, routing, threads): record} using medians when present."""
    data = json.load(open(path))
    runs = defaultdict(list)
    medians = {}
    for b in data["benchmarks"]:
        m = re.match(r"BM_MoE_(Forward|ForwardBackward)/shape:(\d+)/N:(\d+)/routing:(\d+)/threads:(\d+)", b["name"])
        if not m:
            continue
        mode = "forward" if m.group(1) == "Forward" else "forward_backward"
        key = (mode, SHAPES[int(m.group(2))], int(m.group(3)), ROUTINGS[int(m.group(4))], int(m.group(5)))
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                medians[key] = b
        else:
            runs[key].append(b)
    out = {}
    for key, recs in runs.items():
        out[key] = recs[len(recs) // 2]
    out.update(medians)
    return out, data.get("context", {})


def seconds(rec):
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[rec.get("time_unit", "ns")]
    return rec["real_time"] * scale


def load_torch(path):
    out = {}
    if not path:
        return out
    for line in open(path):
        r = json.loads(line)
        out[(r["mode"], r["shape"], r["N"], r["routing"], r["threads"])] = r["seconds"]
    return out


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def table(results, torch):
    lines = ["| shape | N | routing | thr | fwd ms | ×dense | ×loop | bw frac | fwd+bwd ms | ×dense | fb/f | vs PyTorch fwd | vs PyTorch fwd+bwd |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in SHAPES:
        for routing in ROUTINGS:
            for n in [1, 4, 16, 128, 2048]:
                for thr in [1, 2]:
                    f = results.get(("forward", shape, n, routing, thr))
                    fb = results.get(("forward_backward", shape, n, routing, thr))
                    if not f and not fb:
                        continue
                    tf = seconds(f) if f else None
                    tfb = seconds(fb) if fb else None
                    pt_f = torch.get(("forward", shape, n, routing, thr))
                    pt_fb = torch.get(("forward_backward", shape, n, routing, thr))
                    lines.append("| " + " | ".join([
                        shape, str(n), routing, str(thr),
                        fmt(tf * 1e3 if tf else None, 3), fmt(f and f.get("x_dense")), fmt(f and f.get("x_loop")),
                        fmt(f.get("bw_frac") if f else None),
                        fmt(tfb * 1e3 if tfb else None, 3), fmt(fb and fb.get("x_dense")), fmt(fb and fb.get("fb_over_f")),
                        (fmt(pt_f / tf, 1) + "×") if (pt_f and tf) else "–",
                        (fmt(pt_fb / tfb, 1) + "×") if (pt_fb and tfb) else "–"]) + " |")
    return "\n".join(lines)


def summary(results, torch):
    """The compact table of docs/performance.md, uniform routing: one row per shape and
    thread count with the figure each target is about; then how routing skew
    moves the N = 2048 forward."""
    def rec(mode, shape, n, thr, routing="uniform"):
        return results.get((mode, shape, n, routing, thr))

    def vs_torch(mode, shape, n, thr):
        r, t = rec(mode, shape, n, thr), torch.get((mode, shape, n, "uniform", thr))
        return (fmt(t / seconds(r), 1) + "×") if (r and t) else "–"

    def field(mode, shape, n, thr, name, scale=1.0, digits=2):
        r = rec(mode, shape, n, thr)
        return fmt(r[name] * scale, digits) if (r and name in r) else "–"

    lines = ["| shape | threads | decode N=1: % of bw bound | N=4: % | N=2048 fwd ms | fwd ×dense | fwd+bwd ×fwd "
             "| vs PyTorch fwd N=1 | N=128 | N=2048 | fwd+bwd N=2048 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in SHAPES:
        for thr in [1, 2]:
            f2048 = rec("forward", shape, 2048, thr)
            if not f2048:
                continue
            lines.append("| " + " | ".join([
                shape, str(thr), field("forward", shape, 1, thr, "bw_frac", 100, 0),
                field("forward", shape, 4, thr, "bw_frac", 100, 0), fmt(seconds(f2048) * 1e3, 0),
                field("forward", shape, 2048, thr, "x_dense"), field("forward_backward", shape, 2048, thr, "fb_over_f"),
                vs_torch("forward", shape, 1, thr), vs_torch("forward", shape, 128, thr),
                vs_torch("forward", shape, 2048, thr), vs_torch("forward_backward", shape, 2048, thr)]) + " |")
    lines += ["", "| shape | threads | " + " | ".join(f"{r} fwd ×dense" for r in ROUTINGS) + " |",
              "|---|---:|" + "---:|" * len(ROUTINGS)]
    for shape in SHAPES:
        for thr in [1, 2]:
            row = [results.get(("forward", shape, 2048, r, thr)) for r in ROUTINGS]
            if any(row):
                lines.append(f"| {shape} | {thr} | " + " | ".join(fmt(x.get("x_dense") if x else None) for x in row) + " |")
    return "\n".join(lines)


def targets(results, torch):
    """Checks the speed targets; returns Markdown bullet lines."""
    out = []

    def get(mode, shape, n, routing, thr, field=None):
        r = results.get((mode, shape, n, routing, thr))
        if not r:
            return None
        return seconds(r) if field is None else r.get(field)

    for shape in SHAPES:
        d, f, e, k, s = SHAPE_INFO[shape]
        if 2048 * k / e >= 256:
            limit = 1.15 if shape == "fine" else 1.05
            for thr in [1, 2]:
                v = get("forward", shape, 2048, "uniform", thr, "x_dense")
                if v is not None:
                    out.append(f"- forward ≤ {limit}× dense, {shape} N=2048 uniform {thr}T: {v:.3f} — {'met' if v <= limit else 'missed'}")
    for shape in SHAPES:
        for n in [2048]:
            for thr in [1, 2]:
                v = get("forward_backward", shape, n, "uniform", thr, "fb_over_f")
                if v is not None:
                    out.append(f"- fwd+bwd ≤ 3.2× fwd, {shape} N={n} uniform {thr}T: {v:.2f} — {'met' if v <= 3.2 else 'missed'}")
    for shape in SHAPES:
        for n in [1, 4]:
            for thr in [1, 2]:
                v = get("forward", shape, n, "uniform", thr, "bw_frac")
                if v is not None:
                    out.append(f"- decode ≥ 80 % of bandwidth bound, {shape} N={n} {thr}T: {100 * v:.0f} % — {'met' if v >= 0.8 else 'missed'}")
    for shape in SHAPES:
        for mode in ["forward", "forward_backward"]:
            t1, t2 = get(mode, shape, 2048, "uniform", 1), get(mode, shape, 2048, "uniform", 2)
            if t1 and t2:
                out.append(f"- 2 threads ≥ 1.7× 1 thread, {shape} {mode} N=2048: {t1 / t2:.2f}× — {'met' if t1 / t2 >= 1.7 else 'missed'}")
    if torch:
        worst = None
        for key, t in torch.items():
            r = results.get(key)
            if r:
                sp = t / seconds(r)
                worst = sp if worst is None else min(worst, sp)
        if worst is not None:
            out.append(f"- faster than PyTorch at every measured point: slowest speed-up {worst:.1f}× — {'met' if worst > 1 else 'missed'}")
    return "\n".join(out)


def svg_plot(series, title, xlabel, ylabel, path, logx=True, hline=None):
    """Minimal line plot: series = {label: [(x, y), ...]}."""
    w, h, ml, mr, mt, mb = 720, 420, 70, 170, 40, 50
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts] + ([hline] if hline else [])
    if not xs:
        return
    tx = (lambda v: math.log10(v)) if logx else (lambda v: v)
    x0, x1 = tx(min(xs)), tx(max(xs))
    y0, y1 = 0.0, max(ys) * 1.1
    X = lambda v: ml + (tx(v) - x0) / max(x1 - x0, 1e-9) * (w - ml - mr)
    Y = lambda v: h - mb - (v - y0) / max(y1 - y0, 1e-9) * (h - mt - mb)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2 - mr / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
             f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
             f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>',
             f'<text x="{(ml + w - mr) / 2}" y="{h - 12}" text-anchor="middle">{xlabel}</text>',
             f'<text x="18" y="{(mt + h - mb) / 2}" text-anchor="middle" transform="rotate(-90 18 {(mt + h - mb) / 2})">{ylabel}</text>']
    for v in sorted(set(xs)):
        parts.append(f'<line x1="{X(v):.1f}" y1="{h - mb}" x2="{X(v):.1f}" y2="{h - mb + 5}" stroke="black"/>'
                     f'<text x="{X(v):.1f}" y="{h - mb + 18}" text-anchor="middle">{v}</text>')
    for i in range(6):
        v = y0 + (y1 - y0) * i / 5
        parts.append(f'<line x1="{ml - 5}" y1="{Y(v):.1f}" x2="{w - mr}" y2="{Y(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{ml - 8}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    if hline:
        parts.append(f'<line x1="{ml}" y1="{Y(hline):.1f}" x2="{w - mr}" y2="{Y(hline):.1f}" stroke="black" stroke-dasharray="4 3"/>')
    for i, (label, pts) in enumerate(series.items()):
        c = colors[i % len(colors)]
        pts = sorted(pts)
        path_d = " ".join(f"{'M' if j == 0 else 'L'}{X(x):.1f},{Y(y):.1f}" for j, (x, y) in enumerate(pts))
        parts.append(f'<path d="{path_d}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, y in pts:
            parts.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{c}"/>')
        parts.append(f'<line x1="{w - mr + 15}" y1="{mt + 10 + 18 * i}" x2="{w - mr + 35}" y2="{mt + 10 + 18 * i}" stroke="{c}" stroke-width="2"/>'
                     f'<text x="{w - mr + 40}" y="{mt + 14 + 18 * i}">{label}</text>')
    parts.append("</svg>")
    open(path, "w").write("\n".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gbench_json", nargs="+",
                    help="bench_moe JSON output; a configuration in a later file replaces the same one in an earlier file")
    ap.add_argument("--torch", help="bench_torch.py output (JSON lines)")
    ap.add_argument("--table", help="write the Markdown table here (default: stdout)")
    ap.add_argument("--summary", help="write the compact table and the target check (docs/performance.md) here")
    ap.add_argument("--plot", help="write an SVG plot of forward time / dense-equivalent time")
    args = ap.parse_args()
    results, context = {}, {}
    for path in args.gbench_json:
        part, context = load_gbench(path)
        results.update(part)
    torch = load_torch(args.torch)
    md = [f"Machine: {context.get('num_cpus', '?')} CPUs at {context.get('mhz_per_cpu', '?')} MHz; "
          f"{context.get('date', '')}. Times are medians of repetitions.", "", table(results, torch), "",
          "Targets:", "", targets(results, torch), ""]
    text = "\n".join(md)
    if args.summary:
        open(args.summary, "w").write("\n".join([summary(results, torch), "", targets(results, torch), ""]))
    if args.table:
        open(args.table, "w").write(text)
    else:
        print(text)
    if args.plot:
        series = {}
        for shape in SHAPES:
            for thr in [1, 2]:
                pts = [(n, results[("forward", shape, n, "uniform", thr)]["x_dense"])
                       for n in [1, 4, 16, 128, 2048] if ("forward", shape, n, "uniform", thr) in results]
                if pts:
                    series[f"{shape} {thr}T"] = pts
        svg_plot(series, "MoE forward time / dense-equivalent product (uniform routing)", "tokens N",
                 "time ratio (1 = roofline)", args.plot, hline=1.0)


if __name__ == "__main__":
    main()
