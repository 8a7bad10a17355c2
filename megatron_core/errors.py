"""Errors meant for people: one line that names the problem and the fix.

Entry points catch `UserError`, print its message and exit non-zero, without a traceback.
"""


class UserError(Exception):
    """A problem with the user's input (recipe, files, flags), not a bug in the code."""
