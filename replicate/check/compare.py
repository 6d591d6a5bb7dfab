"""Comparing values: N towers' with one device's, to a stated tolerance.

The comparison the project's oracle (tests/oracle) and `replicate.check`
share, so that the project's evidence and a user's come from one place.

On "equal": numbers are equal when |actual - expected| <= atol + rtol *
|expected| everywhere (NaN equals NaN, any other NaN or an infinity that
is not matched differs); any other value (strings, bytes) must be
identical; a different shape always differs.
"""

from typing import Dict, List, Tuple

import numpy as np

RTOL = 1e-5
ATOL = 1e-6


def difference(expected, actual, rtol: float = RTOL,
               atol: float = ATOL) -> Tuple[float, str]:
  """(how far off, a description): how far off is 0 when equal, the
  largest absolute difference otherwise (inf for a shape or a non-number)."""
  expected, actual = np.asarray(expected), np.asarray(actual)
  if expected.shape != actual.shape:
    return float("inf"), "shape {} instead of {}".format(actual.shape,
                                                         expected.shape)
  if expected.dtype.kind in "biufc" and actual.dtype.kind in "biufc":
    expected = expected.astype(np.float64)
    actual = actual.astype(np.float64)
    both_nan = np.isnan(expected) & np.isnan(actual)
    gap = np.where(both_nan, 0.0, np.abs(actual - expected))
    gap = np.where(np.isnan(gap), np.inf, gap)
    excess = gap - (atol + rtol * np.abs(expected))
    if expected.size == 0 or not (excess > 0).any():
      return 0, ""
    # The entry furthest past its own tolerance: a large entry's larger
    # gap may be within its tolerance while a small entry's is not.
    worst = int(np.argmax(excess / (atol + rtol * np.abs(expected))))
    return float(gap.flat[worst]), (
        "off by {:.3g} (expected {:.6g}, got {:.6g}{})".format(
            gap.flat[worst], expected.flat[worst], actual.flat[worst],
            "" if expected.size == 1 else " at index {}".format(
                tuple(int(i) for i in np.unravel_index(worst,
                                                       expected.shape)))))
  if np.array_equal(expected.astype(str), actual.astype(str)):
    return 0, ""
  return float("inf"), "expected {}, got {}".format(
      expected.ravel()[:4].tolist(), actual.ravel()[:4].tolist())


def differing(expected: Dict, actual: Dict, rtol: float = RTOL,
              atol: float = ATOL) -> Tuple[List[Tuple[float, str, str]],
                                           List[str], List[str]]:
  """Compares two {name: value} dicts.

  Returns:
    (the names that differ as (how far off, description, name), worst
    first; the names missing from `actual`; those `actual` has besides).
  """
  common = sorted(set(expected) & set(actual))
  off = sorted((difference(expected[name], actual[name], rtol, atol) +
                (name,) for name in common), reverse=True)
  return ([entry for entry in off if entry[0] > 0],
          sorted(set(expected) - set(actual)),
          sorted(set(actual) - set(expected)))


def summary(value, limit: int = 6) -> str:
  """A short text of a value: a number, or a shape and its first numbers."""
  value = np.asarray(value)
  if value.size == 1:
    item = value.ravel()[0]
    return "{:.6g}".format(item) if value.dtype.kind in "biuf" else repr(item)
  flat = value.ravel()[:limit].tolist()
  text = ", ".join("{:.4g}".format(x) if isinstance(x, float) else repr(x)
                   for x in flat)
  return "shape {} [{}{}]".format(list(value.shape), text,
                                  ", ..." if value.size > limit else "")
