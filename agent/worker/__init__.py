"""The local worker processes of one agent: how each is made (spawn.py, boot.py, the exit hook
in _site/), watched (reactor.py, proc.py), logged (logdir.py, output.py) and reported
(error_file.py), and the group that starts and stops them together (group.py).
"""
