"""`python -m agentstream.gateway [FLAGS]`: serve the gateway until SIGTERM (in-flight calls finish first)."""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn

from agentstream.gateway import logs
from agentstream.gateway.app import create_app
from agentstream.gateway.service import settings_problem
from agentstream.gateway.settings import GatewaySettings
from agentstream.schemas.flags import parse, refuse


def main(argv: list[str] | None = None) -> None:
    settings = parse(GatewaySettings, argv)
    logs.configure(settings.log_level)
    problem = settings_problem(settings)
    if problem:
        refuse(problem)
    config = uvicorn.Config(
        create_app(settings), host=settings.host, port=settings.port, loop="uvloop", http="httptools", ws="none",
        lifespan="on", access_log=False, log_config=None, timeout_graceful_shutdown=round(settings.shutdown_timeout_s),
        backlog=4096,
    )
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again to exit by it; what it
    # raises then lands here, so a gateway that finished its calls exits 0
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.Server(config).run()


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    main()
