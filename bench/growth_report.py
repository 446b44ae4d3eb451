#!/usr/bin/env python3
"""Tables and SVG charts of bench/growth.sh's results (python3 standard library only).

    python3 bench/growth_report.py --results DIR --svg-dir bench/growth \
        --markdown OUT.md --json OUT.json [--note TEXT]

DIR holds what bench/growth.sh measured: concurrency-N.json, answer-N.json and
prompt-N.json (canarygate-bench reports: medians over rounds, per-round
values), streams-TARGET.json, canaries-proxy.json, canaries-registry.json and
soak-TARGET.json (canarygate-bench-memory). Whatever is there is reported;
each chart is drawn only when its part was measured, so a run of one part
leaves the other charts as they were.

    python3 bench/growth_report.py --self-test   # checks the helpers
"""

import argparse
import glob
import json
import math
import os
import re
import sys
from xml.sax.saxutils import escape

REFERENCE = "nginx"
COLOURS = {
    "nginx": "#4d4d4d",
    "canarygate-echo-first": "#1f77b4",
    "canarygate-echo-first-bg": "#ff7f0e",
}
EXTRA_COLOURS = ["#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def colour(name, names):
    if name in COLOURS:
        return COLOURS[name]
    return EXTRA_COLOURS[names.index(name) % len(EXTRA_COLOURS)]


def short(name):
    """canarygate-echo-first -> echo-first (table headers stay narrow)."""
    return name[len("canarygate-"):] if name.startswith("canarygate-") else name


def size_label(n):
    """1024 -> 1 KB, 65536 -> 64 KB, 1048576 -> 1 MB (binary units, as the axis is set)."""
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def count_label(n):
    return f"{n:,}"


def fmt(value, decimals=0):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:,.{decimals}f}"


def mib(value):
    return None if value is None else value / 1048576.0


def nice_step(span, ticks=5):
    """A round tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks over span."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * power:
            return m * power
    return 10 * power


def tick_label(v):
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


# --- reading ----------------------------------------------------------------


def load_points(results, prefix):
    """[(x, report)] of PREFIX-X.json files, x ascending."""
    points = []
    for path in glob.glob(os.path.join(results, f"{prefix}-*.json")):
        m = re.fullmatch(rf"{prefix}-(\d+)\.json", os.path.basename(path))
        if m:
            with open(path) as f:
                points.append((int(m.group(1)), json.load(f)))
    return sorted(points, key=lambda p: p[0])


def target_names(points):
    names = []
    for _, report in points:
        for t in report["targets"]:
            if t["name"] not in names:
                names.append(t["name"])
    return names


def per_round(report, mode, target, key):
    """The values of `key` for `target` in each round of `mode`."""
    for m in report["modes"]:
        if m["mode"] == mode:
            return [r["measurements"][target][key] for r in m["rounds"] if target in r["measurements"]]
    return []


def curve(points, mode, target, key):
    """[(x, median, min, max)] of a target's medians (and round range) over the points."""
    out = []
    for x, report in points:
        medians = report["medians"].get(mode, {}).get(target)
        if medians is None:
            continue
        values = [v for v in per_round(report, mode, target, key) if v is not None]
        out.append((x, medians.get(key), min(values, default=None), max(values, default=None)))
    return out


# --- SVG --------------------------------------------------------------------


class Figure:
    """A grid of line charts sharing one legend, written as one SVG."""

    def __init__(self, title, columns, rows, panel_w=420, panel_h=280):
        self.title, self.columns, self.rows = title, columns, rows
        self.panel_w, self.panel_h = panel_w, panel_h
        self.top = 64
        self.parts = []
        self.legend = []

    def width(self):
        return self.columns * self.panel_w

    def height(self):
        return self.top + self.rows * self.panel_h

    def add_legend(self, name, stroke):
        if name not in [n for n, _ in self.legend]:
            self.legend.append((name, stroke))

    def panel(self, index, title, series, x_ticks, y_label, x_label, log_x=False, note=None):
        """series: [(name, colour, [(x, y)])]; x_ticks: [(x, label)]."""
        col, row = index % self.columns, index // self.columns
        ox, oy = col * self.panel_w, self.top + row * self.panel_h
        left, right, top, bottom = 64, 16, 28, 48
        w, h = self.panel_w - left - right, self.panel_h - top - bottom
        xs = [x for _, _, pts in series for x, y in pts if y is not None] + [x for x, _ in x_ticks]
        ys = [y for _, _, pts in series for _, y in pts if y is not None]
        p = self.parts
        p.append(f'<text x="{ox + left + w / 2:.1f}" y="{oy + 18}" class="panel">{escape(title)}</text>')
        if not xs or not ys:
            p.append(f'<text x="{ox + left + w / 2:.1f}" y="{oy + top + h / 2:.1f}" class="axis" text-anchor="middle">no data</text>')
            return
        tx = (lambda x: math.log10(x)) if log_x else (lambda x: x)
        x_min, x_max = min(tx(x) for x in xs), max(tx(x) for x in xs)
        if x_max == x_min:
            x_min, x_max = x_min - 1, x_max + 1
        pad = (x_max - x_min) * 0.05
        x_min, x_max = x_min - pad, x_max + pad
        step = nice_step(max(ys))
        y_max = step * math.ceil(max(ys) / step * 1.0001) if max(ys) > 0 else 1.0

        def px(x):
            return ox + left + (tx(x) - x_min) / (x_max - x_min) * w

        def py(y):
            return oy + top + h - y / y_max * h

        # Grid, axes, ticks.
        y = 0.0
        while y <= y_max * 1.0001:
            p.append(f'<line x1="{ox + left}" y1="{py(y):.1f}" x2="{ox + left + w}" y2="{py(y):.1f}" class="grid"/>')
            p.append(f'<text x="{ox + left - 6}" y="{py(y) + 4:.1f}" class="axis" text-anchor="end">{tick_label(y)}</text>')
            y += step
        p.append(f'<line x1="{ox + left}" y1="{oy + top + h}" x2="{ox + left + w}" y2="{oy + top + h}" class="frame"/>')
        p.append(f'<line x1="{ox + left}" y1="{oy + top}" x2="{ox + left}" y2="{oy + top + h}" class="frame"/>')
        for x, label in x_ticks:
            p.append(f'<line x1="{px(x):.1f}" y1="{oy + top + h}" x2="{px(x):.1f}" y2="{oy + top + h + 4}" class="frame"/>')
            p.append(f'<text x="{px(x):.1f}" y="{oy + top + h + 16}" class="axis" text-anchor="middle">{escape(label)}</text>')
        p.append(f'<text x="{ox + left + w / 2:.1f}" y="{oy + top + h + 34}" class="axis" text-anchor="middle">{escape(x_label)}</text>')
        p.append(
            f'<text x="{ox + 14}" y="{oy + top + h / 2:.1f}" class="axis" text-anchor="middle" '
            f'transform="rotate(-90 {ox + 14} {oy + top + h / 2:.1f})">{escape(y_label)}</text>'
        )
        if note:
            p.append(f'<text x="{ox + left + w - 4}" y="{oy + top + 12}" class="note" text-anchor="end">{escape(note)}</text>')
        for name, stroke, pts in series:
            pts = [(x, y) for x, y in pts if y is not None]
            if not pts:
                continue
            self.add_legend(name, stroke)
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            p.append(f'<polyline points="{path}" fill="none" stroke="{stroke}" stroke-width="2"/>')
            if len(pts) <= 40:
                for x, y in pts:
                    p.append(
                        f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{stroke}">'
                        f"<title>{escape(name)}: {y:,.3g}</title></circle>"
                    )

    def svg(self):
        legend = []
        x = 16
        for name, stroke in self.legend:
            legend.append(f'<line x1="{x}" y1="46" x2="{x + 22}" y2="46" stroke="{stroke}" stroke-width="3"/>')
            legend.append(f'<text x="{x + 28}" y="50" class="axis">{escape(name)}</text>')
            x += 36 + 7 * len(name)
        return "\n".join(
            [
                f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width()}" height="{self.height()}" '
                f'viewBox="0 0 {self.width()} {self.height()}" font-family="sans-serif">',
                "<style>.panel{font-size:13px;font-weight:bold;text-anchor:middle}"
                ".axis{font-size:11px;fill:#333}.note{font-size:10px;fill:#666}"
                ".grid{stroke:#e5e5e5}.frame{stroke:#333}.title{font-size:15px;font-weight:bold}</style>",
                f'<rect width="{self.width()}" height="{self.height()}" fill="white"/>',
                f'<text x="16" y="24" class="title">{escape(self.title)}</text>',
                *legend,
                *self.parts,
                "</svg>",
                "",
            ]
        )


def write(path, text):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


# --- the parts ----------------------------------------------------------------


def curve_table(points, mode, x_name, x_label):
    """Markdown rows: per point, each target's req/s and CPU µs/req, canarygate's ratios to nginx."""
    names = target_names(points)
    others = [n for n in names if n != REFERENCE]
    head = f"| {x_name} |" + "".join(f" {short(n)} req/s |" for n in names)
    head += "".join(f" {short(n)} ÷ nginx |" for n in others if REFERENCE in names)
    head += "".join(f" {short(n)} CPU µs/req |" for n in names)
    head += "".join(f" {short(n)} CPU ÷ nginx |" for n in others if REFERENCE in names)
    rule = "|---|" + "---:|" * (head.count("|") - 2)
    rows = [head, rule]
    data = []
    for x, report in points:
        medians = report["medians"].get(mode, {})
        ratios = report.get("ratios", {}).get(mode, {})
        if not medians:
            continue
        row = f"| {x_label(x)} |"
        entry = {"x": x, "targets": {}}
        for n in names:
            row += f" {fmt(medians.get(n, {}).get('rps'))} |"
        for n in others:
            if REFERENCE in names:
                row += f" {fmt(ratios.get(n, {}).get('rps_vs_nginx'), 2)} |"
        for n in names:
            row += f" {fmt(medians.get(n, {}).get('target_cpu_us_per_req'))} |"
        for n in others:
            if REFERENCE in names:
                row += f" {fmt(ratios.get(n, {}).get('cpu_per_req_vs_nginx'), 2)} |"
        for n in names:
            m = medians.get(n, {})
            r = ratios.get(n, {})
            entry["targets"][n] = {
                "rps": m.get("rps"),
                "cpu_us_per_req": m.get("target_cpu_us_per_req"),
                "errors": m.get("errors"),
                "rps_vs_nginx": r.get("rps_vs_nginx"),
                "cpu_per_req_vs_nginx": r.get("cpu_per_req_vs_nginx"),
            }
        rows.append(row)
        data.append(entry)
    return rows, data


def curve_panels(fig, start, points, mode, title, x_label, tick, log_x=True):
    names = target_names(points)
    ticks = [(x, tick(x)) for x, _ in points]
    rps = [(n, colour(n, names), [(x, y) for x, y, _, _ in curve(points, mode, n, "rps")]) for n in names]
    cpu = [(n, colour(n, names), [(x, y) for x, y, _, _ in curve(points, mode, n, "target_cpu_us_per_req")]) for n in names]
    fig.panel(start, f"{title}: throughput", rps, ticks, "requests/s", x_label, log_x)
    fig.panel(start + 1, f"{title}: CPU per request", cpu, ticks, "CPU µs per request (process tree)", x_label, log_x)


def errors_in(points):
    return sum(int(r.get("errors", 0) or 0) for _, r in points)


def answer_check(points):
    """Checked answers shorter than the point's length (the answer axis). canarygate's
    usage counts its canary echo too (it raises max_tokens to fit it): longer is fine."""
    notes = []
    for x, report in points:
        for m in report["modes"]:
            for name, check in m["checks"].items():
                tokens = check.get("completion_tokens")
                if tokens is not None and tokens < x:
                    notes.append(f"{name} at {x}: {check.get('completion_tokens')} tokens")
    return notes


def order_key(name):
    """nginx first, then the canarygate configs, as in the other tables."""
    known = list(COLOURS)
    return (known.index(name) if name in known else len(known), name)


def streams_part(data, fig_path, md, out):
    # A point where streams failed says nothing per stream: the failed ones'
    # memory may be in it.
    rows = sorted(data["streams"], key=lambda r: (order_key(r["target"]), r["streams"]))
    for r in rows:
        r["complete"] = r["failed"] == 0 and r["ended"] == 0
    names = []
    for r in rows:
        if r["target"] not in names:
            names.append(r["target"])
    md.append("| target | open streams | failed | RSS before | RSS with the streams open | bytes per open stream |")
    md.append("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        md.append(
            f"| {r['target']} | {count_label(r['open'])} of {count_label(r['streams'])} | {r['failed']} | "
            f"{fmt(mib(r['rss_before']), 1)} MiB | {fmt(mib(r['rss_open']), 1)} MiB | "
            f"{fmt(r['bytes_per_stream']) if r['complete'] else '- (not all opened)'} |"
        )
    out["streams"] = rows
    fig = Figure("Resident memory against open streams (RSS of each process tree)", 2, 1)
    counts = sorted({r["streams"] for r in rows})
    ticks = [(c, count_label(c)) for c in counts]
    fig.panel(
        0,
        "RSS with the streams open",
        [(n, colour(n, names), [(r["streams"], mib(r["rss_open"])) for r in rows if r["target"] == n]) for n in names],
        ticks, "MiB", "open streams", log_x=True,
    )
    fig.panel(
        1,
        "Bytes per open stream (points where all opened)",
        [(n, colour(n, names), [(r["streams"], r["bytes_per_stream"]) for r in rows if r["target"] == n and r["complete"]]) for n in names],
        ticks, "bytes", "open streams", log_x=True,
    )
    write(fig_path, fig.svg())


def canaries_part(proxy, registry, md, out):
    md.append("| where | live canaries | RSS growth | bytes per canary |")
    md.append("|---|---:|---:|---:|")
    if registry:
        for p in registry["points"]:
            md.append(
                f"| registry alone (`MemoryRegistry`, in process) | {count_label(p['canaries'])} | "
                f"{fmt(mib(p['rss_growth_bytes']), 1)} MiB | {fmt(p['bytes_per_canary'])} |"
            )
    if proxy:
        for r in proxy["canaries"]:
            md.append(
                f"| {r['target']}, after {count_label(r['requests'])} requests (upper bound) | "
                f"{count_label(r['canaries'])} | {fmt(mib(r['rss_after'] - r['rss_before']), 1)} MiB | "
                f"{fmt(r['bytes_per_canary'])} |"
            )
    out["canaries"] = {"registry": registry, "proxy": proxy}


def per_minute(slope):
    """A soak's slope in bytes/minute as text: KiB/min, or MiB/min from 1 MiB/min on."""
    if slope is None:
        return "-"
    if abs(slope) >= 1048576:
        return f"{slope / 1048576:,.1f} MiB/min"
    return f"{slope / 1024:,.1f} KiB/min"


def soak_part(soaks, fig_path, md, out):
    md.append("| target | minutes | rate | requests | failed | p99 µs | RSS start | RSS end | RSS max | slope |")
    md.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    names = [s["target"] for s in soaks]
    for s in soaks:
        slope = s.get("slope_bytes_per_minute")
        md.append(
            f"| {s['target']} | {s['minutes']:g} | {s['rate']:.0f}/s | {count_label(s['requests'])} | {s['errors']} | "
            f"{fmt(s['p99_us'])} | {fmt(mib(s['rss_start']), 1)} MiB | {fmt(mib(s['rss_end']), 1)} MiB | "
            f"{fmt(mib(s['rss_max']), 1)} MiB | {per_minute(slope)} |"
        )
    # canarygate's RSS less its audit store's page cache (bounded, filling
    # as the audit file grows), where the soak read it from /metrics.
    # What it held, after the warm-up: canaries and client connections.
    less = [s for s in soaks if s.get("less_audit_cache")]
    if less:
        md += [
            "",
            "| target | audit cache max | RSS less the cache: start | end | max | slope | canaries held | client connections |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in less:
            c = s["less_audit_cache"]

            def held(name):
                values = [v for t, v in s["gauges"].get(name, []) if t >= s["warmup_seconds"]]
                return f"{min(values):,.0f}–{max(values):,.0f}" if values else "-"

            md.append(
                f"| {s['target']} | {fmt(mib(c['cache_max']), 1)} MiB | {fmt(mib(c['start']), 1)} MiB | "
                f"{fmt(mib(c['end']), 1)} MiB | {fmt(mib(c['max']), 1)} MiB | {per_minute(c.get('slope_bytes_per_minute'))} | "
                f"{held('canarygate_canaries_in_memory')} | {held('canarygate_client_connections')} |"
            )
    out["soak"] = soaks
    fig = Figure("Resident memory over a soak at half of saturation", 1, 1, panel_w=760)
    longest = max(s["minutes"] for s in soaks)
    step = nice_step(longest, 10)
    ticks = [(k * step, f"{k * step:g}") for k in range(int(longest / step) + 1)]
    series = [(n, colour(n, names), [(t / 60.0, mib(v)) for t, v in s["samples"]]) for n, s in zip(names, soaks)]
    lines = names + [f"{s['target']}, audit cache" for s in less]
    for s in less:
        n = f"{s['target']}, audit cache"
        cache = s["gauges"]["canarygate_audit_cache_bytes"]
        series.append((n, colour(n, lines), [(t / 60.0, mib(v)) for t, v in cache]))
    fig.panel(
        0,
        "RSS of canarygate, and its audit store's page cache",
        series,
        ticks, "MiB", "minutes", note="slope: least squares after the warm-up",
    )
    write(fig_path, fig.svg())


def report(results, svg_dir, note):
    md, out = [], {"note": note}
    if note:
        md += [note, ""]
    concurrency = load_points(results, "concurrency")
    answers = load_points(results, "answer")
    prompts = load_points(results, "prompt")
    if concurrency:
        fig = Figure("Throughput and CPU per request against concurrency (saturated, 64-token answers)", 2, 2)
        out["concurrency"] = {}
        for k, mode in enumerate(("non-stream", "stream")):
            rows, data = curve_table(concurrency, mode, "clients", str)
            if data:
                md += [f"**Against concurrency, {mode}** (64-token answers):", "", *rows, ""]
                out["concurrency"][mode] = data
        # Panels: throughput row, CPU row.
        names = target_names(concurrency)
        ticks = [(x, str(x)) for x, _ in concurrency]
        for k, mode in enumerate(("non-stream", "stream")):
            series = [(n, colour(n, names), [(x, y) for x, y, _, _ in curve(concurrency, mode, n, "rps")]) for n in names]
            fig.panel(k, f"{mode}: throughput", series, ticks, "requests/s", "clients", log_x=True)
            series = [(n, colour(n, names), [(x, y) for x, y, _, _ in curve(concurrency, mode, n, "target_cpu_us_per_req")]) for n in names]
            fig.panel(2 + k, f"{mode}: CPU per request", series, ticks, "CPU µs per request", "clients", log_x=True)
        write(os.path.join(svg_dir, "concurrency.svg"), fig.svg())
    if answers or prompts:
        fig = Figure("Throughput and CPU per request against answer and prompt length (saturated)", 2, 2)
        if answers:
            rows, data = curve_table(answers, "stream", "answer tokens", count_label)
            md += ["**Against answer length, streamed:**", "", *rows, ""]
            out["answer_length"] = data
            problems = answer_check(answers)
            for problem in problems:
                md.append(f"warning: an answer was shorter than asked: {problem}")
            if problems:
                md.append("")
            curve_panels(fig, 0, answers, "stream", "answer length (streamed)", "answer tokens", count_label)
        if prompts:
            rows, data = curve_table(prompts, "non-stream", "prompt", size_label)
            md += ["**Against prompt length, non-streamed** (64-token answers):", "", *rows, ""]
            out["prompt_length"] = data
            curve_panels(fig, 2, prompts, "non-stream", "prompt length (non-streamed)", "prompt bytes", size_label)
        write(os.path.join(svg_dir, "length.svg"), fig.svg())
    errors = errors_in(concurrency + answers + prompts)
    if errors:
        md += [f"warning: {errors} failed request(s) in the curves; see the per-point reports", ""]
    out["curve_errors"] = errors
    stream_files = sorted(glob.glob(os.path.join(results, "streams*.json")))
    if stream_files:
        data = {"streams": []}
        for path in stream_files:
            with open(path) as f:
                data["streams"] += json.load(f)["streams"]
        md += ["**Resident memory against open streams** (whole process tree, slow streams):", ""]
        streams_part(data, os.path.join(svg_dir, "streams.svg"), md, out)
        md.append("")
    proxy_path = os.path.join(results, "canaries-proxy.json")
    registry_path = os.path.join(results, "canaries-registry.json")
    proxy = registry = None
    if os.path.exists(proxy_path):
        with open(proxy_path) as f:
            proxy = json.load(f)
    if os.path.exists(registry_path) and os.path.getsize(registry_path) > 0:
        with open(registry_path) as f:
            registry = json.load(f)
    if proxy or registry:
        md += ["**Resident memory per live canary:**", ""]
        canaries_part(proxy, registry, md, out)
        md.append("")
    soaks = []
    for path in sorted(glob.glob(os.path.join(results, "soak-*.json"))):
        with open(path) as f:
            soaks.append(json.load(f)["soak"])
    if soaks:
        md += ["**Soak:** steady load at half of saturation, RSS sampled:", ""]
        soak_part(soaks, os.path.join(svg_dir, "soak.svg"), md, out)
        md.append("")
    return "\n".join(md) + "\n", out


def self_test():
    assert nice_step(1000) == 200 and nice_step(7) == 2 and nice_step(0.3) == 0.1 and nice_step(0) == 1.0
    assert size_label(1024) == "1 KB" and size_label(65536) == "64 KB" and size_label(1 << 20) == "1 MB"
    assert size_label(1000) == "1000 B"
    assert short("canarygate-echo-first-bg") == "echo-first-bg" and short("nginx") == "nginx"
    assert fmt(None) == "-" and fmt(float("nan")) == "-" and fmt(1234.5, 1) == "1,234.5"
    assert tick_label(2000) == "2k" and tick_label(0.5) == "0.5"
    assert per_minute(None) == "-" and per_minute(2048) == "2.0 KiB/min" and per_minute(-3 * 1048576) == "-3.0 MiB/min"
    report_a = {
        "targets": [{"name": "nginx"}, {"name": "canarygate-echo-first"}],
        "modes": [{"mode": "stream", "checks": {}, "rounds": [
            {"measurements": {"nginx": {"rps": 10.0}, "canarygate-echo-first": {"rps": 4.0}}},
            {"measurements": {"nginx": {"rps": 12.0}, "canarygate-echo-first": {"rps": 6.0}}},
        ]}],
        "medians": {"stream": {"nginx": {"rps": 11.0, "target_cpu_us_per_req": 100.0},
                               "canarygate-echo-first": {"rps": 5.0, "target_cpu_us_per_req": 300.0}}},
        "ratios": {"stream": {"canarygate-echo-first": {"rps_vs_nginx": 0.45, "cpu_per_req_vs_nginx": 3.0}}},
    }
    points = [(16, report_a)]
    assert curve(points, "stream", "canarygate-echo-first", "rps") == [(16, 5.0, 4.0, 6.0)]
    rows, data = curve_table(points, "stream", "clients", str)
    assert rows[2] == "| 16 | 11 | 5 | 0.45 | 100 | 300 | 3.00 |", rows[2]
    assert data[0]["targets"]["nginx"]["rps"] == 11.0
    fig = Figure("t", 1, 1)
    fig.panel(0, "p", [("nginx", "#000", [(1, 2.0), (4, None), (16, 3.0)])], [(1, "1"), (16, "16")], "y", "x", log_x=True)
    svg = fig.svg()
    assert svg.startswith("<svg") and svg.count("<circle") == 2 and "nginx" in svg
    print("growth_report self-test: ok")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results")
    parser.add_argument("--svg-dir", default="bench/growth")
    parser.add_argument("--markdown")
    parser.add_argument("--json")
    parser.add_argument("--note", default="")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return
    if not args.results:
        parser.error("--results is required")
    text, data = report(args.results, args.svg_dir, args.note)
    if args.markdown:
        write(args.markdown, text)
    else:
        sys.stdout.write(text)
    if args.json:
        write(args.json, json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
