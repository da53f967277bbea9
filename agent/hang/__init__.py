"""The hang watchdog: a worker that stops making progress is found, shown and acted on
(design.md §4b): progress beats in (agent/worker/beat.py), stacks out (stacks.py), one verdict
for the round (verdict.py), the thread that runs it (watchdog.py).
"""
