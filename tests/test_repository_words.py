"""Nothing in the repository speaks of how it was made: code, comments, docs and results say what
the code does and what was measured, not in which period of work, for which request or with which
internal tool it was done. The words looked for are kept ROT13-encoded, so this file passes its own
check."""
import codecs
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _word(encoded: str) -> str:
    return re.escape(codecs.decode(encoded, "rot13"))


WORK, ROUND, SEED, ISSUE = (_word(w) for w in ("frffvba", "ebhaq bs jbex", "frrq", "vffhr"))
PHRASES = [_word(w) for w in ("gur frrq", "gvpxrg", "snez-orapu", "qrivpr gbby", "yno abgrobbx")]
WORDS = re.compile("|".join([rf"\b{WORK}s?\b", rf"\b{SEED}'s\b", rf"\b{ISSUE}s? #?\d+",
                             *(rf"\b{p}\b" for p in PHRASES),
                             rf"\b(first|second|third|[a-z]+teenth|twentieth) ({WORK}|{ROUND})\b"]), re.I)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): every file under the root
        return [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) for f in fs
                if "/.git" not in d and "/.venv" not in d]
    return out.stdout.split()


def test_no_words_about_how_the_project_was_made():
    found = []
    for path in tracked_files():
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):  # binary files, built libraries
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if WORDS.search(line):
                found.append(f"{path}:{number}: {line.strip()[:120]}")
    assert found == [], "\n".join(found)
