"""etcdrun's benchmarks and the harness they share, as one package.

Run each benchmark as a module, from the repository root::

    python -m bench.compare --help        # etcdrun vs torchrun (makes bench/.venv-torch)
    python -m bench.rendezvous_scale --n 10,100,1000
    python -m bench.client_latency
    python -m bench.soak --trials 20 --seed 1000

Every benchmark runs the same way; its module docstring gives its usage line. Figures and the
commands that produced them are on each benchmark's page, bench/results/<bench>.md (compare.py's:
bench/results.md). ``python -m bench.compare``, ``bench.standby_bench`` and ``bench.ab`` re-execute
themselves (``python -m``, same working directory) under bench/.venv-torch, which they create on
first use.

Why a package: the benchmarks share one harness (procs, trial, scenarios, launchers, report), and
its modules import one another as ``bench.<name>``: none edits ``sys.path`` to find another.
Two benchmarks drive the test suite's own harness (soak.py: tests/chaos/; recovery_load.py:
tests/agent_helpers.py) and put tests/ on ``sys.path`` for it, saying why in their docstrings:
the only places bench/ reaches into tests/.

What is not run with ``-m``: the workers that launchers start (compare_worker.py, started by
etcdrun and torchrun as a script file given by path, like any user's training script). They
import nothing from bench/.
"""
