"""Target of the run_path kind: writes <outdir>/runpath_<RANK> then exits 0 via sys.exit."""

import os
import sys

if __name__ == "__main__":
    with open(os.path.join(sys.argv[1], f"runpath_{os.environ['RANK']}"), "w") as fp:
        fp.write(" ".join(sys.argv[1:]))
    sys.exit(0)
