"""The old home of `polar_mitm.tasks.answer_check`, kept because task files written before the move name it in
their eval command (`python -P -m polar_mitm.rollout.answer_check N`): without it every such session would score 0."""

import sys

from polar_mitm.tasks.answer_check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv))
