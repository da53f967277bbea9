"""Print argv[1] lines of ~100 bytes, then ``done printing``, then sleep argv[2] seconds (until
the agent stops it).
"""

import sys
import time

for i in range(int(sys.argv[1])):
    print(f"line {i} " + "x" * 100, flush=True)
print("done printing", flush=True)
time.sleep(float(sys.argv[2]))
