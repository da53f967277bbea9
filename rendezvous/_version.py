"""The one place etcdrun's version is written (pyproject.toml reads it from here).

Why a module and not ``importlib.metadata``: that import costs an agent measurable CPU at start-up
(bench/results/figures.md), and N agents starting on one machine pay it N times
before the first round.
"""

__version__ = "0.1.0"
