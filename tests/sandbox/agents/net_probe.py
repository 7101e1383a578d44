"""Attacker: try to reach addresses; print which answered.

    python3 net_probe.py HOST:PORT... : prints {"reached": [...], "failed": {address: error}}
Also tries to resolve a public name and to open an HTTP request when told a URL (prefix http).
"""

import json
import socket
import sys
import urllib.request

reached, failed = [], {}
for target in sys.argv[1:]:
    try:
        if target.startswith("http"):
            with urllib.request.urlopen(target, timeout=5) as response:
                reached.append([target, response.read().decode()])
        elif target.startswith("dns:"):
            reached.append([target, socket.gethostbyname(target[4:])])
        else:
            host, port = target.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=3).close()
            reached.append([target, ""])
    except Exception as exc:
        failed[target] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"reached": reached, "failed": failed}))
