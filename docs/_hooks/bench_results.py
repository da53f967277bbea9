"""MkDocs hook: publish bench/results.md, each benchmark's page and the files they show inside
the site.

Why: the benchmark figures live once, beside the benchmarks: bench/results.md, which
bench/compare.py writes next to its plot, and one page per benchmark, bench/results/<bench>.md,
with its latest run. The pages cite them as ``../bench/results.md`` and
``../bench/results/<bench>.md#<heading>`` so that the links also work where the Markdown is read
as files (GitHub, an editor). MkDocs only knows files under docs/, so this hook adds the bench
files to the site under ``bench/`` and points the pages' ``../bench/`` links there. No copy is
kept in docs/: a copy would drift from the pages it copies. mkdocs.yml's nav lists every page
(``--strict`` fails on one left out).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]
BENCH_FILES = (
    "bench/results.md",
    "bench/recovery.png",
    "bench/rendezvous_scale.svg",
    "bench/rendezvous_scale.json",
)
LINK = re.compile(r"\]\(\.\./bench/")


def on_files(files, config):
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "bench/results").glob("*.md"))
    for path in (*BENCH_FILES, *pages):  # each benchmark's own page: bench/results/<bench>.md
        if (REPO / path).is_file():
            files.append(File(path, str(REPO), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if "/" in page.file.src_uri:  # only the top-level pages link to ../bench/
        return markdown
    return LINK.sub("](bench/", markdown)
