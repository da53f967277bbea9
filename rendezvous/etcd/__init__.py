"""The etcd v3 backend of the rendezvous (``--rdzv-backend etcd``): design.md §2-§3, §8.

The handler (handler.py) is the only part the registry builds. Around it: the run's key layout
(keys.py), the values in etcd (codec.py), the pure decision (protocol.py) and the fenced
transactions built without I/O (transitions.py), what this node knows of the round key
(round_view.py, round_watch.py); node/ is what every agent does for itself (its session, its
joins, the end of a round), leader/ what the oldest agent does for all (election, decisions).
"""
