"""Run the lessons in notebooks/ and save them with their outputs:

    python -m tools.notebooks                          # every lesson
    python -m tools.notebooks notebooks/02-generation.md [--timeout 300]
    python -m tools.notebooks docs/walkthrough.md      # lesson 01, whose source is a docs page
    python -m tools.notebooks --student [--out DIR]    # students' copies: no solutions, no outputs

The source of a lesson is one Markdown file that jupytext reads: notebooks/NN-name.md, or the docs page
that SOURCES names for it, where the page and the lesson teach the same thing (one source, so that the
two cannot drift apart). Its ```python blocks are the code cells; every other block stays in the prose.
This reads it, executes it on a fresh python3 kernel (nbclient) in a temporary directory, with this
checkout's npqwen first on the kernel's path, and writes notebooks/NN-name.ipynb with every output,
pictures included. The saved file is stable across re-runs: cell ids are numbered, timing metadata is
dropped, a cell's printing is one piece per stream, and the lessons print no timings and no float
differences (only the bounds they check), which vary from machine to machine.
A cell that fails stops that notebook with the cell and its error, and nothing is written for it.
Each heading starts a Markdown cell. `--student` runs nothing: it writes each lesson's cells without the
worked solutions (every "### Solution N" section becomes "### Exercise N" and a code cell to answer in) and
without outputs, into build/student/ or --out DIR.
tests/test_notebooks.py checks that each .ipynb holds the cells its source makes, and runs every lesson.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

try:
    import jupytext
    import nbformat
    from jupyter_client.kernelspec import NoSuchKernel
    from jupytext.languages import _JUPYTER_LANGUAGES
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
except ImportError as e:   # the test extra has them too: tests/test_notebooks.py fails here rather than skip
    raise ImportError(f"{e.name} is missing: the notebooks need jupytext, nbclient, nbformat and ipykernel "
                      '(pip install -e ".[notebooks]")') from e

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT = 300   # seconds for one cell; a whole lesson takes seconds on the tiny model, a minute at most
# Lessons whose source is a docs page rather than notebooks/NN-name.md: the page is the lesson.
SOURCES = {"01-forward-pass": ROOT / "docs" / "walkthrough.md", "04-moe": ROOT / "docs" / "moe.md"}
# The pictures' size and resolution, once for every lesson (matplotlib also reads it from a notebook's folder).
MATPLOTLIBRC = NOTEBOOKS / "matplotlibrc"
# Where `--student` writes the lessons without their solutions (git ignores build/).
STUDENT = ROOT / "build" / "student"
# The kernel of a source without a jupytext header (a docs page needs none: GitHub would show it as a table).
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


class NotebookError(Exception):
    """A cell of a lesson failed: the message names the lesson, the cell and the error."""


def lessons() -> dict[str, Path]:
    """Each lesson's name and source, in order: notebooks/NN-name.md (notebooks/README.md is not one), or
    the docs page in SOURCES."""
    names = {p.stem for p in NOTEBOOKS.glob("[0-9][0-9]-*.md")} | set(SOURCES)
    return {name: SOURCES.get(name, NOTEBOOKS / f"{name}.md") for name in sorted(names)}


def notebook(source: Path) -> Path:
    """Where the lesson made from `source` is saved: notebooks/NN-name.ipynb for a docs page in SOURCES,
    else beside the source."""
    name = next((n for n, s in SOURCES.items() if s.resolve() == source.resolve()), None)
    return NOTEBOOKS / f"{name}.ipynb" if name else source.with_suffix(".ipynb")


def shown_only(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Only ```python blocks are code cells: jupytext makes a ```bash block (any Jupyter language) a %%bash
    cell, which here goes back into the prose as the block it was, joined to the Markdown around it."""
    cells = []
    for cell in nb.cells:
        magic, _, body = cell.source.partition("\n")
        language = magic[2:].strip() if cell.cell_type == "code" and magic.startswith("%%") else ""
        if language in _JUPYTER_LANGUAGES and language != "python":
            cell = nbformat.v4.new_markdown_cell(f"```{language}\n{body}\n```")
        if cells and cell.cell_type == cells[-1].cell_type == "markdown":
            cells[-1].source += "\n\n" + cell.source
        else:
            cells.append(cell)
    nb.cells = [part for cell in cells for part in at_headings(cell)]
    return nb


def at_headings(cell: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    """A Markdown cell split before each heading (outside a fenced block), so that a section starts a cell:
    the list of exercises and "### Solution 1" are two cells, and a student's copy can drop the second."""
    if cell.cell_type != "markdown":
        return [cell]
    parts, fenced = [[]], False
    for line in cell.source.split("\n"):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and re.match(r"#{1,6} ", line) and any(s.strip() for s in parts[-1]):
            parts.append([])
        parts[-1].append(line)
    return [nbformat.v4.new_markdown_cell("\n".join(part).strip("\n")) for part in parts]


def read(source: Path) -> nbformat.NotebookNode:
    """The notebook jupytext makes from a lesson's Markdown, its ```python blocks the only code cells, the
    python3 kernel if the source names none, and cell ids numbered (jupytext draws random ones) so that the
    saved file does not change when the lesson does not."""
    nb = shown_only(jupytext.read(source))
    nb.metadata.setdefault("kernelspec", nbformat.from_dict(KERNELSPEC))
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"
    return nb


def kernel_env() -> dict:
    """The kernel's environment: this one, with this checkout first on PYTHONPATH (an installed npqwen
    may be another checkout's), one BLAS thread unless the caller chose, no MPLBACKEND (a backend such as
    Agg set for scripts would keep the pictures out of the notebook; the kernel's own is inline), and the
    lessons' matplotlibrc (the pictures' resolution), which the temporary folder it runs in does not hold."""
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)
    env["MATPLOTLIBRC"] = str(MATPLOTLIBRC)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def execute(nb: nbformat.NotebookNode, name: str, cwd: Path, timeout: int = CELL_TIMEOUT) -> float:
    """Run every cell of `nb` in place on a fresh python3 kernel started in `cwd`; the seconds it took.
    Raises NotebookError with the failing cell's source and error."""
    client = NotebookClient(nb, kernel_name="python3", timeout=timeout, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}},
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])   # not its TCP warning
    start = time.perf_counter()
    try:
        client.execute(env=kernel_env())
    except CellExecutionError as e:   # its message holds the cell's source and the traceback
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))   # the traceback without its terminal colours
        raise NotebookError(f"{name}: a cell failed\n{text}") from None
    except TimeoutError as e:
        raise NotebookError(f"{name}: a cell ran past {timeout} s (--timeout)\n{e}") from None
    except NoSuchKernel:
        raise NotebookError(f'{name}: no python3 kernel: pip install ipykernel (or -e ".[notebooks]")') from None
    return time.perf_counter() - start


def stable(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop what changes between runs of the same lesson: each cell's execution timestamps, and where
    the kernel happened to flush a cell's printing (consecutive stdout or stderr pieces become one)."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        outputs = []
        for out in cell.get("outputs", []):
            last = outputs[-1] if outputs else None
            if out.output_type == "stream" and last is not None and last.output_type == "stream" \
                    and last.name == out.name:
                last.text += out.text
            else:
                outputs.append(out)
        if cell.cell_type == "code":
            cell.outputs = outputs
    return nb


def run(source: Path, timeout: int = CELL_TIMEOUT) -> float:
    """Execute one lesson and write its .ipynb (`notebook(source)`); the seconds it took."""
    nb = read(source)
    with tempfile.TemporaryDirectory(prefix="npqwen-notebook-") as cwd:
        seconds = execute(nb, source.name, Path(cwd), timeout)
    nbformat.write(stable(nb), notebook(source))
    return seconds


def student(nb: nbformat.NotebookNode) -> tuple[nbformat.NotebookNode, int]:
    """A student's copy of a lesson, and how many solution code cells it left out: its cells without the
    worked solutions and without outputs. Each "### Solution N: ..." section (its heading, prose and code,
    up to the next heading of level 1-3) becomes "### Exercise N: ..." and one code cell to answer in; the
    exercises themselves are kept."""
    cells, solving, dropped = [], False, 0
    for cell in nb.cells:
        heading = re.match(r"(#{1,6}) (.*)", cell.source) if cell.cell_type == "markdown" else None
        if heading and len(heading[1]) <= 3:
            solving = heading[1] == "###" and heading[2].startswith("Solution")
            if solving:
                exercise = "Exercise" + heading[2][len("Solution"):]
                number = re.match(r"Exercise (\w+)", exercise)
                answer = f"# your answer to exercise {number[1] if number else ''}".rstrip()
                cells += [nbformat.v4.new_markdown_cell(f"### {exercise}"), nbformat.v4.new_code_cell(answer)]
                continue
        if solving:
            dropped += cell.cell_type == "code"
        else:
            cells.append(nbformat.v4.new_code_cell(cell.source) if cell.cell_type == "code" else cell)
    for i, cell in enumerate(cells):
        cell["id"] = f"cell-{i}"
    nb.cells = cells
    return nb, dropped


def write_student(source: Path, out: Path) -> tuple[Path, int]:
    """Write the student's copy of the lesson made from `source` into the folder `out` (NN-name.ipynb, no
    outputs, nothing executed); the path and how many solution cells it left out."""
    copy, dropped = student(read(source))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(MATPLOTLIBRC, out / MATPLOTLIBRC.name)   # the pictures' resolution, read from the folder
    path = out / notebook(source).name
    nbformat.write(copy, path)
    return path, dropped


def shown(path: Path) -> Path:
    """A path as the user knows it: from the repository root when it is inside."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.notebooks", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="lessons' sources (default: every lesson's)")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help="seconds one cell may run")
    parser.add_argument("--student", action="store_true",
                        help="write each lesson without its solutions and outputs, to --out (runs nothing)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help=f"where --student writes (default: {shown(STUDENT)}, which git ignores)")
    args = parser.parse_args(argv)
    if args.out and not args.student:
        parser.error("--out is where --student writes; a lesson's own .ipynb is always written beside its source")
    paths = [p.resolve() for p in args.paths] or list(lessons().values())
    bad = [str(p) for p in paths if p.suffix != ".md" or not p.is_file()]
    if bad:
        moved = "".join(f"; {name}'s source is {shown(s)}" for name, s in SOURCES.items())
        parser.error(f"not a lesson's .md file: {', '.join(bad)} (the source is notebooks/NN-name.md{moved})")
    if args.student:
        out = (args.out or STUDENT).resolve()
        for source in paths:
            path, dropped = write_student(source, out)
            print(f"{shown(source)} -> {shown(path)} ({dropped} solution cells left out)")
        return 0
    failed = 0
    for source in paths:
        try:
            seconds = run(source, args.timeout)
        except NotebookError as e:
            print(e, file=sys.stderr)
            failed += 1
            continue
        print(f"{shown(source)}: {seconds:.1f} s -> {shown(notebook(source))}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
