"""The lessons in notebooks/: each saved .ipynb holds exactly the cells jupytext makes from its one source
(notebooks/NN-name.md, or the docs page tools.notebooks.SOURCES names: lesson 01's is docs/walkthrough.md,
lesson 04's docs/moe.md), so the two cannot drift; only the source's ```python blocks are code cells; each
lesson runs top to bottom on a fresh kernel without an error, and each has a lesson's shape: MODEL = "tiny"
(or a built-in twin, "tiny-moe") in its first code cell, exercises with worked solutions, and a picture
among its saved outputs. The notebook packages are in the test extra: a missing one fails the import below,
it does not skip."""
import base64
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT

from tools import notebooks  # jupytext, nbclient, nbformat; ipykernel for the kernel

LESSONS = notebooks.lessons()   # name -> source
SOURCES = list(LESSONS.values())
QWEN3_TOKENIZER = ROOT / ".cache" / "qwen3-tokenizer" / "tokenizer.json"   # lesson 00's, else tiny's bytes
REGENERATE = 'run `python -m tools.notebooks` (pip install -e ".[notebooks]") to write it from its source'
lesson = pytest.mark.parametrize("md", SOURCES, ids=list(LESSONS))


def cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def test_the_lessons_are_there():
    assert list(LESSONS)[:2] == ["00-tokens", "01-forward-pass"], f"the lessons: {LESSONS}"
    assert LESSONS["01-forward-pass"] == ROOT / "docs" / "walkthrough.md"
    assert LESSONS["04-moe"] == ROOT / "docs" / "moe.md"
    orphans = [p.name for p in sorted(notebooks.NOTEBOOKS.glob("*.ipynb")) if p.stem not in LESSONS]
    assert not orphans, f"notebooks without a source: {orphans} (the .md is the source; write it first)"
    second = [f"notebooks/{name}.md" for name in notebooks.SOURCES if (notebooks.NOTEBOOKS / f"{name}.md").exists()]
    assert not second, f"{second}: a second source of a lesson whose source is {notebooks.SOURCES} (one source)"
    index = (notebooks.NOTEBOOKS / "README.md").read_text(encoding="utf-8")
    for name, source in LESSONS.items():   # its row links the notebook and says which file is its source
        row = next((line for line in index.splitlines() if line.startswith(f"| [{name}]")), "")
        source = Path(os.path.relpath(source, notebooks.NOTEBOOKS)).as_posix()
        assert f"]({name}.ipynb)" in row and f"]({source})" in row, \
            f"notebooks/README.md: no row '| [{name}]({name}.ipynb) | ... ([source]({source})) |'"


def test_only_python_blocks_become_code_cells(tmp_path):
    """A page's ```bash, ```console, ```text and plain blocks stay in the prose (jupytext alone makes a
    ```bash block a %%bash cell), and a source without a jupytext header gets the python3 kernel."""
    shell = "```bash\nnpqwen inspect --model tiny\n```"
    shown = "```console\n$ npqwen\n```\n\n```text\nhi\n```\n\n```\nh = x + a\n```"
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n```python\nx = 1\n```\n\n{shell}\n\nBetween.\n\n{shown}\n\n## Next\n\n"
                    "```python\ny = 2\n```\n", encoding="utf-8")
    nb = notebooks.read(page)
    assert cells(nb) == [("markdown", "# A page"), ("code", "x = 1"),
                         ("markdown", f"{shell}\n\nBetween.\n\n{shown}"), ("markdown", "## Next"),
                         ("code", "y = 2")], cells(nb)
    assert nb.metadata.kernelspec.name == "python3"


def test_each_heading_starts_a_cell(tmp_path):
    """The list of exercises and "### Solution 1" are two cells (a student's copy drops the second); a `#`
    line inside a fenced block is no heading."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\nProse.\n\n```bash\n# a comment, not a heading\n```\n\n## Exercises\n\n1. Do it."
                    "\n\n### Solution 1\n\nWhy.\n\n```python\nx = 1\n```\n", encoding="utf-8")
    assert cells(notebooks.read(page)) == [
        ("markdown", "# A page\n\nProse.\n\n```bash\n# a comment, not a heading\n```"),
        ("markdown", "## Exercises\n\n1. Do it."), ("markdown", "### Solution 1\n\nWhy."), ("code", "x = 1")]


def test_student_copies_have_the_exercises_and_not_the_solutions(tmp_path):
    """`python -m tools.notebooks --student --out DIR`, as notebooks/README.md shows it: each lesson's cells in
    order with no outputs, every "### Solution N" section (heading, prose, code) replaced by "### Exercise N"
    and an answer cell; nothing is executed and nothing is written into the checkout."""
    status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    run = subprocess.run([sys.executable, "-m", "tools.notebooks", "--student", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    for name, md in LESSONS.items():
        assert f"-> {tmp_path / name}.ipynb (" in run.stdout, run.stdout
        full, copy = notebooks.read(md).cells, nbformat.read(tmp_path / f"{name}.ipynb", as_version=4).cells
        solutions, solving = [], False   # the source's cells under a "### Solution" heading
        for c in full:
            if c.cell_type == "markdown" and re.match(r"#{1,3} ", c.source):
                solving = c.source.startswith("### Solution")
            if solving:
                solutions.append(c.source)
        assert sum(s.startswith("### Solution") for s in solutions) >= 2, f"{name}: {solutions}"
        kept = [(c.cell_type, c.source) for c in full if c.source not in solutions]
        exercises = [c.source for c in copy if c.source.startswith("### Exercise")]
        assert [s.split("\n")[0].replace("### Solution", "### Exercise") for s in solutions
                if s.startswith("### Solution")] == exercises, f"{name}: {exercises}"
        assert [(c.cell_type, c.source) for c in copy if c.source not in exercises
                and not c.source.startswith("# your answer")] == kept, f"{name}: cells other than the solutions differ"
        leaked = [s for s in solutions if any(s == c.source for c in copy)]
        assert not leaked, f"{name}: its student copy still holds {leaked}"
        assert any(re.search(r"^## Exercises", c.source, re.MULTILINE) for c in copy), name
        code = [c for c in copy if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{name}: outputs in a student copy"
    assert subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout == status, "--student --out DIR changed the checkout"
    bad = subprocess.run([sys.executable, "-m", "tools.notebooks", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--out is where --student writes" in bad.stderr, bad.stderr


def test_the_documented_command_writes_a_lesson_with_its_outputs(tmp_path):
    """`python -m tools.notebooks PATH`, as notebooks/README.md shows it, on a copy of the quickest lesson
    (04, from docs/moe.md): it prints the run time, writes the .ipynb beside the .md with its cells, outputs
    and pictures, and a second run writes the same bytes (no timing or random ids in the file)."""
    source = LESSONS["04-moe"]
    md = tmp_path / source.name
    md.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    saved = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-m", "tools.notebooks", str(md)], cwd=ROOT, capture_output=True,
                             text=True, timeout=600, check=False)
        assert run.returncode == 0 and re.search(r": [\d.]+ s -> ", run.stdout), run.stdout + run.stderr
        saved.append(md.with_suffix(".ipynb").read_bytes())
    nb = nbformat.reads(saved[0].decode(), as_version=4)
    assert cells(nb) == cells(notebooks.read(source))
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert saved[0] == saved[1], "two runs of the same lesson wrote different files"
    bad = subprocess.run([sys.executable, "-m", "tools.notebooks", "notebooks/01-forward-pass.md"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "not a lesson's .md file" in bad.stderr, bad.stderr
    assert "01-forward-pass's source is docs/walkthrough.md" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr, bad.stderr


@lesson
def test_saved_notebook_holds_the_cells_of_its_source(md):
    saved = notebooks.notebook(md)
    assert saved.is_file(), f"{saved.relative_to(ROOT)} is missing: {REGENERATE}"
    want, have = cells(notebooks.read(md)), cells(nbformat.read(saved, as_version=4))
    for i, (w, h) in enumerate(zip(want, have)):
        assert w == h, (f"{saved.name} cell {i} differs from {md.name}: {REGENERATE}\n"
                        f"--- in the .md ({w[0]}):\n{w[1]}\n--- in the .ipynb ({h[0]}):\n{h[1]}")
    assert len(want) == len(have), f"{md.name} makes {len(want)} cells, {saved.name} holds {len(have)}: {REGENERATE}"


@lesson
def test_lesson_runs_on_a_fresh_kernel(md, tmp_path):
    """Every cell of the .md on a new python3 kernel, in a temporary directory; the lessons' asserts check
    each hand computation against npqwen, so a wrong one fails here. Nothing is written into the tree."""
    before = {p: p.stat().st_mtime_ns for p in notebooks.NOTEBOOKS.iterdir()}
    nb = notebooks.read(md)
    start = time.perf_counter()
    try:
        notebooks.execute(nb, md.name, tmp_path)
        failure = None
    except notebooks.NotebookError as e:
        failure = str(e)
    if failure:   # the cell and its traceback, once (not chained to the NotebookError)
        pytest.fail(failure, pytrace=False)
    print(f"{md.name}: {time.perf_counter() - start:.1f} s on a fresh kernel")
    after = {p: p.stat().st_mtime_ns for p in notebooks.NOTEBOOKS.iterdir()}
    assert after == before, f"running {md.name} changed notebooks/: {set(after.items()) ^ set(before.items())}"
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    # a re-run prints what the stored lesson shows, to the byte (no timings, no float digits that follow the
    # CPU): `python -m tools.notebooks` re-writes the same file; a picture's size is checked, not its bytes,
    # which follow matplotlib's version
    if md.stem == "00-tokens" and not QWEN3_TOKENIZER.is_file():   # it ran on tiny's byte tokenizer instead
        print(f"{md.name}: its outputs are not compared: no {QWEN3_TOKENIZER} (tools/fetch_qwen3_tokenizer.sh)")
        return
    ran = outputs(nbformat.reads(nbformat.writes(notebooks.stable(nb)), as_version=4))
    stored = outputs(nbformat.read(notebooks.notebook(md), as_version=4))
    differ = [(r, s) for r, s in zip(ran, stored) if r != s]
    assert not differ and len(ran) == len(stored), (
        f"{md.name}: a fresh run's outputs differ from {notebooks.notebook(md).name}'s ({len(ran)} and {len(stored)} "
        f"outputs); print only what is the same on every run and machine, then {REGENERATE}\n"
        + "\n".join(f"--- ran:    {r}\n--- stored: {s}" for r, s in differ[:3]))


def outputs(nb) -> list[tuple]:
    """Each code cell's outputs as (cell, type, text), a picture as its size."""
    found = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            data = dict(o.get("data", {}))
            if "image/png" in data:
                png = base64.b64decode(data.pop("image/png"))
                data["image/png"] = f"{int.from_bytes(png[16:20], 'big')}x{int.from_bytes(png[20:24], 'big')} px"
            found.append((i, o.output_type, o.get("name"), o.get("text"), o.get("execution_count"),
                          sorted(data.items()), o.get("ename"), o.get("evalue")))
    return found


@lesson
def test_lesson_has_the_shape_of_a_lesson(md):
    nb = notebooks.read(md)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    fences = re.findall(r"^```python\s*$", md.read_text(encoding="utf-8"), re.MULTILINE)
    assert len(code) == len(fences), f"{md.name}: {len(code)} code cells from {len(fences)} ```python blocks"
    assert code and re.search(r'^MODEL = "tiny(-[\w.-]+)?"', code[0], re.MULTILINE), \
        f'{md.name}: the first code cell must set MODEL = "tiny" (or "tiny-moe"), and say how to switch:\n{code[:1]}'
    # jupytext keeps a heading in one cell with the text around it: look for it line by line
    heading = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
               and re.search(r"^## Exercises\s*$", c.source, re.MULTILINE)]
    assert heading, f"{md.name} has no '## Exercises' section"
    solutions, under = [], False   # the code cells under a "### Solution" heading, after "## Exercises"
    for c in nb.cells[heading[0]:]:
        if c.cell_type == "markdown" and re.search(r"^#{1,3} ", c.source, re.MULTILINE):
            under = bool(re.search(r"^### Solution", c.source, re.MULTILINE))
        elif c.cell_type == "code" and under:
            solutions.append(c.source)
    assert len(solutions) >= 2, f"{md.name}: {len(solutions)} code cells under '### Solution' headings (want 2+)"
    saved = notebooks.notebook(md)
    assert saved.is_file(), f"{saved.name} is missing: {REGENERATE}"
    stored = nbformat.read(saved, as_version=4)
    assert stored.metadata.kernelspec.name == "python3", stored.metadata.get("kernelspec")
    unrun = [i for i, c in enumerate(stored.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"{saved.name} was saved without running cells {unrun}: {REGENERATE}"
    pictures = [o for c in stored.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert pictures, f"{saved.name} holds no picture (image/png output): {REGENERATE}"
    narrow = [(i, w) for i, w in enumerate(png_width(o.data["image/png"]) for o in pictures) if w < MIN_WIDTH]
    assert not narrow, (f"{saved.name}: pictures (index, width in pixels) {narrow} are narrower than {MIN_WIDTH} px, "
                        f"too small for a class to read: widen the figure (figsize, in inches; notebooks/matplotlibrc "
                        f"sets the dots per inch for every lesson), then {REGENERATE}")


MIN_WIDTH = 800   # pixels: a picture a class reads on a projector


def png_width(data: str) -> int:
    """The width of a base64 PNG, from its IHDR chunk (bytes 16-20)."""
    return int.from_bytes(base64.b64decode(data)[16:20], "big")
