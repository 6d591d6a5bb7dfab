"""A small deterministic pairwise (all-pairs) generator.

`pairwise(factors)` returns rows (one value per factor) such that every pair
of values of any two factors appears in at least one row. Greedy, in the
spirit of AETG: each new row starts from the first pair not yet covered (in
the factors' order), then gives every other factor the value that covers
the most uncovered pairs with the values already chosen, ties going to the
value whose pairs with them have appeared least so far (so that, once a
pair is covered, its factors keep mixing instead of falling into step),
then to the value used least, then to the first listed. No randomness: the same
factors give the same rows, in the same order, on every machine.
"""

import collections
import itertools
from typing import Dict, List, Sequence, Tuple


def pairwise(factors: Sequence[Tuple[str, Sequence]]) -> List[Dict[str, object]]:
  """Rows covering every pair of values of `factors` ((name, values) pairs)."""
  names = [name for name, _ in factors]
  values = [list(options) for _, options in factors]
  if any(not options for options in values):
    raise ValueError("every factor needs at least one value; received "
                     "{}".format(dict(factors)))
  if len(values) == 1:
    return [{names[0]: value} for value in values[0]]
  uncovered = {(i, a, j, b)
               for i, j in itertools.combinations(range(len(values)), 2)
               for a in range(len(values[i])) for b in range(len(values[j]))}
  usage = [[0] * len(options) for options in values]
  pair_counts = collections.Counter()
  rows = []
  while uncovered:
    i, a, j, b = min(uncovered)
    chosen = {i: a, j: b}
    for factor in range(len(values)):
      if factor in chosen:
        continue
      chosen[factor] = max(
          range(len(values[factor])),
          key=lambda value, factor=factor: (
              _gain(uncovered, chosen, factor, value),
              -sum(pair_counts[_pair(factor, value, other, chosen[other])]
                   for other in chosen),
              -usage[factor][value], -value))
    for factor, value in chosen.items():
      usage[factor][value] += 1
    pairs = _pairs(chosen)
    pair_counts.update(pairs)
    uncovered -= pairs
    rows.append({names[f]: values[f][chosen[f]] for f in range(len(values))})
  return rows


def uncovered_pairs(factors: Sequence[Tuple[str, Sequence]],
                    rows: Sequence[Dict[str, object]]) -> list:
  """The pairs of values that no row holds (empty for a pairwise sample)."""
  missing = []
  for (name_i, values_i), (name_j, values_j) in itertools.combinations(
      factors, 2):
    seen = {(row[name_i], row[name_j]) for row in rows}
    missing.extend(((name_i, a), (name_j, b))
                   for a in values_i for b in values_j if (a, b) not in seen)
  return missing


def _gain(uncovered, chosen, factor, value):
  return sum(_pair(factor, value, other, chosen[other]) in uncovered
             for other in chosen)


def _pair(factor, value, other, other_value):
  if factor < other:
    return (factor, value, other, other_value)
  return (other, other_value, factor, value)


def _pairs(chosen):
  return {(i, chosen[i], j, chosen[j])
          for i, j in itertools.combinations(sorted(chosen), 2)}
