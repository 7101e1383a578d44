"""Attacker: try to write outside the workspace; print the paths it managed to write.

    python3 escape_write.py PATH... : prints {"written": [...], "refused": [...]}
"""

import json
import os
import sys

written, refused = [], []
for path in sys.argv[1:]:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write("pwned\n")
        written.append(path)
    except OSError as exc:
        refused.append([path, exc.strerror])
print(json.dumps({"written": written, "refused": refused}))
