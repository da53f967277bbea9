"""Standby workers (``--prewarm``): warm interpreters, one per local slot, handed the round.
pool.py is the agent's side; boot.py runs inside the standby (standard library only).
"""
