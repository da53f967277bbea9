"""The documentation: the MkDocs site builds with ``--strict``, and every relative link in
README.md, CONTRIBUTING.md and docs/ points at a file, and a heading, that exists.

Why both checks: ``mkdocs build --strict`` validates the links between the site's own pages
(mkdocs.yml makes a broken link or anchor a warning, and ``--strict`` makes a warning fatal), but
README.md and CONTRIBUTING.md are read on GitHub and are not part of the site, and a page's link
to a file outside docs/ (the code, deploy/, examples/) is something only a file check sees.

Why mkdocs is a test extra: CI runs ``pip install -e '.[test]'`` and then the README's test
command, so the site is built on every CI run. A missing mkdocs skips locally and FAILS in CI
(``CI=true``), as a missing etcd does (tests/conftest.py): a skip there would hide a broken site.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from layout import ROOT

README = ROOT / "README.md"
README_LIMIT = 12 * 1024  # bytes: the front door, not the manual (the manual is docs/)
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def documents() -> list[Path]:
    """The Markdown a reader meets: the front door, the contributor's guide and every page."""
    pages = sorted((ROOT / "docs").rglob("*.md"))
    return [README, ROOT / "CONTRIBUTING.md", *pages]


def prose(text: str) -> str:
    """The text without code blocks and code spans: a link shown as code is not a link."""
    return CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    return INLINE.findall(body) + REFERENCE.findall(body)


def _heading_text(raw: str) -> str:
    """A heading as rendered text: links by their words, no code ticks or emphasis marks."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return text.replace("`", "").replace("**", "").replace("__", "")


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's toc slugify, which MkDocs uses."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def anchors(text: str) -> set[str]:
    """Every anchor a link into this Markdown may name, as GitHub or MkDocs would make it."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for raw in HEADING.findall(FENCE.sub("", text)):
        heading = _heading_text(raw)
        for slug in {github_slug(heading), mkdocs_slug(heading)}:
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(text: str, base: Path, label: str) -> list[str]:
    """What is wrong with each relative link of one Markdown text whose file is in ``base``."""
    problems = []
    for url in links(text):
        if SCHEME.match(url) or url.startswith("//"):
            continue  # a web address: not this test's business
        target, _, anchor = url.partition("#")
        dest = (base / target).resolve() if target else None
        where = f"{label}: {url}"
        if dest is None:
            if anchor not in anchors(text):
                problems.append(f"{where}: no heading with that anchor here")
        elif not dest.is_relative_to(ROOT):
            problems.append(f"{where}: points outside the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{where}: no heading with that anchor in {dest.relative_to(ROOT)}")
    return problems


def test_every_relative_link_points_at_something_that_exists():
    problems = []
    for doc in documents():
        if doc.exists():
            problems += broken_links(doc.read_text(), doc.parent, str(doc.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_the_link_check_sees_a_broken_link_and_a_broken_anchor():
    """The check itself: a link to a missing file or heading is found; code is not a link."""
    good = "[ok](getting-started.md) [top](#etcdrun) `[code](nowhere.md)` [up](../README.md)"
    bad = "[gone](nowhere.md) [anchor](getting-started.md#no-such-heading) [self](#nope)"
    problems = broken_links(f"# etcdrun\n\n{good}\n\n{bad}\n", ROOT / "docs", "probe")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "nowhere.md: no such file",
        "getting-started.md#no-such-heading: no heading with that anchor in "
        "docs/getting-started.md",
        "#nope: no heading with that anchor here",
    ]


def test_slugs_match_github_and_mkdocs():
    assert github_slug("The etcd rendezvous") == mkdocs_slug("The etcd rendezvous")
    assert github_slug(_heading_text("`etcdrun status`: the run")) == "etcdrun-status-the-run"
    assert mkdocs_slug("Status, events — metrics") == "status-events-metrics"


UNSTABLE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\bissue \d+|not from the compare\.py run", re.I)


def bench_pages() -> list[Path]:
    """compare.py's bench/results.md and every benchmark's own page, bench/results/<bench>.md."""
    return [ROOT / "bench" / "results.md", *sorted((ROOT / "bench" / "results").glob("*.md"))]


def test_bench_pages_have_a_title_and_stable_headings():
    """Each results page has a title, and headings that a rerun leaves as they are: no date, no
    issue number. The docs link into the pages by those headings' anchors, so a heading that
    named its run broke every link on the next run; the run's date goes in the text instead.
    """
    problems = []
    for page in bench_pages():
        rel = page.relative_to(ROOT)
        text = page.read_text()
        if not text.startswith("# "):
            problems.append(f"{rel}: no title on its first line")
        headings = HEADING.findall(FENCE.sub("", text))
        problems += [f"{rel}: {h!r}" for h in headings if UNSTABLE.search(h)]
    assert len(bench_pages()) > 3 and not problems, "\n".join(problems)


def test_required_files_exist():
    for name in ("CONTRIBUTING.md", "mkdocs.yml", "docs/index.md"):
        assert (ROOT / name).is_file(), name


def test_readme_is_a_front_door():
    """README.md says what etcdrun is and how to start; the manual lives in docs/."""
    size = len(README.read_bytes())
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes (limit {README_LIMIT}): move the detail to a docs/ page"
    )


@pytest.fixture
def mkdocs_available() -> None:
    if importlib.util.find_spec("mkdocs") is None:
        msg = "mkdocs is not installed (pip install -e '.[test]' or '.[docs]' brings it)"
        if _in_ci():
            pytest.fail(f"{msg} [CI=true: a missing mkdocs is an error]", pytrace=False)
        pytest.skip(msg)


@pytest.mark.timeout(120)
def test_mkdocs_build_strict(mkdocs_available, tmp_path):
    """The site builds with no warning: every page in the nav, every link and anchor found."""
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    assert (site / "index.html").is_file()
    assert (site / "bench" / "results.html").is_file()  # the hook published it
    for page in bench_pages()[1:]:  # and each benchmark's page
        assert (site / "bench" / "results" / f"{page.stem}.html").is_file(), page.name
