"""Write an error file exactly as torch's ErrorHandler does (no etcdrun import), then exit 1."""

import json
import os
import sys
import time
import traceback


def failing() -> None:
    raise RuntimeError("torch-style failure")


try:
    failing()
except Exception as e:
    data = {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
            },
        }
    }
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
        json.dump(data, fp)
    sys.exit(1)
