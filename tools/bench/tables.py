"""Rows and tables: what a suite's rows are made of, and how a table prints as text or Markdown."""


def row(report, key, label, fmt="{:.1f}", scale=1) -> tuple[str, list[str]]:
    """One row of the table of one column per engine: each engine's `key` / scale, or - where it has none."""
    return label, ["-" if key not in figures else fmt.format(figures[key] / scale)
                   for figures in report["engines"].values()]


def rate_rows(report, kind, label) -> list:
    """The rows of a suite's `{kind}_{N}_tps` figures, by prompt length N: "{label} tok/s (N-token prompt)"."""
    lengths = sorted({int(k.split("_")[1]) for figures in report["engines"].values() for k in figures
                      if k.startswith(f"{kind}_") and k.endswith("_tps")})
    return [row(report, f"{kind}_{n}_tps", f"{label} tok/s ({n}-token prompt)") for n in lengths]


def text_table(names, body) -> list[str]:
    label_width, width = max(len(r[0]) for r in body), max(12, *map(len, names))
    lines = [" " * label_width + "  " + "  ".join(f"{n:>{width}}" for n in names)]
    lines += [f"{label:<{label_width}}  " + "  ".join(f"{c:>{width}}" for c in cells) for label, cells in body]
    return lines


def markdown_table(names, body) -> list[str]:
    return ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)] + \
        [f"| {label} | " + " | ".join(cells) + " |" for label, cells in body]
