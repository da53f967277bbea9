"""How a worker's console lines look, as torchrun writes them, and its filtered duplicate logs.

Why its own module: the look of the output (prefix template, torchrun's tee header,
``--duplicate-*-filters``) is torchrun parity, apart from how a worker process is made
(spawn.py) and how bytes are relayed (reactor.py).

torchrun prefixes teed lines only, with ``[${role_name}${local_rank}]:`` (``[default0]:``;
torch's TailLog header) or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (``${role_name}``,
``${rank}``, ``${local_rank}``, since torch 2.14 ``${hostname}``, the short name; string.Template's
safe_substitute); a worker that is not teed
writes to the console itself, bare. The ``[rank0]:`` seen in torchrun's output is torch's own
logging inside the worker (torch._logging; c10d's C++ warnings), printed under both launchers.
"""

from __future__ import annotations

import os
import socket
import string
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from etcdrun.agent.api import Worker, WorkerSpec
    from etcdrun.agent.worker.logdir import WorkerFiles

TEE = "tee"  # _spawn's stream mode for a teed stream
# torchrun's header for a teed line (LocalElasticAgent/TailLog: "[trainer0]:"), and its variable.
DEFAULT_TEE_PREFIX = "[${role_name}${local_rank}]:"
PREFIX_TEMPLATE_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def line_prefix(spec: WorkerSpec, worker: Worker, mode: str) -> bytes:
    """The prefix of a worker's console lines, as torchrun writes them.

    torchrun prefixes teed lines only (``[${role_name}${local_rank}]:``, e.g. ``[default0]:``,
    or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` with ``${role_name}``, ``${rank}``,
    ``${local_rank}``); a worker that is not teed writes to the console itself, unprefixed.
    Here every console line passes through the agent (for the root-cause tail), and it is
    written the same way; a template given here prefixes untee'd lines too (under torchrun it
    would do nothing there): ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[${rank}]:'`` labels
    every line with its global rank.
    """
    template = spec.log_line_prefix_template
    if template is None:
        template = os.environ.get(PREFIX_TEMPLATE_VAR) or None
    if template is None:
        template = DEFAULT_TEE_PREFIX if mode == TEE else ""
    text = string.Template(template).safe_substitute(
        role_name=spec.role,
        rank=worker.global_rank,
        local_rank=worker.local_rank,
        hostname=socket.gethostname(),
    )
    return text.encode()


def filtered_file(files: WorkerFiles, std: str, filters: list[str] | None) -> Any:
    """``<attempt>/filtered_<std>.log`` (torch's name), shared by the attempt's workers, opened
    for appending (every stream has its own descriptor); None without filters.
    """
    if not filters:
        return None
    path = os.path.join(os.path.dirname(files.dir), f"filtered_{std}.log")
    return open(path, "ab", buffering=0)  # noqa: SIM115 - the relay closes it


__all__ = ["DEFAULT_TEE_PREFIX", "PREFIX_TEMPLATE_VAR", "filtered_file", "line_prefix"]
