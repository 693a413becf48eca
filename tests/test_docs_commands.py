"""Every command the docs show is run as written: each fenced ```bash block of README.md and docs/*.md.

A block runs with bash (``-e -o pipefail``) in a fresh copy of the repository's tracked
files (the shipped examples, no earlier runs), with this interpreter's environment as
``.venv`` and ``hfleet`` on PATH; it must exit 0 without a traceback. A document's blocks
run in order in one copy, as a reader follows them; different documents share nothing, so
``DOC_LANES`` of them run side by side. A block that cannot run on a test machine (a real
cluster, a Docker engine, a remote host) is preceded by the line
``<!-- docs-test: skip (the reason) -->``; the reason is required.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_RE = re.compile(r"^<!-- docs-test: skip \((?P<reason>[^)]+)\) -->$")
FENCE_RE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)\s*$")
BLOCK_TIMEOUT_S = 600
# documents run at once, each one's blocks in order: much of a block's time is spent waiting (on a server to
# start, on rounds over loopback), so two lanes overlap one block's waiting with another's work
DOC_LANES = 2


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]


def bash_blocks(path: Path) -> list[Block]:
    """The fenced ```bash blocks of ``path``, each with the skip reason of the line just before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE_RE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        if fence["lang"] in ("bash", "sh", "shell"):
            marker = SKIP_RE.match(lines[i - 1].strip()) if i > 0 else None
            blocks.append(Block(path, i + 1, "\n".join(lines[i + 1:end]) + "\n", marker["reason"] if marker else None))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for p in doc_files() for b in bash_blocks(p)]


def _fresh_checkout(root: Path) -> Path:
    """The tracked files of the repository (as a fresh clone has them), with this environment as .venv."""
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    if not (root / ".venv").exists():
        (root / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return root


def _run_block(block: Block, fresh_checkout: Path) -> subprocess.CompletedProcess:
    """``block`` under bash in ``fresh_checkout``: hfleet and python of this environment, the copy's sources first."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(fresh_checkout / "src"), OMP_NUM_THREADS="1")
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=fresh_checkout, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


def _run_document(blocks: list[Block], root: Path, results: dict[str, Future], stop: threading.Event) -> None:
    """A document's blocks in order, in one fresh checkout; each block's outcome goes to its future. Once ``stop``
    is set (the session ends early), no further block starts."""
    try:
        fresh_checkout = _fresh_checkout(root)
    except BaseException as err:  # no checkout: every block of the document fails with the reason
        for block in blocks:
            results[block.id].set_exception(err)
        return
    for block in blocks:
        if stop.is_set():
            return
        try:
            results[block.id].set_result(_run_block(block, fresh_checkout))
        except BaseException as err:  # a timeout fails this block; the document's next blocks still run
            results[block.id].set_exception(err)


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory):
    """The outcome of every selected block, block id -> future; the documents start at once, ``DOC_LANES`` at a time."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "module", None) is request.module
                and getattr(item, "originalname", None) == "test_documented_commands_run_as_written"]
    by_doc: dict[Path, list[Block]] = {}
    for block in selected:
        by_doc.setdefault(block.path, []).append(block)
    results: dict[str, Future] = {block.id: Future() for block in selected}
    stop = threading.Event()
    lanes = ThreadPoolExecutor(DOC_LANES, thread_name_prefix="docs")
    for blocks in by_doc.values():
        lanes.submit(_run_document, blocks, tmp_path_factory.mktemp("checkout"), results, stop)
    yield results
    stop.set()
    lanes.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.torch  # the documented jobs and launches use the torch examples
@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.skip_reason is None], ids=lambda b: b.id)
def test_documented_commands_run_as_written(block, block_runs):
    # Execute (started by the fixture, with the document's earlier blocks before it)
    proc = block_runs[block.id].result()
    # Assert
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{block.code}\n{output[-4000:]}"
    assert "Traceback" not in output, f"{block.id} printed a traceback:\n{output[-4000:]}"


def test_every_skipped_block_says_why_and_the_marker_is_exact():
    markers = [(p, n + 1, line) for p in doc_files() for n, line in enumerate(p.read_text().splitlines())
               if "docs-test:" in line]
    for path, line_no, line in markers:
        assert SKIP_RE.match(line.strip()), f"{path.name}:{line_no}: write exactly <!-- docs-test: skip (reason) -->"
        following = path.read_text().splitlines()[line_no]  # the line after the marker
        assert FENCE_RE.match(following), f"{path.name}:{line_no}: the marker must be the line right before a ``` fence"


def test_block_extraction_honours_the_skip_marker(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    doc = tmp_path / "guide.md"
    doc.write_text("text\n```bash\necho one\n```\n<!-- docs-test: skip (needs a cluster) -->\n```bash\nkubectl apply -f k8s/\n```\n"
                   "```yaml\nname: x\n```\n```console\n$ hfleet --version\n```\n")

    blocks = bash_blocks(doc)

    assert [(b.line, b.code, b.skip_reason) for b in blocks] == [
        (2, "echo one\n", None), (6, "kubectl apply -f k8s/\n", "needs a cluster")]
