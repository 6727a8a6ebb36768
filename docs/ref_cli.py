"""The command-line and settings references, from the parsers and AggregatorSettings.

``cli_page()`` and ``settings_page()`` write the pages; ``flag_table(command, select)`` is
the rows for some flags, which docs/hooks.py puts in hand-written pages. Everything is
read from ``kvevents.cli.main.build_parser()`` and the settings model at build time, so
a flag or setting added to the code appears without a hand edit.
"""

from __future__ import annotations

import argparse

from ref_common import cell, code

# ---------------------------------------------------------------- the command line

def serve_field(dest: str) -> str | None:
    """The ``AggregatorSettings`` field a ``serve`` flag sets, or None (``--config``...).

    The flag's dest is the field's name or one of its accepted aliases, singular or
    plural (``--endpoint`` -> ``engines`` via its alias ``endpoints``)."""
    from pydantic import AliasChoices

    from kvevents.service.settings import AggregatorSettings

    fields = AggregatorSettings.model_fields
    aliases = {}
    for name, f in fields.items():
        if isinstance(f.validation_alias, AliasChoices):
            for choice in f.validation_alias.choices:
                aliases[str(choice)] = name
    for candidate in (dest, dest + "s"):
        if candidate in fields:
            return candidate
        if candidate in aliases:
            return aliases[candidate]
    return None


def env_names(field: str) -> list[str]:
    from kvevents.service import settings as s

    return [s.env_name(field), *s._LEGACY_ENV.get(field, ())]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text exactly as ``--help`` prints it ({default} filled in)."""
    formatter = parser._get_formatter()
    text = formatter._get_help_string(action)  # type: ignore[attr-defined]
    params = {"default": action.default, "prog": parser.prog, "dest": action.dest}
    try:
        return text % params
    except (KeyError, TypeError, ValueError):
        return text


def default_of(command: str, action: argparse.Action) -> str:
    if command == "serve":
        field = serve_field(action.dest)
        if field is not None:
            from kvevents.service.settings import field_default

            value = field_default(field)
            return "none" if value in (None, (), "") else str(value)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if not action.default else "on"
    if action.default in (None, argparse.SUPPRESS):
        return "none"
    return str(action.default)


def flag_rows(command: str, parser: argparse.ArgumentParser, select: str | None = None,
              headings: bool = True, compact: bool = False) -> list[str]:
    """One Markdown table per argument group, one row per option. ``select``: only the
    group of that title, or only the flags starting with it (``--route-``); ``compact``:
    flag, default and help only (a page's table; the reference has every column)."""
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if select is not None and select.startswith("--"):
            actions = [a for a in actions if a.option_strings[-1].startswith(select)]
        elif select is not None and group.title != select:
            actions = []
        if not actions:
            continue
        title = group.title or "options"
        if headings:
            out.append(f"**{title[0].upper() + title[1:]}**"
                       + (f": {group.description}" if group.description else ""))
            out.append("")
        if command == "serve" and not compact:
            out.append("| flag | default | environment variable | config key | |")
            out.append("|---|---|---|---|---|")
        else:
            out.append("| flag | default | |")
            out.append("|---|---|---|")
        for a in actions:
            flags = ", ".join(a.option_strings)
            if a.nargs != 0 and not isinstance(a, argparse._VersionAction):
                flags += " " + (a.metavar or a.dest.upper())
            helptext = option_help(parser, a)
            if a.choices and not isinstance(a.choices, dict):
                helptext += " (one of: " + ", ".join(map(str, a.choices)) + ")"
            row = [code(flags), code(default_of(command, a))]
            if command == "serve" and not compact:
                field = serve_field(a.dest)
                if field is not None:
                    row += ["<br>".join(code(e) for e in env_names(field)), code(field)]
                elif a.dest == "config":
                    row += [code("KVEVENTS_CONFIG"), ""]
                else:
                    row += ["", ""]
            row.append(cell(helptext))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return out


def flag_table(command: str, select: str) -> str:
    """The reference's rows for some flags of ``kvevents COMMAND``, for a hand-written
    page (docs/hooks.py replaces ``<!-- kvevents-flags: COMMAND SELECT -->`` with it)."""
    from kvevents.cli.main import build_parser

    parser = subcommands(build_parser())[command]
    rows = flag_rows(command, parser, select, headings=False, compact=True)
    if not any(line.startswith("| `") for line in rows):
        raise ValueError(f"kvevents-flags: no flag of kvevents {command} matches {select!r}")
    return "\n".join(rows)


def cli_page() -> str:
    from kvevents.cli.main import build_parser

    parser = build_parser()
    lines = [
        "# Command-line reference",
        "",
        "Generated from the `kvevents` command's own argument parsers at every build of",
        "this site: every command, flag and default here is what `kvevents COMMAND --help`",
        "prints. For `kvevents serve`, every flag is also a setting: the environment",
        "variable and the config-file key set the same value, with the precedence",
        "flag > environment > config file > default; settings with no flag are on the",
        "[settings reference](settings.md).",
        "",
        "## kvevents",
        "",
        "```",
        parser.format_usage().strip(),
        "```",
        "",
        cell(parser.description or ""),
        "",
        *flag_rows("kvevents", parser),
    ]
    for name, sub in subcommands(parser).items():
        lines += [f"## kvevents {name}", "", "```", sub.format_usage().strip(), "```", ""]
        if sub.description:
            lines += [" ".join(sub.description.split()), ""]
        lines += flag_rows(name, sub)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- settings

def settings_page() -> str:
    import dataclasses

    from kvevents.cli.main import build_parser
    from kvevents.engines import EngineSpec
    from kvevents.service.settings import AggregatorSettings, field_default

    serve = subcommands(build_parser())["serve"]
    flags: dict[str, list[str]] = {}
    for a in serve._actions:
        field = serve_field(a.dest) if a.option_strings else None
        if field is not None:
            flags.setdefault(field, []).append(a.option_strings[-1])
    lines = [
        "# Settings reference",
        "",
        "Every setting of `kvevents serve`, generated from `AggregatorSettings` at every",
        "build of this site. Each comes, in this order of precedence, from its flag (where",
        "it has one), its environment variable, the config file (`--config FILE` or",
        "`KVEVENTS_CONFIG`: JSON, or TOML when the name ends in `.toml`; unknown keys are",
        "errors), or its default. Older names still accepted are listed after the current",
        "one.",
        "",
        "| config key | environment variable | flag | default | bounds | |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in AggregatorSettings.model_fields.items():
        bounds = []
        for m in f.metadata:
            for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                               ("min_length", "length >=")):
                value = getattr(m, attr, None)
                if value is not None:
                    bounds.append(f"{sign} {value}")
        keys = [name]
        va = f.validation_alias
        if va is not None and hasattr(va, "choices"):
            keys += [str(c) for c in va.choices if str(c) != name]
        default = field_default(name)
        lines.append("| " + " | ".join([
            "<br>".join(code(k) for k in keys),
            "<br>".join(code(e) for e in env_names(name)),
            "<br>".join(code(x) for x in flags.get(name, [])),
            code("none" if default in (None, (), "") else default),
            cell(", ".join(bounds)),
            cell(f.description or ""),
        ]) + " |")
    lines += [
        "",
        "## An engine",
        "",
        "An entry of `engines` (a TOML `[[engines]]` table, a JSON object, the body of",
        "`POST /v1/engines`), or the same as `NAME=ENDPOINT[,replay=E][,model=M][,topic=T]"
        "[,bind=1][,http=URL]` on the command line (`--endpoint`) and in `KVEVENTS_ENGINES`",
        "(`;`-separated). Generated from `EngineSpec`:",
        "",
        "| key | default | on the command line |",
        "|---|---|---|",
    ]
    short = {"replay_endpoint": "replay=", "model": "model=", "topic": "topic=",
             "bind": "bind=1", "http": "http=", "name": "NAME=", "endpoint": "=ENDPOINT"}
    for fld in dataclasses.fields(EngineSpec):
        if fld.default is dataclasses.MISSING:
            default = "required"
        else:
            default = "none" if fld.default in (None, "") else str(fld.default)
        lines.append(f"| {code(fld.name)} | {code(default)} | {code(short.get(fld.name, ''))} |")
    lines += ["", "[EngineSpec in the Python API](python.md#kvevents.engines.EngineSpec).", ""]
    return "\n".join(lines) + "\n"
