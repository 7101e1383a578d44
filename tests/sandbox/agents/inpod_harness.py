"""A harness in a sandbox pod, as its sandbox sees it: the attempt's token in its environment, an
InPodSandbox, one command.

    python3 inpod_harness.py WORKSPACE COMMAND [--unhardened] : prints {"pid", "exit_code", "output"},
                                                                or {"refused": why} and exits 3
--unhardened: without `sandbox.inpod.harden` (the control: what a command could reach before it).
"""

import json
import os
import sys
from pathlib import Path

from agentstream.sandbox import inpod
from agentstream.sandbox.contract import Limits, SandboxError, SandboxSpec

workspace, command, *flags = sys.argv[1:]
if "--unhardened" in flags:
    inpod.harden = lambda: None
try:
    with inpod.InPodSandbox(SandboxSpec(Path(workspace), limits=Limits(command_timeout_s=30))) as box:
        result = box.run(command)
except SandboxError as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit(3)
print(json.dumps({"pid": os.getpid(), "exit_code": result.exit_code, "output": result.output}))
