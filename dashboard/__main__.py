"""`python -m agentstream.dashboard` (`agentstream dashboard`): serve the web dashboard over the log."""

from __future__ import annotations

import sys

import uvicorn

from agentstream.dashboard.app import create_app
from agentstream.dashboard.settings import DashboardSettings
from agentstream.schemas.flags import parse, refuse


def main(argv: list[str] | None = None) -> int:
    settings = parse(DashboardSettings, argv)
    try:
        app = create_app(settings)
    except ValueError as exc:
        refuse(str(exc))
    print(f"agentstream dashboard on http://{settings.host}:{settings.port} (topics {settings.topic_prefix or '(no prefix)'}"
          f" on {settings.bootstrap_servers})", file=sys.stderr, flush=True)
    # open pages hold their event streams open: on SIGTERM give requests a few seconds, not forever
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
