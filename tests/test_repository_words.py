"""Nothing in the repository speaks of how it was made: code, comments, docs and results say what
the code does and what was measured, not in which working session, for which ticket or with which
internal tool. (This file names the words it looks for, so it leaves itself out.)"""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = re.compile(r"\bsessions?\b|\bthe seed\b|\bseed's\b|\bissues? #?\d+|\bticket\b|\bfarm-bench\b|\bdevice tool\b"
                   r"|\blab notebook\b|\b(first|second|third|[a-z]+teenth|twentieth) (session|round of work)\b", re.I)


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
        if path == os.path.relpath(__file__, ROOT):
            continue
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):  # binary files, built libraries
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if WORDS.search(line):
                found.append(f"{path}:{number}: {line.strip()[:120]}")
    assert found == [], "\n".join(found)
