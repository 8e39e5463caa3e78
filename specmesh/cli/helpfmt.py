"""How every command's ``--help`` reads (issue 62): each option's default shown as its
value (``(default: 128)``; none where the help already says what the default is, or
where there is none to show: unset, a switch, a suppressed one), and its value named
after its flag (``--max-new-tokens-limit MAX_NEW_TOKENS_LIMIT``, not argparse's name
of the destination). ``Parser`` is the class of every ``specmesh`` subcommand's parser
(``add_subparsers(parser_class=Parser)``): it gives them ``Formatter`` whatever
formatter their module asked for. A formatter may name a ``defaults`` function: the
defaults of options whose default lives elsewhere (``serve``'s settings flags default to
``argparse.SUPPRESS`` so the settings' own layering applies; their values are looked up
only when the help is printed).

Standard library only: importing it costs nothing.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Callable, Optional


def show(value: Any) -> str:
    """A default as a user types it: ``true``, ``0.5``, ``a,b``, ``''`` for an empty string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(show(v) for v in value) if value else "''"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if value == "":
        return "''"
    return str(value)


class Formatter(argparse.HelpFormatter):
    """Defaults as values, value names from flags (see the module docstring)."""

    # for options that default to SUPPRESS: the text in parentheses after their help ("default: 8; ..."), or None
    defaults: Optional[Callable[[argparse.Action], Optional[str]]] = None

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        longest = max(action.option_strings, key=len)
        return longest.lstrip("-").upper().replace("-", "_")

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings:  # no help text: its default is still worth a line
            text = self._get_help_string(action)
            if text:
                action = copy.copy(action)
                action.help = text
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.help is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is argparse.SUPPRESS:  # looked up elsewhere: always shown
            extra = type(self).defaults(action) if type(self).defaults is not None else None
            return f"{text} ({extra})" if extra else text
        if "default" in text.lower():  # the help says it in words
            return text
        elif action.default is None or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                                           argparse._StoreConstAction, argparse._HelpAction,
                                                           argparse._AppendAction, argparse._CountAction,
                                                           argparse._VersionAction)):
            shown = None
        else:
            shown = show(action.default).replace("%", "%%")
        if shown is None:
            return text
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class Parser(argparse.ArgumentParser):
    """A subcommand's parser: always ``Formatter`` (or a subclass the module gives)."""

    def __init__(self, *args, **kw):
        fc = kw.get("formatter_class")
        if fc is None or not (isinstance(fc, type) and issubclass(fc, Formatter)):
            kw["formatter_class"] = Formatter
        super().__init__(*args, **kw)
