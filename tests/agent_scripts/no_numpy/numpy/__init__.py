"""On PYTHONPATH, this makes ``import numpy`` fail as it does where numpy is not installed, as
in an environment with torch alone: torch does not depend on numpy
(tests/pytorch/test_in_place_owned.py).
"""

raise ModuleNotFoundError("No module named 'numpy' (blocked by this test)", name="numpy")
