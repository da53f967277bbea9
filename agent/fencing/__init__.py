"""Fencing the workers from outside the agent (design.md S4): the agent's side (guard.py) and
the warden, a small process beside each agent that acts when the agent cannot (warden.py).
"""
