"""What the grader runs inside its sandbox, as the sandbox's unprivileged uid: standard library only, each
script runnable by path (`python -I /grader/inside/<script>.py`), none of them importing the tree under test."""
