"""Fails under @record in the job's first attempt (TORCHELASTIC_RESTART_COUNT 0), then succeeds:
a run that ends well after a fault.
"""

import os

from etcdrun.agent.errors import record


@record
def main() -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        raise ValueError("boom in the first attempt")


if __name__ == "__main__":
    main()
