"""The docs hold together: every relative link in README.md, docs/*.md and notebooks/*.md (the lessons'
sources) resolves (files, and #anchors against the target's headings by GitHub's rules), docs/README.md
lists every page, every page's runnable samples have a test, every block shown without running says why
here, and each sample in README.md is an excerpt of a tested one in docs/."""
import re
from pathlib import Path

from conftest import ROOT, doc_blocks

PAGES = sorted((ROOT / "docs").glob("*.md"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.md"))   # the lessons' sources and their README link to docs/
FILES = [ROOT / "README.md", *PAGES, *NOTEBOOKS]

# What a block shown and not run (```console, or no kind) may hold, and why it is not run.
NOT_RUN = {
    "pip install": "installs from the network",
    "python -m tools.bench": "minutes to hours at the real shapes; tests/test_teaching.py runs every suite small",
    "tools/cuda_check.sh": "needs a GPU; tests/test_cuda_check.py runs its --dry-run",
    "OUT=/tmp/cuda-check tools/cuda_check.sh": "the same",
    "lm_eval": "tests/test_eval_harness.py runs it against a live server",
    "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval": "the same",
    "npqwen serve --model ./ckpt --port 8000 &": "lm-evaluation-harness's server; tests/test_eval_harness.py",
    "python -m pytest tests/test_web_page.py --screenshots docs/images": "rewrites docs/images on purpose",
    "mpiexec": "several machines, or a launcher around the command; tests/test_parallel*.py run the same ranks",
    "npqwen serve -m ./Qwen3-0.6B --tensor-parallel-size 2": "a server; tests/test_parallel.py serves over 2 ranks",
    "ip ": "network namespaces, as root",
    "npqwen serve --model Qwen/Qwen3-8B --api-key secret": "Claude Code's server; tests/test_server_messages.py "
                                                           "sends its requests",
    "export ANTHROPIC_": "Claude Code's settings", "export CLAUDE_": "Claude Code's settings", "claude": "Claude Code itself, which the tests do not install",
    "# nsssh": "a comment on a script",
    "import npqwen": "a script for every rank under mpiexec; tests/test_parallel.py makes the same calls on 2 ranks",
    'llm = npqwen.load("Qwen/Qwen3-0.6B", tensor_parallel=True)': "the same script",
    "print(llm.comm.rank": "the same script",
}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()   # a link's text only
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def without_code(text: str) -> str:
    """The Markdown outside fenced blocks, with inline code blanked (line numbers kept)."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "``", text)


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file (not a "#" line of a code block); a repeated one gets
    -1, -2, ... as on GitHub."""
    seen, out = {}, set()
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"),
                  flags=re.S | re.M)
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def links(path: Path):
    """(line number, target) of every Markdown link and image outside code."""
    for number, line in enumerate(without_code(path.read_text(encoding="utf-8")).splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            yield number, target


def test_every_relative_link_resolves():
    broken, checked = [], 0
    for path in FILES:
        for number, target in links(path):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            checked += 1
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    print(f"{checked} relative links checked", *broken, sep="\n")
    assert checked > 50 and not broken, "broken links:\n" + "\n".join(broken)


def test_slugs_follow_github(tmp_path):
    assert slug("10. Structured output: a mask over the vocabulary") == "10-structured-output-a-mask-over-the-vocabulary"
    assert slug("On a GPU: `tools/cuda_check.sh`") == "on-a-gpu-toolscuda_checksh"
    assert slug("Dependencies, and why") == "dependencies-and-why"
    page = tmp_path / "page.md"
    page.write_text("# Notes\n## Notes\n```bash\n# Notes\n```\n### Notes!\n## `npqwen serve`: the server\n")
    assert anchors(page) == {"notes", "notes-1", "notes-2", "npqwen-serve-the-server"}
    path = ROOT / "docs" / "engine.md"   # a "#" line inside a code block is no heading
    assert "the-same-all-positions-at-once-gather-the-pages-put-positions-first-drop-the-unused-tail" not in \
        anchors(path)


def test_docs_index_lists_every_page():
    index = ROOT / "docs" / "README.md"
    listed = {target.partition("#")[0] for _, target in links(index)}
    missing = [p.name for p in PAGES if p != index and p.name not in listed]
    assert not missing, f"docs/README.md does not list {missing}"
    assert "docs/README.md" in {t.partition("#")[0] for _, t in links(ROOT / "README.md")}


def test_every_page_with_samples_has_a_test():
    """A page whose ```python or ```bash blocks no test file names would be samples nobody runs."""
    tests = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").glob("test_*doc*.py")) + \
        (ROOT / "tests" / "test_teaching.py").read_text(encoding="utf-8")
    untested = [p.name for p in PAGES if any(kind in ("python", "bash") for kind, _ in doc_blocks(p))
                and f'"{p.name}"' not in tests]
    assert not untested, f"no test runs the samples of {untested}"


def test_blocks_shown_without_running_say_why():
    """Each line of a ```console block, or of a block of no kind that holds commands (not a formula), starts
    with a command NOT_RUN explains."""
    unexplained = []
    for path in PAGES:
        for kind, code in doc_blocks(path):
            if kind not in ("console", ""):
                continue
            commands = [line for line in code.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
            if kind == "" and not any(re.match(r"(npqwen|python|pip|mpiexec|ip |tools/|import |[A-Z_]+=)", line)
                                      for line in commands):
                continue   # a formula: nothing to run
            unexplained += [f"{path.name}: {line}" for line in commands if not line.startswith(tuple(NOT_RUN))]
    assert not unexplained, "shown and not run, with no reason in NOT_RUN:\n" + "\n".join(unexplained)


def test_readme_samples_are_excerpts_of_tested_docs_samples():
    """Every line of a README sample (but the two commands for a fresh machine, which need the network and
    which .ci/run runs itself) is a line of a ```python or ```bash sample in docs/, so that it runs there."""
    tested = {line.strip() for p in PAGES for kind, code in doc_blocks(p) if kind in ("python", "bash")
              for line in code.splitlines()}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    fresh = readme.split("## Two commands on a fresh machine")[1].split("\n## ")[0]
    blocks = [code for kind, code in doc_blocks(ROOT / "README.md")
              if kind != "text" and f"```{kind}\n{code}```" not in fresh]   # text: a picture of the code, not a sample
    assert {kind for kind, _ in doc_blocks(ROOT / "README.md")} <= {"python", "bash", "text"}
    assert len(blocks) >= 8
    loose = [line for code in blocks for line in code.splitlines() if line.strip() and line.strip() not in tested]
    assert not loose, "README lines that no docs sample holds:\n" + "\n".join(loose)


def test_readme_says_what_the_test_command_costs():
    """A newcomer learns before running it: how much it installs, what the browser tests need, how long."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    before, after = readme.split("<!-- test-command -->")[0][-600:], readme.split("<!-- /test-command -->")[1][:1500]
    assert re.search(r"installs\s+about [\d.]+ GB", before), before
    assert "chromium chromium-driver" in after and re.search(r"about \d+ minutes", after), after
