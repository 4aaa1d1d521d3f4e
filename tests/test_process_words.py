"""The repository describes the product, never how it was made.

Fails on words about the work behind the code rather than the code itself:
numbered or relative work sittings, the people who did the work, the
machines it was done on, and when and by whom a figure was taken
(``PHRASES`` lists them; the parametrized cases below show what trips and
what does not). Where a measurement's conditions matter, the result file
records them as data (device, command, load average).

Looked at: README.md and docs/** (all text), the names of the files under
benchmarks/results/ and the text of their markdown and JSON, and the comments
and docstrings of the Python files under the package and benchmark folders.
Code is never looked at, so identifiers such as pytest's ``scope="session"``,
``start_new_session``, ``requests.Session`` or ``aiohttp.ClientSession`` pass,
and so does the POSIX sense of the word ("a process in a session of its
own"), which none of the phrases below matches.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE_DIRS = ("serve", "engine", "scheduler", "kvcache", "kernels", "benchmarks", "tests")
RESULTS = REPO / "benchmarks" / "results"

# The words are assembled from parts so that this file, which has to name
# them, does not itself read as the prose it rejects.
SESSION = "ses" "sion"
PEOPLE = "eng" "ineer"

# Each phrase is specific enough that ordinary prose about the code never
# matches it: a bare "session" or "machine" would flag POSIX sessions, pytest
# fixtures and "the machine's cores".
PHRASES = [
    r"\bsessions?[ _-]?\d+",
    r"\b(this|that|last|previous|next|earlier|later)\s+session\b",
    r"\b(start|end|beginning|rest)\s+of\s+(this|that)\s+session\b",
    r"\bthe\s+session(?:'s)?\s+(before|starting)\b",
    r"\ba\s+session\s+(later|earlier|before|after|ago)\b",
    r"\bsessions\s+(of|by)\b",
    r"\b(earlier|previous|later|past|recent|several|many|other|two|three|across)\s+sessions\b",
    r"\b" + PEOPLE + r"s?\b",
    r"\b(was|were|is|are|be|been|being|gets?|got)\s+lent\b",
    r"\blent\s+(device|machine|gpu|h100|h200|node)s?\b",
    r"\b(shared|quiet|erratic|test|dev|development)\s+(\d+-core\s+)?(cpu\s+)?machines?\b",
    r"\b(my|our)\s+(own\s+)?(machine|box|laptop|gpu|workstation|cluster)s?\b",
    r"\bthe\s+(\w+\s+)?2-core\b",
    r"\bwho\s+(measured|ran|ran\s+it)\b",
    r"\bissue\s+\d+\b",
    r"\b(final|code)\s+review\b",
    r"\b(yesterday|tonight|last\s+night|this\s+(morning|evening|afternoon)|the\s+same\s+(evening|morning|night))\b",
    r"\ba\s+run\s+(minutes|hours)\s+(earlier|later|before)\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in PHRASES), re.IGNORECASE)

# Result files are named by what they measure; when they ran is git's business.
BAD_RESULT_NAME = re.compile(r"session|\d{8}[_-]?\d{6}|\d{4}-\d{2}-\d{2}|\brun\d+\b", re.IGNORECASE)


def prose_of_python(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source.

    A docstring here is any string literal standing alone as a statement
    (module, class, function and attribute docstrings alike); strings inside
    expressions are code and are left alone. Comments on consecutive lines
    come back as one text, so a phrase broken across them is still seen."""
    out: list[tuple[int, str, bool]] = []  # (first line, text, is a comment)
    starts_statement = True
    pending: tuple[int, str] | None = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            prev = out[-1] if out else None
            if prev and prev[2] and prev[0] + prev[1].count("\n") == tok.start[0] - 1:
                out[-1] = (prev[0], prev[1] + "\n" + text, True)  # one comment block, one text
            else:
                out.append((tok.start[0], text, True))
            continue
        if tok.type in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING):
            continue
        if tok.type == tokenize.NEWLINE:
            if pending is not None:
                out.append((*pending, False))
            pending, starts_statement = None, True
            continue
        if tok.type == tokenize.STRING and starts_statement:
            pending = (tok.start[0], tok.string)
        elif tok.type == tokenize.STRING and pending is not None:
            pending = (pending[0], pending[1] + tok.string)  # implicit concatenation
        else:
            pending = None
        starts_statement = False
    return [(line, text) for line, text, _ in out]


def hits_in(text: str, first_line: int = 1) -> list[tuple[int, str]]:
    found = []
    for m in PATTERN.finditer(text):
        line = first_line + text.count("\n", 0, m.start())
        found.append((line, m.group(0)))
    return found


def python_files() -> list[Path]:
    files = []
    for d in CODE_DIRS:
        files += sorted(p for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def json_strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in json_strings(k) + json_strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in json_strings(v)]
    return []


def _report(hits: list[str]) -> str:
    return "process words found (say what the code does, not how it was made):\n  " + "\n  ".join(hits)


@pytest.mark.parametrize("text,expected", [
    (f"measured in {SESSION} 26 on a quiet machine", True),
    (f"the {SESSION} before, shared by five {PEOPLE}s", True),
    ("no GPU was lent while these were taken", True),
    ("# start the server in a session of its own (servers fork workers)", False),
    ("tiny checkpoints built once per session", False),
    ("pytest writes its JUnit XML at the session's end", False),
    ('@pytest.fixture(scope="session")', False),
    ("async with aiohttp.ClientSession() as s: requests.Session()", False),
    ("subprocess.Popen(cmd, start_new_session=True)", False),
    ("SIGTERM to the server's whole session, SIGKILL after 60 s", False),
    ("the client shares the machine's cores with the server", False),
])
def test_phrases_tell_process_from_code(text: str, expected: bool) -> None:
    assert bool(PATTERN.search(text)) is expected


def test_docstrings_and_comments_only() -> None:
    src = ('"""Module, session 3."""\n'
           "x = 'session 4'  # session 5\n"
           "def f():\n    \"\"\"session 6\"\"\"\n    return f'session 7'\n"
           "y = ('a'\n     'b')\n")
    texts = " ".join(t for _, t in prose_of_python(src))
    assert "session 3" in texts and "session 5" in texts and "session 6" in texts
    assert "session 4" not in texts and "session 7" not in texts and "'a'" not in texts


def test_readme_and_docs() -> None:
    paths = [REPO / "README.md"] + sorted(p for p in (REPO / "docs").rglob("*") if p.suffix in (".md", ".txt", ".rst"))
    hits = [f"{p.relative_to(REPO)}:{line}: {word!r}"
            for p in paths if p.exists() for line, word in hits_in(p.read_text(encoding="utf-8"))]
    assert not hits, _report(hits)


def test_result_files() -> None:
    hits = [f"{p.relative_to(REPO)}: name" for p in sorted(RESULTS.iterdir()) if BAD_RESULT_NAME.search(p.name)]
    for p in sorted(RESULTS.glob("*.md")):
        hits += [f"{p.relative_to(REPO)}:{line}: {word!r}" for line, word in hits_in(p.read_text(encoding="utf-8"))]
    for p in sorted(RESULTS.glob("*.json")):
        for s in json_strings(json.loads(p.read_text(encoding="utf-8"))):
            hits += [f"{p.relative_to(REPO)}: {word!r}" for _, word in hits_in(s)]
    assert not hits, _report(hits)


def test_comments_and_docstrings() -> None:
    hits = []
    for p in python_files():
        for line, text in prose_of_python(p.read_text(encoding="utf-8")):
            hits += [f"{p.relative_to(REPO)}:{n}: {word!r}" for n, word in hits_in(text, line)]
    assert not hits, _report(hits)
