"""One logging format for every batonlm process."""

from __future__ import annotations

import logging


def configure_logging(level: str, process: str = "main") -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s [{process}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
