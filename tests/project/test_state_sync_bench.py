"""bench/state_sync.py: its quick run, for real, and the memory meter its figures rest on.

Why: bench/results/state_sync.md is the project's figure for what a commit and a ``sync()`` cost
(docs/in-place.md, "What a commit costs"); a bench that breaks between its long runs publishes
nothing, and a meter that reads the wrong line of /proc publishes wrong figures quietly. The
quick run (``--quick --no-torchft``: one commit size, one two-rank sync of 48 MB; torchft is
not a test dependency) takes 20-30 s on two busy cores.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from layout import ROOT

from bench import state_sync, state_sync_worker


def _rows(page: str, heading: str) -> list[list[str]]:
    """The body rows of the first table under ``heading``."""
    section = page.split(heading, 1)[1].split("\n## ", 1)[0]
    lines = [x for x in section.splitlines() if x.startswith("|")]
    return [[c.strip() for c in x.strip("|").split("|")] for x in lines[2:]]


@pytest.mark.timeout(150)
def test_quick_run_writes_the_page_with_its_tables(torch_available, tmp_path):
    out = tmp_path / "state_sync.md"
    cmd = [sys.executable, "-m", "bench.state_sync", "--quick", "--no-torchft", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=140, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    page = out.read_text()
    assert page in run.stdout

    at = [page.index(h + "\n") for h in state_sync.HEADINGS]
    assert at == sorted(at), "the page's headings, in their stable order"

    (commit,) = _rows(page, "## Commit")
    assert commit[1] == "400", "the module's and Adam's tensors: 100 parameters, 3 states each"
    assert re.fullmatch(r"\d+(\.\d+)? ms", commit[2]) and float(commit[4]) > 0
    assert commit[8].endswith("×")

    (sync,) = _rows(page, "## Sync at 1 GB")
    assert not sync[2].startswith("failed"), sync[2]
    assert sync[:2] == ["2", "32 MB"] and float(sync[3]) > 0 and float(sync[5]) > 0
    assert sync[-1] == "yes", "the receivers received into their own buffers"
    extra = float(sync[8].split()[0])
    assert 0 < extra < 40, f"the broadcast's peak extra is a bucket (32 MB), not {extra} MB"
    assert "- 2 ranks: ≥ 1 GB/s" in page

    tf = page.split("## Against torchft 0.2.0", 1)[1].split("\n## ", 1)[0]
    assert "Not measured" in tf
    assert "`python -m bench.state_sync --quick --no-torchft --out" in page
    assert "OMP_NUM_THREADS=1" in page and "peak memory from: " in page


def test_peak_sees_memory_touched_and_not_memory_only_reserved(torch_available):
    import torch

    peak = state_sync_worker.Peak()
    peak.start()
    reserved = torch.empty(64 << 20, dtype=torch.uint8)  # pages not touched: no RSS
    assert peak.extra() < 8 << 20
    reserved.fill_(1)
    touched = peak.extra()
    del reserved
    assert 60 << 20 <= touched < 80 << 20, touched
