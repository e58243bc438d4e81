"""Command-line flags generated from a configuration dataclass's fields (`EngineConfig`, `SamplingParams`).

One flag per field, `--field-name`: its type from the annotation (bool: `--x` / `--no-x`; int, float, str; a
tuple of strings: a repeatable flag; a tuple of ints: comma-separated), its choices from the field's
`metadata["choices"]`, its help from the class docstring's `name: text` entry; a field of another type names
its argparse keywords in `metadata["cli"]` (SamplingParams.structured_outputs: JSON text). An Optional field whose
default is not None also takes `none`, for None. A flag left out is None and the dataclass's own default applies,
so a field added to the dataclass appears on every front end at once, documented where it is defined.

Plain Python (no JAX): the server's and the bench's `--help` stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

_DOC_ENTRY = re.compile(r"^(\w+(?: / \w+)*): (.*)$")  # "name: text", or "a / b: text" for two fields


def field_docs(cls: type) -> dict[str, str]:
    """The text of each `name: text` entry of `cls`'s docstring (its indented continuation lines joined)."""
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        entry = _DOC_ENTRY.match(line)
        if entry:
            names = entry.group(1).split(" / ")
            docs.update(dict.fromkeys(names, entry.group(2)))
        elif line.startswith(" ") and names:
            for name in names:
                docs[name] += " " + line.strip()
        else:
            names = []
    return docs


def int_list(text: str) -> list[int]:
    """Comma-separated integers: "1,2,3"."""
    return [int(item) for item in text.split(",") if item.strip()]


def _argparse_kind(annotation: Any) -> dict[str, Any]:
    """argparse's type/action for a field annotated `annotation` (`X | None` as `X`)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) == 1:
            annotation = kinds[0]
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float, str):
        return {"type": annotation}
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        if item is str:  # strings may hold commas: one per flag
            return {"action": "append", "metavar": "TEXT"}
        if item is int:
            return {"type": int_list, "action": "extend", "metavar": "N,N,..."}
    raise TypeError(f"no command-line form for a field of type {annotation!r}")


class _NoneGiven:
    """The value of an Optional field's flag given as `none`: the field set to None (a flag left out is None too,
    and takes the field's default)."""

    def __repr__(self) -> str:
        return "none"


NONE_GIVEN = _NoneGiven()


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, with `none` (any case) for None."""

    def parse_or_none(text: str) -> Any:
        return NONE_GIVEN if text.lower() == "none" else parse(text)

    parse_or_none.__name__ = getattr(parse, "__name__", "value")  # argparse names the type in its errors
    return parse_or_none


def _is_optional(annotation: Any) -> bool:
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    return union and type(None) in typing.get_args(annotation)


@dataclasses.dataclass(frozen=True)
class ConfigFlags:
    """The flags of dataclass `cls`'s fields on one command line: every field but those in `skip` (a front end
    that writes its own flag for them, with another meaning), named `--field-name` unless `renamed` maps the
    field to another flag (the bench's `--seed` is its workload's, so EngineConfig.seed is `--engine-seed`)."""

    cls: type
    skip: frozenset[str] = frozenset()
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        names = {f.name for f in dataclasses.fields(self.cls)}
        unknown = (set(self.skip) | set(self.renamed)) - names
        if unknown:
            raise ValueError(f"{self.cls.__name__} has no fields {sorted(unknown)}")

    def names(self) -> list[str]:
        """The fields that get a generated flag, in the dataclass's order."""
        return [f.name for f in dataclasses.fields(self.cls) if f.name not in self.skip]

    def flag(self, name: str) -> str:
        return self.renamed.get(name, "--" + name.replace("_", "-"))

    def dest(self, name: str) -> str:
        """Where argparse puts the field's value in the parsed namespace."""
        return self.flag(name)[2:].replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Add a flag for each field of `names()` to `parser` (or an argument group of one)."""
        hints = typing.get_type_hints(self.cls)
        docs = field_docs(self.cls)
        fields = {f.name: f for f in dataclasses.fields(self.cls)}
        for name in self.names():
            f = fields[name]
            if name not in docs:
                raise ValueError(f"{self.cls.__name__}.{name} has no `{name}: ...` entry in its docstring")
            text = f"{self.cls.__name__}.{name}: {docs[name]}"
            kind = dict(f.metadata["cli"]) if "cli" in f.metadata else _argparse_kind(hints[name])
            if "choices" in f.metadata:
                kind["choices"] = f.metadata["choices"]
            if _is_optional(hints[name]) and f.default not in (None, dataclasses.MISSING) and "type" in kind:
                kind["type"] = _or_none(kind["type"])  # None, not the default, must be expressible too
                if "choices" in kind:
                    kind["choices"] = (*kind["choices"], NONE_GIVEN)
                text += " (`none` gives None)"
            if f.default is not dataclasses.MISSING and f.default not in (None, ()):
                text += f" (default: {f.default})"
            parser.add_argument(self.flag(name), dest=self.dest(name), default=None, help=text.replace("%", "%%"),
                                **kind)

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The fields whose flag `args` holds (not None), by field name; tuples as tuples."""
        values = {}
        for name in self.names():
            value = getattr(args, self.dest(name))
            if value is NONE_GIVEN:
                values[name] = None
            elif value is not None:
                values[name] = tuple(value) if isinstance(value, list) else value
        return values


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each option's default, except None: a flag left out, whose help says what then
    applies (generated flags name the dataclass's default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)
