"""`edgetune presets`: the shipped presets, each with its description."""

from __future__ import annotations

import shutil
import textwrap

from edgetune.engine.core.config_files import list_presets, preset_description


def cmd_presets(a) -> int:
    width = max(60, min(shutil.get_terminal_size((100, 20)).columns, 120))
    for name, path in list_presets().items():
        lines = textwrap.wrap(preset_description(path), width - 18) or [""]
        print(f"{name:16s}  {lines[0]}")
        for more in lines[1:]:
            print(f"{'':16s}  {more}")
    return 0


def add_parser(sub) -> None:
    """`edgetune presets`."""
    ps = sub.add_parser("presets", help="list presets")
    ps.set_defaults(fn=cmd_presets)
