"""Run with -m: record the rank and argv in <outdir>/mod_<RANK>."""

import os
import sys

with open(os.path.join(sys.argv[1], f"mod_{os.environ['RANK']}"), "w") as fp:
    fp.write(" ".join([__name__, *sys.argv[2:]]))
