"""docs/flags.md, written from the settings' declarations.

`python -m batonlm.settings_docs` rewrites it (`make docs`); `tests/unit/test_settings.py` fails
when it is stale, and checks that every other flag table of the docs states the declared
defaults (`doc_table_mismatches`).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from batonlm.config import ServerArgs
from batonlm.settings import GROUPS, Declared, declared

REPO = Path(__file__).resolve().parents[1]
FLAGS_DOC = REPO / "docs" / "flags.md"
HELP_WIDTH = 100


def flag_names(d: Declared) -> list[str]:
    """How the docs name a setting: its flags, or MODEL for the positional one."""
    return [d.name.upper()] if d.setting.positional else [*d.setting.flags, d.flag]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def serve_help() -> str:
    """`batonlm serve --help` as a terminal HELP_WIDTH columns wide shows it."""
    from batonlm.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = serve.choices["serve"]
    sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=HELP_WIDTH, max_help_position=30)
    return sub.format_help()


def flags_markdown() -> str:
    lines = [
        "# `batonlm serve` flags",
        "",
        "Written by `python -m batonlm.settings_docs` from the declarations in `batonlm/config.py`",
        "(each flag is declared once there: its type, default, bounds, group and help); a test fails",
        "when this page is stale. Every flag is also a key of a `--config` preset (`configs/*.yaml`),",
        "with dashes or underscores.",
        "",
    ]
    by_group: dict[str, list[Declared]] = {g: [] for g in GROUPS}
    for d in declared(ServerArgs):
        by_group[d.setting.group].append(d)
    for group, about in GROUPS.items():
        lines += [f"## {group}", "", about[0].upper() + about[1:] + ".", "",
                  "| flag | default | what it does |", "|---|---|---|"]
        for d in by_group[group]:
            names = ", ".join(f"`{n}`" for n in flag_names(d))
            takes = f" ({d.describe()})" if d.kind in (int, float) or d.setting.choices else ""
            lines.append(f"| {names} | {_cell(d.shown_default())} | {_cell(d.setting.help)}{_cell(takes)} |")
        lines.append("")
    lines += ["## `batonlm serve --help`", "", "```", serve_help().rstrip(), "```", ""]
    return "\n".join(lines)


_ROW = re.compile(r"^\|(.+)\|\s*$")


def doc_table_mismatches(text: str) -> list[str]:
    """Rows of markdown tables with a "flag" and a "default" column whose flags are not
    declared, or whose default is not the declared one (", "-joined for several flags)."""
    # flag -> (the setting it names, its default); aliases name the same setting
    settings = {name: (d.name, d.shown_default()) for d in declared(ServerArgs) for name in flag_names(d)}
    settings["--config"] = ("config", "none")  # the CLI's own flag (a preset file), not a setting
    problems = []
    columns: list[str] | None = None
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m is None:
            columns = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(1))]
        if columns is None:
            columns = [c.lower() for c in cells]
            continue
        if set(cells[0]) <= set("-: ") or "flag" not in columns or "default" not in columns:
            continue
        names = re.findall(r"`(--[a-z0-9-]+|MODEL)[^`]*`", cells[columns.index("flag")])
        unknown = [n for n in names if n not in settings]
        if unknown or not names:
            problems.append(f"{line.strip()}: {'unknown flag ' + ', '.join(unknown) if unknown else 'no flag named'}")
            continue
        stated = cells[columns.index("default")].replace("`", "")
        wanted = ", ".join(dict(settings[n] for n in names).values())
        if stated != wanted:
            problems.append(f"{line.strip()}: the default of {', '.join(names)} is {wanted!r}, not {stated!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0]) if argv else FLAGS_DOC
    out.write_text(flags_markdown())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
