"""A worker that leaves descendants behind: one double-forked, one in its own session.

It writes their pids to <out>/kids_<rank>_<round>.txt, then sleeps until stopped. Used to show
that nothing of a worker's tree outlives a stop or the agent (tests/agent/test_fencing.py).
"""

import os
import subprocess
import sys
import time

out, rank, rnd = sys.argv[1], os.environ["RANK"], os.environ["ETCDRUN_ROUND"]
kids = []
# A setsid'd child: it leaves the worker's process group, so killpg does not reach it.
kids.append(subprocess.Popen(["sleep", "300"], start_new_session=True).pid)
# A double fork: the grandchild's parent exits at once, so it is reparented away.
r, w = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid()
        os.write(w, str(os.getpid()).encode())
        os.execvp("sleep", ["sleep", "300"])
    os._exit(0)
os.wait()
kids.append(int(os.read(r, 32)))
path = os.path.join(out, f"kids_{rank}_{rnd}.txt")
with open(path + ".tmp", "w") as f:
    f.write(" ".join(map(str, kids)))
os.replace(path + ".tmp", path)
print(f"forker rank {rank} round {rnd} left {kids}", flush=True)
time.sleep(600)
