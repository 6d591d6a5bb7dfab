"""What `replicate.check` found: a `Report` of `Difference`s, as a table.

On reading it: each run (a tower count and a variable strategy) is
compared with the unwrapped `model_fn` on one device, started from the
same state on the same batches. A run is exact when every compared value
is within the tolerance; otherwise each value that differs is listed,
with the first op, in graph order, whose value in a tower is not one
device's (its rows for that tower, or the whole value for a value over
the batch), and the user's source line that created it. A run refused
when it was built shows the refusal's message, which carries the fix.
"""

import dataclasses
import json
from typing import Dict, List, Optional


@dataclasses.dataclass
class FirstOp:
  """The first op whose value in a tower is not one device's."""
  name: str
  type: str
  source: str  # "file:line in function: code", the user's frame
  tower: int
  one_device: str  # its value (rows for the tower, or whole), summarized
  in_tower: str
  declared: bool = False  # declared by replicate.rows_apart
  note: str = ""

  def lines(self) -> List[str]:
    if not self.one_device and not self.in_tower:  # refused, or failed
      return ["{}: {}".format(
          "op {!r} ({})".format(self.name, self.type) if self.name else
          "raised", self.note),
              "  created at " + (self.source or "(no source line)")]
    head = "first op that differs: {!r} ({}) in tower {}{}".format(
        self.name, self.type, self.tower,
        ", declared with replicate.rows_apart: the declaration does not "
        "hold" if self.declared else "")
    found = [head, "  created at " + (self.source or "(no source line)"),
             "  one device: " + self.one_device,
             "  tower {}:    ".format(self.tower) + self.in_tower]
    if self.note:
      found.append("  " + self.note)
    return found


@dataclasses.dataclass
class Difference:
  """One value that differs in one run, or the run's refusal."""
  run: str  # e.g. "2 towers, parameter_server"
  what: str  # "variable dense/kernel", "loss step 1", "metric accuracy",
  # "prediction probabilities", "refused (train)"
  one_device: str = ""
  replicated: str = ""
  detail: str = ""
  message: str = ""  # a refusal's message (with its fix)
  first_op: Optional[FirstOp] = None

  def lines(self) -> List[str]:
    if self.message:
      found = ["{}: {}".format(self.run, self.what), "  " + self.message]
    else:
      found = ["{}: {} differs: {}".format(self.run, self.what, self.detail),
               "  one device: " + self.one_device,
               "  replicated: " + self.replicated]
    if self.first_op is not None:
      found.extend("  " + line for line in self.first_op.lines())
    return found


@dataclasses.dataclass
class Report:
  """`exact`: every run equals one device; `differences`: what does not."""
  runs: List[str]
  modes: List[str]
  steps: int
  rows: List[int]  # each batch's rows
  rtol: float
  atol: float
  compared: Dict[str, int]  # run -> how many values were compared
  differences: List[Difference] = dataclasses.field(default_factory=list)
  random_ops: List[str] = dataclasses.field(default_factory=list)
  notes: List[str] = dataclasses.field(default_factory=list)
  seconds: Dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def exact(self) -> bool:
    return not self.differences

  def run_result(self, run: str) -> str:
    found = [d for d in self.differences if d.run == run]
    if not found:
      return "exact"
    if any(d.what.startswith("refused") for d in found):
      return "refused"
    if any(d.message for d in found):
      return "failed"
    return "{} differ".format(len(found))

  def __str__(self) -> str:
    lines = [
        "replicate.check: {} ({} step{} of {} rows), each run against the "
        "unwrapped model_fn on one device, from one initial state".format(
            ", ".join(self.modes), self.steps, "" if self.steps == 1 else "s",
            "+".join(str(r) for r in self.rows) or "0"),
        "tolerance: |replicated - one device| <= {:g} + {:g} * |one device|"
        .format(self.atol, self.rtol)]
    if self.random_ops:
      lines.append("random ops: each tower was fed the one-device draw's rows "
                   "for its shard: " + ", ".join(self.random_ops[:6]) +
                   (", ..." if len(self.random_ops) > 6 else ""))
    width = max([len(run) for run in self.runs] + [3])
    lines.append("")
    lines.append("{:<{w}}  {:>8}  {}".format("run", "values", "result",
                                             w=width))
    for run in self.runs:
      lines.append("{:<{w}}  {:>8}  {}".format(
          run, self.compared.get(run, 0), self.run_result(run), w=width))
    for run in self.runs:
      lines.extend(self._run_lines(run))
    lines.extend([""] + self.notes if self.notes else [])
    if self.seconds.get("runs compared"):
      lines.append("time: {:.1f} s in all, {:.1f} s of it the runs compared "
                   "({:.1f}x)".format(
                       self.seconds["total"], self.seconds["runs compared"],
                       self.seconds["total"] / self.seconds["runs compared"]))
    lines.append("")
    lines.append("EXACT: every run equals one device." if self.exact else
                 "NOT EXACT: {} difference{} (above).".format(
                     len(self.differences),
                     "" if len(self.differences) == 1 else "s"))
    return "\n".join(lines)

  def _run_lines(self, run: str, shown: int = 6) -> List[str]:
    """A run's differences: those with their first op in full, then one
    line each, up to `shown`, then a count of the rest."""
    found = [d for d in self.differences if d.run == run]
    full = [d for d in found if d.first_op is not None or d.message]
    brief = [d for d in found if d not in full]
    lines = []
    for difference in full:
      lines.append("")
      lines.extend(difference.lines())
    if brief:
      lines.append("")
      lines.append("{}: also differ:".format(run))
      lines.extend("  {}: {}".format(d.what, d.detail)
                   for d in brief[:shown])
      if len(brief) > shown:
        lines.append("  ... and {} more ({})".format(
            len(brief) - shown, ", ".join(d.what for d in brief[shown:])
            [:300]))
    return lines

  def to_json(self) -> str:
    found = dataclasses.asdict(self)
    found["exact"] = self.exact
    return json.dumps(found, indent=1)
