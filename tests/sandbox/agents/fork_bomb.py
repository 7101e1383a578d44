"""Attacker: fork until the kernel says no, keep every child alive, and wait forever."""

import os
import time

children = 0
while True:
    try:
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)
        children += 1
    except OSError:
        print(f"fork refused after {children} children", flush=True)
        break
time.sleep(3600)
