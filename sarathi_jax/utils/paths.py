"""Paths a user gives, made absolute once, where they enter: a command's arguments (`cli_path` as argparse's
`type=`) or a public API's parameters (`absolute_path`). Below the edge every path is absolute, so nothing
depends on the current directory staying the same, and libraries that refuse relative paths (Orbax's atomic
save: "Snapshot destination must be absolute") get what they need.
"""

from __future__ import annotations

import argparse
import os


def absolute_path(path: str | os.PathLike[str]) -> str:
    """`path` with `~` expanded, joined to the current directory when relative, and normalised (`..` removed;
    symlinks are kept, as the user named them)."""
    text = os.fspath(path)
    if not text:
        raise ValueError("empty path")
    return os.path.abspath(os.path.expanduser(text))


def cli_path(text: str) -> str:
    """argparse `type=` for a path option: the absolute path, or argparse's usage error for an empty one."""
    try:
        return absolute_path(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cli_program(text: str) -> str:
    """argparse `type=` for a program to run: a bare name (`python3`) is kept for the PATH lookup, as a shell
    would do it; anything with a directory part is a path, made absolute (a subprocess may run elsewhere)."""
    if os.sep not in text and not (os.altsep and os.altsep in text):
        if not text:
            raise argparse.ArgumentTypeError("empty program name")
        return text
    return cli_path(text)
