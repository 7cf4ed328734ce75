"""The docs run as written: every ```python and ```bash block in README.md and
docs/**/*.md that follows a `<!-- runnable -->` line (invisible on GitHub and in
MkDocs) is executed with the budget it shows, and must exit 0.

A page's blocks run in page order in one working directory of their own, so a
later block sees what an earlier one made (`runs/cartpole`, an export). That
directory stands for the repository root: it links every top-level entry of the
checkout except `runs/` and `.git`, so `examples/specs/...` resolves while the
runs a block writes land in a temporary folder. Each block is a fresh process:
python blocks run with `sys.executable`, bash blocks with `bash -euxo pipefail`
and the venv's bin first on PATH (`rlfabric`, `python`). Tracebacks and bash
errors give the page's own line numbers. A block also fails if it leaves an
untracked file in the checkout or a new entry in its runs/. Selected alone
(`-k 'getting-started.md:230'`), a block first runs the blocks above it on its page.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^\s*<!--\s*runnable\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([^`\s]*)")
LANGS = ("python", "bash")
NOT_LINKED = {".git", "runs"}  # what a block must not reach through its working directory
TIMEOUT_S = 180  # a hang detector: a tiny budget takes 5-50 s, Ray's start included
TAIL_CHARS = 3000
# Ray's socket paths (<TMPDIR>/ray/session_<date>_<pid>/sockets/plasma_store) must fit 107 bytes.
RAY_SOCKET_SUFFIX = len("/ray/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store")


class DocBlockError(ValueError):
    """A misplaced marker or a marked block that cannot run, named by file:line."""


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repository, e.g. docs/getting-started.md
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def collect(text: str, doc: str) -> list[Block]:
    """The marked blocks of one markdown text; a marker that marks no runnable block raises."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence:  # an unmarked block: skip it whole, a marker inside it is its text
            i = _closing(lines, i, fence) + 1
            continue
        if not MARKER.match(lines[i]):
            i += 1
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not fence:
            raise DocBlockError(
                f"{doc}:{i + 1}: `<!-- runnable -->` must be followed on the next line "
                "by a ```python or ```bash fence"
            )
        indent, _, lang = fence.groups()
        if lang not in LANGS:
            raise DocBlockError(
                f"{doc}:{i + 2}: a runnable block must be ```python or ```bash, "
                f"not ```{lang or ' (no language)'}"
            )
        end = _closing(lines, i + 1, fence)
        if end == len(lines):
            raise DocBlockError(f"{doc}:{i + 2}: the runnable block's fence is never closed")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 2 : end]]
        blocks.append(Block(doc, i + 2, lang, "\n".join(body) + "\n"))
        i = end + 1
    return blocks


def _closing(lines: list[str], start: int, fence: re.Match) -> int:
    """Index of the line closing the fence opened at `start`, or len(lines) (CommonMark)."""
    ticks = len(fence.group(2))
    for j in range(start + 1, len(lines)):
        if re.fullmatch(rf"\s*`{{{ticks},}}\s*", lines[j]):
            return j
    return len(lines)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


BLOCKS = [
    block
    for path in doc_files()
    for block in collect(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
]


def repo_leftovers() -> set[str]:
    """Untracked paths git would show, and the entries of the repository's runs/."""
    runs = ROOT / "runs"
    found = {f"runs/{p.name}" for p in runs.iterdir()} if runs.is_dir() else set()
    if (ROOT / ".git").exists():
        status = subprocess.run(
            ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=all"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        found |= {ln[3:] for ln in status.stdout.splitlines() if ln.startswith("?? ")}
    return found


def _tail(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


class Pages:
    """One working directory per page; which blocks ran and how they ended."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory = factory
        self.cwds: dict[str, Path] = {}
        self.failed: dict[Block, str | None] = {}  # block -> its failure, None if it passed
        self.tmp = factory.mktemp("tmp")
        self.env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", TMPDIR=str(self.tmp))
        self.env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"]))
        self.env["PYTHONUNBUFFERED"] = "1"
        for name in ("RAY_ADDRESS", "RLFABRIC_RUNS"):  # runs start their own Ray, in cwd/runs
            self.env.pop(name, None)
        if len(str(self.tmp)) + RAY_SOCKET_SUFFIX > 107:
            self.env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rlf")  # a long pytest basetemp

    def cwd(self, doc: str) -> Path:
        if doc not in self.cwds:
            cwd = self.factory.mktemp(Path(doc).stem)
            for entry in ROOT.iterdir():
                if entry.name not in NOT_LINKED:
                    (cwd / entry.name).symlink_to(entry)
            self.cwds[doc] = cwd
        return self.cwds[doc]

    def run(self, block: Block) -> str | None:
        """Run one block; its failure message, or None."""
        cwd = self.cwd(block.doc)
        script = self.factory.mktemp("block") / f"{Path(block.doc).name}.{block.lang[:2]}"
        if block.lang == "python":
            # As a file saved in the current directory: its modules import. The padding
            # keeps the page's line numbers in tracebacks.
            pad = "import sys; sys.path.insert(0, '')" + "\n" * block.line
            cmd = [sys.executable, str(script)]
        else:
            pad = "\n" * block.line
            cmd = ["bash", "-euxo", "pipefail", str(script)]
        script.write_text(pad + block.code, encoding="utf-8")
        before = repo_leftovers()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a timeout ends the block's Ray too
        )
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            ended = f"exited {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            ended = f"did not finish in {TIMEOUT_S} s"
        left = sorted(repo_leftovers() - before)
        error = None
        if proc.returncode != 0 or left:
            numbered = "".join(
                f"{block.line + 1 + k:5d}  {ln}\n" for k, ln in enumerate(block.code.splitlines())
            )
            error = (
                f"{block.where}: the ```{block.lang} block {ended}"
                + (f" and left files in the repository: {', '.join(left)}" if left else "")
                + f"\n--- block (working directory {cwd}) ---\n{numbered}"
                + f"--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}"
            )
        self.failed[block] = error
        return error


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> Iterator[Pages]:
    pages = Pages(tmp_path_factory)
    yield pages
    if "RAY_TMPDIR" in pages.env:
        shutil.rmtree(pages.env["RAY_TMPDIR"], ignore_errors=True)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_runnable_block(block: Block, pages: Pages):
    for earlier in (b for b in BLOCKS if b.doc == block.doc and b.line < block.line):
        if earlier not in pages.failed:  # this block was selected alone: run what it follows
            error = pages.run(earlier)
            if error:
                pytest.fail(f"{earlier.where}, which {block.where} follows, failed:\n{error}")
        elif pages.failed[earlier]:
            pytest.skip(f"{earlier.where}, earlier on the page, failed")
    error = pages.run(block)
    if error:
        pytest.fail(error, pytrace=False)


def test_the_getting_started_page_has_runnable_blocks():
    docs = {b.doc for b in BLOCKS}
    assert {"README.md", "docs/getting-started.md"} & docs, "no <!-- runnable --> block found"


PAGE = """# A page

<!-- runnable -->
```python
print("marked")
```

```python
print("not marked")
```

```text
<!-- runnable -->
```

  <!-- runnable -->
  ```bash
  echo indented
  ```
"""


def test_marked_blocks_are_collected_with_their_line_and_unmarked_ones_are_not():
    blocks = collect(PAGE, "page.md")
    assert [(b.where, b.lang, b.code) for b in blocks] == [
        ("page.md:4", "python", 'print("marked")\n'),
        ("page.md:17", "bash", "echo indented\n"),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a\n<!-- runnable -->\n```yaml\nx: 1\n```\n", "page.md:3: a runnable block must be"),
        ("a\n<!-- runnable -->\n\n```python\npass\n```\n", "page.md:2: `<!-- runnable -->` must"),
        ("a\n<!-- runnable -->\n", "page.md:2: `<!-- runnable -->` must be followed"),
        ("<!-- runnable -->\n```bash\ntrue\n", "page.md:2: the runnable block's fence is never"),
    ],
    ids=["not-python-or-bash", "blank-line-between", "at-the-end", "never-closed"],
)
def test_a_misplaced_marker_is_an_error_naming_file_and_line(text: str, message: str):
    with pytest.raises(DocBlockError, match=re.escape(message)):
        collect(text, "page.md")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "x\n\n<!-- runnable -->\n```python\nimport os\n\nos.path.join(1)\n```\n",
            ["page.md:4: the ```python block exited 1", 'page.md.py", line 7', "TypeError"],
        ),
        (
            "<!-- runnable -->\n```bash\necho one\nfalse\necho never\n```\n",
            ["page.md:2: the ```bash block exited 1", "+ false", "    4  false"],
        ),
    ],
    ids=["python", "bash"],
)
def test_a_broken_block_fails_naming_its_line(text: str, expected: list[str], tmp_path_factory):
    (block,) = collect(text, "page.md")
    error = Pages(tmp_path_factory).run(block)
    assert error is not None
    for part in expected:
        assert part in error, error
    assert "never" not in error.split("--- stdout ---")[1]  # set -e stopped the bash block
