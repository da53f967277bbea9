"""Write this worker's environment and argv to <outdir>/env_<RANK>.json."""

import json
import os
import sys

out = sys.argv[1]
with open(os.path.join(out, f"env_{os.environ['RANK']}.json"), "w") as fp:
    json.dump({"env": dict(os.environ), "argv": sys.argv[1:], "pid": os.getpid()}, fp)
