"""The old home of `polar_mitm.tasks.swe_grading`, kept because SWE task files written before the move name it in
their eval command (`python -P -m polar_mitm.rollout.swe_grading grade SPEC DIGEST`)."""

import sys

from polar_mitm.tasks.swe_grading import main

if __name__ == "__main__":
    sys.exit(main())
