"""User-facing errors: bad recipe, data or arguments exit with code 2 and one clear paragraph."""

from __future__ import annotations

import functools
import sys

EXIT_BAD_INPUT = 2


class UserError(Exception):
    """A problem the user can fix (recipe, data, arguments). Printed without a traceback, exit 2."""


class RecipeError(UserError):
    pass


class DataError(UserError):
    pass


class TrainingAborted(RuntimeError):
    """A runtime failure after which the last good checkpoint is kept (exit code 3): a non-finite loss
    under train.on_nonfinite=stop, or storage that fails during a save (a full disk, a read-only or
    vanished output_dir)."""


EXIT_ABORTED = 3


def cli(main):
    """Decorate a CLI entry point: UserError -> message on stderr + exit code 2, no traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_BAD_INPUT)

    return wrapper
