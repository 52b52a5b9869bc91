"""The report's figures and its two printed forms: a text table for the terminal, Markdown for docs/speed.md."""
from tools.bench import SUITES
from tools.bench.tables import markdown_table, row, text_table


def suites(report) -> list:
    """The suite modules that ran, in SUITES order."""
    return [SUITES[name] for name in SUITES if name in report["suites"]]


def figures(report) -> dict:
    """Ratios and bounds from the raw measurements, each suite's own."""
    f = {}
    for suite in suites(report):
        f.update(suite.figures(report))
    return f


def engine_rows(report) -> list:
    """The table of one column per engine: load time, each suite's rows, peak RSS."""
    body = [row(report, "load_s", "load (s)", "{:.2f}")]
    for suite in suites(report):
        body += suite.rows(report)
    return body + [row(report, "peak_rss_bytes", "peak RSS (GB)", "{:.2f}", scale=1e9)]


def notes(report, worker) -> list[str]:
    """The notes of the suites of one kind of worker ("single" or "serving"), and its errors (the
    one-sequence workers' errors are in their table's columns instead)."""
    errors = report.get("serving", {}).get("errors", {}) if worker == "serving" else {}
    return [note for suite in suites(report) if suite.WORKER == worker for note in suite.notes(report)] + \
        [f"{engine} (serving): {error}" for engine, error in errors.items()]


def target_lines(report) -> list:
    f = report["figures"]
    lines = []
    for key, op, threshold, label in [t for suite in suites(report) for t in suite.TARGETS]:
        if key in f:
            ok = f[key] >= threshold if op == ">=" else f[key] <= threshold
            unit = "x" if "vs" in key or "over_weights" in key else "%"
            if threshold == 0:   # reported, no target
                lines.append((label, f"{f[key]:.2f}{unit}", "", ""))
                continue
            lines.append((label, f"{f[key]:.2f}{unit}" if unit == "x" else f"{f[key]:.0f}%",
                          f"{op} {threshold}{unit}", "yes" if ok else "NO"))
    return lines


def machine_line(m, sep=", ") -> str:
    gpu = m.get("device") == "cuda"   # then the figures are the GPU's (machine.measure_device)
    measured = ([f"{'device-to-device copy' if gpu else 'streaming read'} {m['bandwidth_GBps']:.1f} GB/s"]
                if "bandwidth_GBps" in m else []) + \
        ([f"{m.get('dtype', 'float32') if gpu else 'float32'} matmul {m['matmul_GFLOPs']:.0f} GFLOP/s"]
         if "matmul_GFLOPs" in m else [])
    return sep.join(measured)


def table(report) -> str:
    m = report["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, numpy {m['numpy']}"]
    if machine_line(m):
        lines.append(f"measured: {machine_line(m)}")
    lines.append(f"checkpoint: {report['checkpoint']}")
    if report["engines"]:
        lines += [""] + text_table(list(report["engines"]), engine_rows(report))
        lines += [f"{n}: {v['error']}" for n, v in report["engines"].items() if "error" in v]
    if notes(report, "single"):
        lines += [""] + notes(report, "single")
    for suite in suites(report):
        for names, body in suite.tables(report):
            lines += [""] + text_table(names, body)
    if notes(report, "serving"):
        lines += [""] + notes(report, "serving")
    targets = target_lines(report)
    if targets:
        width = max(len(t[0]) for t in targets)
        lines.append(f"\n{'target':<{width}}  {'measured':>8}  {'target':>8}   met")
        for label, value, target, ok in targets:
            lines.append(f"{label:<{width}}  {value:>8}  {target:>8}   {ok}")
    return "\n".join(lines)


def markdown(report) -> str:
    m = report["machine"]
    out = [f"Machine: {m['cpu']}, {m['cores']} cores, BLAS/torch threads {m['threads']}, numpy {m['numpy']}, "
           f"Python {m['python']}." + (f" Measured on the spot: {machine_line(m)}." if machine_line(m) else "")]
    if report["engines"]:
        out += [""] + markdown_table(list(report["engines"]), engine_rows(report))
    for note in notes(report, "single"):
        out += ["", note]
    for suite in suites(report):
        for names, body in suite.tables(report):
            out += [""] + markdown_table(names, body)
    for note in notes(report, "serving"):
        out += ["", note]
    targets = target_lines(report)
    if targets:
        out += ["", "| target | measured | wanted | met |", "|---|---:|---:|---|"]
        out += [f"| {label} | {value} | {target} | {ok} |" for label, value, target, ok in targets]
    return "\n".join(out)
