"""`python -m agentstream.releases [FLAGS]`: decide canaries until SIGTERM (one process per topic prefix is enough;
a second one decides the same, and the first decision of a canary stands)."""

from __future__ import annotations

import sys

from agentstream.releases.judge import run
from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.flags import parse


def main(argv: list[str] | None = None) -> int:
    settings = parse(ReleasesSettings, argv)
    try:
        run(settings)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
