"""``OPGATE_*`` environment variables: every ``serve`` flag's twin, read as its default.

``--redis-url`` ↔ ``OPGATE_REDIS_URL``: :func:`add_flag` declares a flag whose default is its
variable's value, so a flag on the command line wins over the environment, and a bad value is
reported naming the variable, only when the ``serve`` command is parsed (never for ``check`` or
``--help``). ``--help`` shows each flag's variable (:class:`EnvDefaults`); a variable opgate
does not read (a misspelt ``OPGATE_WORKER``) is warned about (:func:`unknown_variables`).
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["OTHER_VARIABLES", "EnvDefaults", "add_flag", "unknown_variables", "variable"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
# OPGATE_* variables read elsewhere than from serve's flags: the Redis password (proxy.stores),
# the test harness's (proxy.envtest, tests/) and the benchmarks' (bench/interpreter.py)
OTHER_VARIABLES = frozenset({
    "OPGATE_REDIS_PASSWORD", "OPGATE_CACHE_DIR", "OPGATE_KEEP_CLUSTER_DIR", "OPGATE_KUBECTL",
    "OPGATE_HELM", "OPGATE_E2E_SERVE_CMD", "OPGATE_TEST_REDIS_SERVER", "OPGATE_BENCH_PYTHON"})


def variable(flag: str) -> str:
    """The ``OPGATE_*`` variable of a flag: ``--redis-url`` ↔ ``OPGATE_REDIS_URL``."""
    return "OPGATE_" + flag.lstrip("-").upper().replace("-", "_")


def _long_flags(action: argparse.Action) -> list[str]:
    """An action's ``--`` flags but ``--help``: those that have a variable."""
    return [o for o in action.option_strings if o.startswith("--") and o != "--help"]


def _env(flag: str) -> str | None:
    return os.environ.get(variable(flag))


class _FromEnv(str):
    """A flag's default taken from its ``OPGATE_*`` variable: argparse converts it with the
    flag's type only when the ``serve`` command is parsed (never for ``check`` or ``--help``),
    and an error names the variable."""

    var: str

    def __new__(cls, value: str, var: str) -> _FromEnv:
        self = super().__new__(cls, value)
        self.var = var
        return self


def _env_aware(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """``kind``, but a bad value from the environment is reported as the variable's."""

    def convert(text: str) -> Any:
        try:
            return kind(text)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            if not isinstance(text, _FromEnv):
                raise
            detail = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else (
                f"not a valid {getattr(kind, '__name__', 'value')}")
            shown = getattr(kind, "redact", str)(str(text))  # --redis-url: no password
            raise argparse.ArgumentTypeError(
                f"environment variable {text.var}={shown!r}: {detail}") from None

    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


class EnvDefaults(argparse.HelpFormatter):
    """Shows each flag's environment variable in ``--help``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        long_flags = _long_flags(action)
        if long_flags:
            text += f" [env {variable(long_flags[0])}]"
            if action.default not in (None, False, argparse.SUPPRESS):
                text += " (default: %(default)s)"
        return text


def add_flag(
    parser: argparse._ActionsContainer, flag: str, *, help: str, default: object = None,
    kind: Callable[[str], Any] = str, metavar: str | None = None,
) -> None:
    """Declare ``flag`` with its ``OPGATE_*`` variable's value as its default: converted by
    ``kind`` only when the ``serve`` command is parsed, a bad one named as the variable's."""
    env = _env(flag)
    if kind is bool:
        if env is not None and env.strip().lower() not in _TRUE | _FALSE:
            # reported by main() only when the serve command is parsed (a subparser's defaults)
            problems = parser.get_default("env_problems") or []
            parser.set_defaults(env_problems=[
                *problems, f"argument {flag}: environment variable {variable(flag)}={env!r}: "
                "expected one of 1, true, yes, on, 0, false, no, off"])
        on = env.strip().lower() in _TRUE if env is not None else bool(default)
        parser.add_argument(flag, action="store_true", default=on, help=help)
        return
    # a string default (the flag's own or the variable's) is converted by argparse, which
    # reports a bad one as a usage error; only when the serve command is parsed
    value = _FromEnv(env, variable(flag)) if env is not None else default
    parser.add_argument(flag, type=_env_aware(kind), default=value, help=help, metavar=metavar)


def unknown_variables(serve: argparse.ArgumentParser,
                      environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``OPGATE_*`` variable in ``environ`` that opgate does not read (those
    of ``serve``'s flags and :data:`OTHER_VARIABLES`), naming the closest one it does (a misspelt
    ``OPGATE_WORKER=4`` was ignored without a word, where a misspelt flag is an error)."""
    known = OTHER_VARIABLES | {
        variable(option) for action in serve._actions for option in _long_flags(action)}
    prefix = len("OPGATE_")  # compared without it, which every name shares
    tails = {name[prefix:]: name for name in known}
    warnings = []
    for name in sorted(n for n in environ if n.startswith("OPGATE_") and n not in known):
        close = difflib.get_close_matches(name[prefix:], tails, n=1)
        hint = f"did you mean {tails[close[0]]}?" if close else "see opgate serve --help"
        warnings.append(
            f"environment variable {name} is not one opgate reads, ignored ({hint})")
    return warnings
