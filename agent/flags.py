"""Values of the ``etcdrun`` flags, parsed as torchrun reads them and checked as strictly.

Why apart from cli.py: these are the rules for each value (``--nnodes 2:4``, ``--nproc-per-node
gpu``, ``--rdzv-conf k=v,...``, redirects, rank filters, option prefixes); cli.py is the parser
and the flow. Like cli.py this imports only os at the top: ``etcdrun --help`` loads it.
Accelerators are counted in agent/accelerators.py.
"""

from __future__ import annotations

import os
from typing import Any

# Standby workers (agent/standby/pool.py): what ``--prewarm`` and LaunchConfig default to.
DEFAULT_PREWARM = "auto"


def parse_prewarm(value: str) -> str:
    """``none``, ``auto`` or module names separated by commas; the normalised value."""
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    if names in ([], ["none"], ["auto"]):
        return names[0] if names else "none"
    for name in names:
        if name in ("none", "auto") or not all(p.isidentifier() for p in name.split(".")):
            raise ValueError(
                f"prewarm {value!r}: expected none, auto, or module names separated by commas"
            )
    return ",".join(names)


class UsageError(ValueError):
    """A mistake on the command line or in a PET_* variable: reported in one line, exit 2."""


def check_hang_timeout(value: float | None) -> None:
    """``--hang-timeout``: off (None) or a positive number of seconds. Why a floor of one
    second: the watchdog reads the beats a few times a second, and a step shorter than its
    own sampling would be judged by the sampling, not by the step.
    """
    if value is not None and not value >= 1:
        raise ValueError(f"hang_timeout ({value}) must be at least 1 second (or None: off)")


def _shown(action: Any) -> str:
    return max((o for o in action.option_strings if "_" not in o), key=len)


def _resolve(p: Any, name: str, ours: frozenset[str]) -> Any | None:
    """The option an abbreviation stands for (None: none starts so, argparse reports it).

    Unlike torchrun's argparse (Python 3.11 here), ``--nproc`` is not ambiguous between
    ``--nproc-per-node`` and its underscore twin: both are one option. A prefix that only our
    own options (``ours``) make ambiguous (``--v``: torchrun's ``--virtual-local-rank`` and our
    ``--version``) means torchrun's.
    """
    table = p._option_string_actions
    found = {o: a for o, a in table.items() if o.startswith(name) and o.startswith("--")}
    for pool in (found, {o: a for o, a in found.items() if o not in ours}):
        actions = {id(a): a for a in pool.values()}
        if len(actions) == 1:
            return next(iter(actions.values()))
    if not found:
        return None
    names = sorted({_shown(a) for a in found.values()})
    raise UsageError(f"ambiguous option: {name} could match {', '.join(names)}")


def expand_abbreviations(p: Any, argv: list[str], ours: frozenset[str] = frozenset()) -> list[str]:
    """``argv`` with each unambiguous prefix of an option (``--redirect=3``, ``--nnode 2``)
    written out, up to the script: torchrun's argparse accepts them.

    Why not argparse's own ``allow_abbrev``: it classifies every word of the command line,
    the script's arguments too, so ``train.py --ma 1`` would fail as ambiguous (torchrun's
    does) — here the script's arguments are never looked at. Token for token: nothing is added
    or dropped, so positions stay as they were.
    """
    table = p._option_string_actions
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--" or arg == "-" or not arg.startswith("-"):
            return out + argv[i:]  # the script (or "--") and everything after it
        i += 1
        name, eq, value = arg.partition("=")
        if arg.startswith("--"):
            action = table.get(name) or _resolve(p, name, ours)
            full = name if name in table or action is None else _shown(action)
            out.append(full + eq + value)
        else:  # -m, -r 3, -r3
            action = table.get(arg[:2])
            out.append(arg)
            if len(arg) > 2:
                continue
        if action is not None and action.nargs != 0 and not eq and i < len(argv):
            out.append(argv[i])  # its value, whatever it looks like
            i += 1
    return out


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise UsageError(f"--nnodes {value!r}: expected N or MIN:MAX (integers)")


def parse_nproc(value: str) -> int:
    """``--nproc-per-node``: a number, or torchrun's words (agent/accelerators.py counts)."""
    from etcdrun.agent import accelerators as acc

    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    if text == "cpu":
        return acc.cpu_count()
    if text == "gpu":
        gpus = acc.gpu_count()
        if not gpus:
            raise UsageError(
                f"--nproc-per-node gpu: no GPU is visible on this node ({acc.where_gpus()})"
            )
        return gpus
    if text == "xpu":
        xpus = acc.xpu_count()
        if not xpus:
            raise UsageError(
                f"--nproc-per-node xpu: no Intel GPU (XPU) is visible on this node "
                f"({acc.where_xpus()})"
            )
        return xpus
    if text == "auto":  # torchrun: the accelerators if any, else the CPUs
        return acc.gpu_count() or acc.xpu_count() or acc.cpu_count()
    raise UsageError(
        f"--nproc-per-node {value!r}: expected an integer, cpu, gpu, xpu or auto "
        "(another accelerator's name is not known here: give a number)"
    )


def parse_rdzv_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    if not text.strip():
        return conf
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not key or not sep or not value:
            raise UsageError(f"--rdzv-conf: {item.strip()!r} is not key=value (k1=v1,k2=v2,...)")
        conf[key] = value
    return conf


def parse_filters(text: str | None) -> list[str] | None:
    """``--duplicate-*-filters a,b``: torchrun's comma list, where ``,,`` is a literal comma."""
    if text is None:
        return None
    hold = "\0"
    return [item.replace(hold, ",") for item in text.replace(",,", hold).split(",")]


def find_logs_specs(name: str | None) -> str | None:
    """``--logs-specs NAME``: the entry point must exist in ``torchrun.logs_specs`` (torch's
    error otherwise); found without loading it (it is torch code).
    """
    if name is None:
        return None
    from importlib.metadata import entry_points

    if not entry_points(group="torchrun.logs_specs").select(name=name):
        raise UsageError(
            f"--logs-specs: could not find entrypoint under 'torchrun.logs_specs[{name}]' key"
        )
    return name


def check_virtual_local_rank(enabled: bool, nproc: int) -> None:
    """torch raises when a worker starts; here the command line fails before anything does."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if enabled and visible is not None and nproc > len(visible.split(",")):
        raise UsageError(
            f"--virtual-local-rank: --nproc-per-node {nproc} exceeds the GPUs in "
            f"CUDA_VISIBLE_DEVICES={visible}"
        )


def parse_std(flag: str, text: str) -> Any:
    """torchrun's redirect syntax (0-3, or ``rank:0-3,...``), parsed by the worker runtime's Std."""
    from etcdrun.agent.api import Std

    try:
        value = Std.from_str(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    return None if value == Std.NONE else value


def parse_ranks_filter(text: str) -> set[int] | None:
    """``--local-ranks-filter 0,2``: WorkerSpec's rank-set rule, with the flag's message."""
    if not text.strip():
        return None
    from etcdrun.agent.api import rank_set

    try:
        ranks = rank_set(text, "--local-ranks-filter")
    except ValueError:
        ranks = None
    if not ranks:
        raise UsageError(
            f"--local-ranks-filter {text!r}: expected a comma list of local ranks, e.g. 0,1,2"
        )
    return set(ranks)
