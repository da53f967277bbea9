"""The etcd v3 backend of the rendezvous (``--rdzv-backend etcd``): design.md §2-§3, §8.

The handler (handler.py) is the only part the registry builds, and the top of four layers below
it, each importing only those under it (tests/project/test_imports.py): core/ (the run's keys,
values, pure decision, fenced transactions and the Session), node/ (what every agent does for
itself: register, join, the end of a round), leader/ (what the oldest agent does for all:
election, decisions) and ports/ (what the agent holds of the backend: design.md §8).
"""
