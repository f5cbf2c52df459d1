"""Product files speak to users: no work-session diaries, issue numbers or who measured what.

Code, docs, tests, scripts and the changelog are read by people who never saw the work that
produced them, so wording such as "Session 9", "in this session's runs", "issue #14" or "the
lead's quiet-machine run" means nothing to them. The scan covers the product files (the
tracked and untracked, not ignored, files of a git checkout, else the tree) and fails with
``file:line`` for every hit.

The patterns are precise on purpose: "session" is also a product term (a realtime
conversation: "this session's key", "the last session closes", ``--sessions 1 4 8``), so
only forms that name a work session are flagged.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).resolve()

#: What is scanned, relative to the repository root: directories and single files.
PRODUCT_PATHS = (
    "README.md", "CHANGELOG.md", "docs", "mlx_voicechat_plugin", "tests", "scripts", "patches",
    "pyproject.toml", "Makefile", ".ci",
)

#: Files where ``#123`` is ordinary syntax (colours, fragments), not an issue reference.
_HASH_SYNTAX_SUFFIXES = frozenset({".html", ".css", ".js", ".svg"})

#: Directories never scanned when walking the tree (no git).
_SKIP_DIRS = frozenset({".git", ".venv", ".venv-gpu", "__pycache__", ".pytest_cache", ".ruff_cache",
                        ".hypothesis", "build", "dist", "artifacts", "node_modules"})

#: (name, pattern) pairs; every pattern names a work session, an issue or who measured.
WORDING_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # "Session 9", "Session 10's machine": a capitalised numbered session is always a work session.
    ("numbered session", re.compile(r"\bSessions? \d+\b")),
    # "in session 4", "since session 2", "at the end of session 1", "session 9's VM".
    ("numbered session", re.compile(
        r"(?i)\b(?:in|since|from|before|after|until|during|of|by) sessions? \d+\b|\bsessions? \d+'s\b")),
    # "sessions 5-7", "sessions 5 to 7".
    ("session range", re.compile(r"(?i)\bsessions \d+ ?(?:-|–|to) ?\d+\b")),
    # "work session", "an earlier session", "in this session", "before this session's changes".
    ("work session", re.compile(
        r"(?i)\b(?:work|earlier) sessions?\b"
        r"|\b(?:in|during|before|after|since|until|from) (?:this|the last|the previous|the next|a later) session\b(?!\.\w)"
        r"|\b(?:this|the last|the previous|an earlier) session's"
        r" (?:VM|machines?|changes|runs?|work|figures|helpers|engineers?|noise|load)\b")),
    # "issue #14", "issues #11 and #12", "Issue 27".
    ("issue number", re.compile(r"(?i)\bissues? #?\d+\b")),
    # "(#14)", "see #14", "fixes #14".
    ("issue reference", re.compile(r"(?i)(?:\(|\bsee |\bfixes |\bcloses |\bin )#\d{1,5}\b")),
    # Who measured what, and when.
    ("who measured", re.compile(
        r"(?i)\bmeasured (?:here )?today\b|\bother engineers\b|\bthe lead's\b|\bengineer [A-Z]\b(?!\w)")),
)

#: A bare "#14" (outside colour/fragment syntax files); "&#14;" and "/#14" are syntax.
BARE_HASH = re.compile(r"(?<![\w&#/])#\d{1,4}\b(?![\w-])")


def wording_hits(text: str, *, bare_hash: bool = True) -> list[tuple[int, str, str]]:
    """Every work-session / issue-number wording in ``text``: ``(line number, kind, match)``."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in WORDING_PATTERNS:
            hits.extend((number, kind, match.group(0)) for match in pattern.finditer(line))
        if bare_hash:
            hits.extend((number, "issue reference", match.group(0)) for match in BARE_HASH.finditer(line))
    return sorted(set(hits))


def _git_files() -> list[Path] | None:
    """Tracked and untracked (not ignored) files under the product paths, or None off git."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *PRODUCT_PATHS],
            cwd=ROOT, capture_output=True, check=True, timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted({ROOT / name for name in listed.decode().split("\0") if name})


def _walked_files() -> list[Path]:
    files = []
    for name in PRODUCT_PATHS:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        for directory, subdirectories, names in os.walk(path):
            subdirectories[:] = [d for d in subdirectories if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            files.extend(Path(directory) / file for file in names)
    return sorted(set(files))


def product_files() -> list[Path]:
    """The product files to scan: git's list in a checkout, else a walk of the tree."""
    inside = (ROOT / ".git").exists()
    files = (_git_files() if inside else None) or _walked_files()
    return [path for path in files if path.is_file() and path.resolve() != THIS_FILE]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_product_files_have_no_work_session_or_issue_wording():
    files = product_files()
    assert len(files) > 50, f"found only {len(files)} product files under {ROOT}"
    problems = []
    for path in files:
        text = _text(path)
        if text is None:
            continue
        bare_hash = path.suffix not in _HASH_SYNTAX_SUFFIXES
        for number, kind, match in wording_hits(text, bare_hash=bare_hash):
            problems.append(f"{path.relative_to(ROOT)}:{number}: {kind}: {match!r}")
    assert not problems, "work-session or issue wording in product files:\n" + "\n".join(problems)


@pytest.mark.parametrize("text", [
    "Session 9, after the few-row product change",
    "**Session 10: another machine**",
    "measured in session 4 on an Intel Xeon",
    "at the end of session 1",
    "slower than in session 9's faster phase",
    "sessions 5-7 changed the kernel",
    "the work session ended",
    "an earlier session's machine",
    "Before this session (same script)",
    "on this session's VM a solo frame took 94 ms",
    "the last session's figures",
    "see issue #14",
    "issue 27 asks for it",
    "Issues #11 and #12",
    "fixed (#14)",
    "see #14",
    "the 1.6x target of #14",
    "measured here today by the lead",
    "while other engineers' jobs ran",
    "the lead's A/B script",
    "engineer B measured the codec",
])
def test_wording_patterns_flag_work_session_and_issue_wording(text):
    assert wording_hits(text), text


@pytest.mark.parametrize("text", [
    "Make this session's key the global MLX key",
    "a flush was requested for this session; it takes no more audio",
    "the MLX buffer cache is cleared when the last session closes",
    "Fields clients echo back from a previous session object",
    "a cancel refused before session.update must not cancel the later session",
    "scripts/batch_bench.py --sessions 1 2 4 8 --interleave",
    "4 sessions 1.42x, 8 sessions aggregate 4.12x",
    "mlx-voicechat serve --max-sessions 2",
    'engine.open(...)  # -> "session-0"',
    "one session at a time; a second session gets server_busy",
    "colour: #333 is a hex colour in CSS only",  # flagged in prose: checked below with bare_hash off
    "see [Full size](performance.md#full-size)",
    "&#14; is an HTML character reference",
    "the issue is the first frame",
    "tissue 3",
])
def test_wording_patterns_leave_product_wording_alone(text):
    bare_hash = "hex colour" not in text
    assert not wording_hits(text, bare_hash=bare_hash), wording_hits(text, bare_hash=bare_hash)


def test_bare_hash_numbers_are_flagged_outside_colour_syntax():
    assert wording_hits("the 1.6x target of #14 is met")
    assert not wording_hits("color: #333;", bare_hash=False)
