"""Errors meant for people: one line that names the problem and the fix.

Entry points catch `UserError`, print its message and exit non-zero, without a traceback.
"""

import importlib.util


class UserError(Exception):
    """A problem with the user's input (recipe, files, flags), not a bug in the code."""


def require_package(module: str, extra: str, purpose: str) -> None:
    """Refuse, before any work, what needs an optional package that is not installed (bash ci/bootstrap.sh
    installs the product alone), naming the extra that brings it."""
    if importlib.util.find_spec(module) is None:
        raise UserError(
            f"{purpose} needs the '{module}' package, which is not installed: pip install -e '.[{extra}]' "
            "(or bash ci/bootstrap.sh --test, which installs every extra)"
        )
