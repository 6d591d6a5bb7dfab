"""What the benchmarks' command lines share: argument types and help.

A bad value is a usage error that names its flag (exit code 2):

    python -m benchmarks.split_cost: error: argument --rounds: must be a
    whole number of at least 1; received 'two'

because each type below raises `argparse.ArgumentTypeError`, which argparse
reports with the flag (a plain `ValueError` is reported with the type
function's name instead). `parser()` makes an `ArgumentParser` whose help
shows every option's default.
"""

import argparse
from typing import Callable, Iterable, List, Optional, TypeVar

T = TypeVar("T")

# `comma_list(..., twice=ONCE)`: the fix for a value named twice.
ONCE = "give each once"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends `(default: ...)` to an option's help, unless it says already.

  Help that depends on another flag (`--quick`) or has no default value
  says its default in its own words, with the word "default".
  """

  def _get_help_string(self, action):
    text = action.help or ""
    if ("default" in text or action.nargs == 0 or
        action.default in (None, argparse.SUPPRESS)):
      return text
    return text + " (default: %(default)s)"


def parser(prog: str, description: str) -> argparse.ArgumentParser:
  """An ArgumentParser with `HelpFormatter`."""
  return argparse.ArgumentParser(prog=prog, description=description,
                                 formatter_class=HelpFormatter)


def whole_number(minimum: int = 1) -> Callable[[str], int]:
  """An argparse type: a whole number of at least `minimum`."""

  def parse(text):
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < minimum:
      raise argparse.ArgumentTypeError(
          "must be a whole number of at least {}; received {!r}".format(
              minimum, text))
    return value

  return parse


def positive_number(text: str) -> float:
  """An argparse type: a number above 0 (seconds, say)."""
  try:
    value = float(text)
  except ValueError:
    value = None
  if value is None or not value > 0 or value == float("inf"):
    raise argparse.ArgumentTypeError(
        "must be a number above 0; received {!r}".format(text))
  return value


def one_of(choices: Iterable[str]) -> Callable[[str], str]:
  """An argparse item type: one of `choices`, or an error listing them."""
  choices = list(choices)

  def parse(text):
    if text not in choices:
      raise argparse.ArgumentTypeError("unknown {!r}; choose from {}".format(
          text, ", ".join(choices)))
    return text

  return parse


def checked(check: Callable[[str], object]) -> Callable[[str], str]:
  """An argparse item type: the text itself, once `check(text)` passed.

  `check` raises `ValueError` with the reason (`configs.check_model`).
  """

  def parse(text):
    check(text)
    return text

  return parse


def comma_list(item: Callable[[str], T],
               twice: Optional[str] = None) -> Callable[[str], List[T]]:
  """An argparse type: comma-separated values, each read by `item`.

  `item` may raise `argparse.ArgumentTypeError` or `ValueError`; either's
  message becomes the usage error. `twice`: if given, a value named twice
  is an error, and `twice` is its fix.
  """

  def parse(text):
    names = [name for name in text.split(",") if name]
    if not names:
      raise argparse.ArgumentTypeError(
          "must list at least one value, comma-separated; received "
          "{!r}".format(text))
    if twice and len(set(names)) != len(names):
      raise argparse.ArgumentTypeError("names {!r} twice; {}".format(
          next(name for name in names if names.count(name) > 1), twice))
    try:
      return [item(name) for name in names]
    except ValueError as error:  # ArgumentTypeError is not a ValueError
      raise argparse.ArgumentTypeError(str(error)) from None

  return parse
