"""`python -m agentstream.releases [FLAGS]`: decide canaries until SIGTERM (one process per topic prefix is enough;
a second one decides the same, and the first decision of a canary stands)."""

from __future__ import annotations

import sys

from pydantic import ValidationError
from pydantic_settings import CliApp

from agentstream.releases.judge import run
from agentstream.releases.settings import ReleasesSettings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = CliApp.run(ReleasesSettings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            print(f"error: --{'.'.join(str(part) for part in error['loc']).replace('_', '-')}: {error['msg']}",
                  file=sys.stderr)
        return 2
    try:
        run(settings)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
