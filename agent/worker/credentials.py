"""The job's etcd credentials never reach the workers' environment (issue 11).

Why: the agent reads its etcd login from etcdctl's variables (rendezvous/etcd/core/config.py), and a
worker inherited the agent's environment whole — ``ETCDCTL_PASSWORD``, or ``ETCDCTL_USER`` in
its ``user:password`` form, was readable by user code (``os.environ``), which could then rewrite
the rendezvous of every node.

What is removed, for every worker (scripts, modules, executables, callables of any start
method):

- ``ETCDCTL_PASSWORD``;
- ``ETCDCTL_USER`` when it holds ``user:password``; a bare user name is kept — it names who, it
  opens nothing, and user code that brings its own password keeps working;
- ``ETCDCTL_CERT`` and ``ETCDCTL_KEY``: the client certificate and key that log in with mTLS
  (``ETCDCTL_CACERT`` stays: the CA is public, it only says whom to trust);
- any other variable whose value holds a ``password=`` setting (``PET_RDZV_CONF``, the Slurm
  script's ``ETCDRUN_RDZV_CONF``, ``ETCDRUN_ARGS``) or one of the passwords above.

etcd/core/config.py reads no key passphrase (gRPC takes unencrypted keys only), so there is none to
remove. A variable of the user's own that holds the password under another name, and that
does not say ``password=``, is the user's to unset.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

ALWAYS = ("ETCDCTL_PASSWORD", "ETCDCTL_CERT", "ETCDCTL_KEY")
_PASSWORD_SETTING = re.compile(r"(^|[\s,])password=\S")


def _passwords(environ: Mapping[str, str]) -> list[str]:
    found = [environ.get("ETCDCTL_PASSWORD", "")]
    user, sep, password = environ.get("ETCDCTL_USER", "").partition(":")
    if sep:
        found.append(password)
    return [p for p in found if p]


def credential_names(environ: Mapping[str, str]) -> list[str]:
    """The names of ``environ``'s variables that carry the job's etcd credentials."""
    passwords = _passwords(environ)
    drop = []
    for name, value in environ.items():
        if (
            name in ALWAYS
            or (name == "ETCDCTL_USER" and ":" in value)
            or _PASSWORD_SETTING.search(value)
            or any(p in value for p in passwords)
        ):
            drop.append(name)
    return drop


def scrubbed(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` without the job's etcd credentials."""
    drop = set(credential_names(environ))
    return {k: v for k, v in environ.items() if k not in drop}


__all__ = ["ALWAYS", "credential_names", "scrubbed"]
