"""`python -m agentstream.trainer [FLAGS]`: the trainer process (every setting is a flag; see --help)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from agentstream.schemas.flags import parse
from agentstream.trainer.settings import TrainerSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse(TrainerSettings, argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(settings))


async def serve(settings: TrainerSettings) -> None:
    from transformers.utils import logging as hf_logging

    from agentstream.schemas.errors import AgentstreamError
    from agentstream.trainer.memory import DoesNotFit
    from agentstream.trainer.service import Trainer  # imports torch and verl: after --help has had its chance
    from agentstream.trainer.tenant_trainer import TenantTrainer

    hf_logging.disable_progress_bar()
    trainer = TenantTrainer(settings) if settings.tenant_adapters else Trainer(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, trainer.stop)
    try:
        await trainer.run()
    except DoesNotFit as exc:  # its own exit code: a supervisor tells it from a crash
        print(f"trainer: {exc}", file=sys.stderr)
        raise SystemExit(DoesNotFit.exit_code) from None
    except AgentstreamError as exc:
        raise SystemExit(f"trainer: {exc}") from None


if __name__ == "__main__":
    main()
