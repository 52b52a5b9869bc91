"""Run the lessons in notebooks/ and save them with their outputs:

    python -m tools.notebooks                          # every notebooks/NN-name.md
    python -m tools.notebooks notebooks/01-forward-pass.md [--timeout 300]

The source of a lesson is its jupytext Markdown, notebooks/NN-name.md. This reads it, executes it on a
fresh python3 kernel (nbclient) in a temporary directory, with this checkout's npqwen first on the
kernel's path, and writes notebooks/NN-name.ipynb beside it with every output, pictures included.
The saved file is stable across re-runs: cell ids are numbered, timing metadata is dropped. A cell that
fails stops that notebook with the cell and its error, and nothing is written for it.
tests/test_notebooks.py checks that each .ipynb holds the cells its .md makes, and runs every lesson.
"""
import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

try:
    import jupytext
    import nbformat
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
except ImportError as e:   # the test extra has them too: tests/test_notebooks.py fails here rather than skip
    raise ImportError(f"{e.name} is missing: the notebooks need jupytext, nbclient, nbformat and ipykernel "
                      '(pip install -e ".[notebooks]")') from e

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT = 300   # seconds for one cell; a whole lesson takes seconds on the tiny model, a minute at most


class NotebookError(Exception):
    """A cell of a lesson failed: the message names the lesson, the cell and the error."""


def lessons() -> list[Path]:
    """The lessons' sources, notebooks/NN-name.md, in order (notebooks/README.md is not one)."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]-*.md"))


def read(md: Path) -> nbformat.NotebookNode:
    """The notebook jupytext makes from a lesson's Markdown, with cell ids numbered (jupytext draws
    random ones) so that the saved file does not change when the lesson does not."""
    nb = jupytext.read(md)
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"
    return nb


def kernel_env() -> dict:
    """The kernel's environment: this one, with this checkout first on PYTHONPATH (an installed npqwen
    may be another checkout's), one BLAS thread unless the caller chose, and no MPLBACKEND (a backend such
    as Agg set for scripts would keep the pictures out of the notebook; the kernel's own is inline)."""
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)
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
    """Drop what changes between runs of the same lesson: each cell's execution timestamps."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


def run(md: Path, timeout: int = CELL_TIMEOUT) -> float:
    """Execute one lesson and write its .ipynb beside it; the seconds it took."""
    nb = read(md)
    with tempfile.TemporaryDirectory(prefix="npqwen-notebook-") as cwd:
        seconds = execute(nb, md.name, Path(cwd), timeout)
    nbformat.write(stable(nb), md.with_suffix(".ipynb"))
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.notebooks", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="lessons' .md files (default: every notebooks/NN-*.md)")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help="seconds one cell may run")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.paths] or lessons()
    bad = [str(p) for p in paths if p.suffix != ".md" or not p.is_file()]
    if bad:
        parser.error(f"not a lesson's .md file: {', '.join(bad)} (the source is notebooks/NN-name.md)")
    failed = 0
    for md in paths:
        try:
            seconds = run(md, args.timeout)
        except NotebookError as e:
            print(e, file=sys.stderr)
            failed += 1
            continue
        print(f"{md.relative_to(ROOT) if md.is_relative_to(ROOT) else md}: {seconds:.1f} s -> "
              f"{md.with_suffix('.ipynb').name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
