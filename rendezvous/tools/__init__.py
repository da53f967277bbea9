"""Tools that read a run from etcd without taking part in it: ``etcdrun status`` (status.py)
and the invariant checker that replays the round key's history (checker.py).
"""
