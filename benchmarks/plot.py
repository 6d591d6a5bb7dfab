"""python -m benchmarks.plot: the benchmark plots, redrawn from RESULTS.md.

Two figures, each a 2 x 2 grid with a panel per model, against the number
of towers N: `<stem>_examples_per_sec.png` (training examples/sec, and on
the right axis the same as a multiple of `single`'s) and
`<stem>_scaling.png` (step time above, graph build time below). A line per
configuration family; dashed: the static pipeline; black: `single` on one
device. A point is the median over the repeats; its error bar spans their
minimum to maximum (for `single`, a grey band), so a noisy run shows as
long bars rather than as a speed-up. RESULTS.md gives that range for
examples/sec only; a fresh run's figures have it for every column. A
configuration that failed at some N is an x on the N axis.

`python -m benchmarks.plot` redraws benchmarks/RESULTS_*.png from
benchmarks/RESULTS.md alone (its medians, machine and date), without
running anything; `python -m benchmarks` draws the same figures from its
own cells through `draw`.
"""

import math
import os
import re
import sys
import textwrap
from typing import Dict, List, NamedTuple, Tuple

from benchmarks import cli
from benchmarks import configs as configurations
from benchmarks import readme

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
# RESULTS.md's columns that are plotted, each a median.
COLUMNS = ("examples/sec", "step ms", "build s")
# family: (colour, legend label); the order is the legend's.
FAMILIES = {
    "replicate-ps": ("tab:green", "replicate-ps: parameter_server "
                     "(the default)"),
    "replicate-rr": ("tab:red", "replicate-rr: round_robin"),
    "replicate-gather": ("tab:purple", "replicate-gather: replicated, "
                         "gather"),
    "replicate-ring": ("tab:brown", "replicate-ring: replicated, "
                       "collective ring"),
    "replicate-handring": ("tab:olive", "replicate-handring: replicated, "
                           "graph-op ring"),
    "replicate-nccl": ("tab:pink", "replicate-nccl: replicated, NCCL"),
    "replicate-ps-sync": ("tab:cyan", "replicate-ps-sync: sync batch norm"),
    "replicate-rr-sync": ("tab:gray", "replicate-rr-sync: sync batch norm"),
    "mirrored-default": ("tab:blue", "mirrored-default: MirroredStrategy"),
    "mirrored-r1d": ("tab:orange", "mirrored-r1d: MirroredStrategy, "
                     "ReductionToOneDevice"),
}
SINGLE = {"single": ("-.", "single: one device, unwrapped"),
          "single-static": (":", "single-static: the same, static "
                            "pipeline")}


# The legend's caption of the error bars.
BARS = "bars: min to max over the repeats; points: medians"


class Panel(NamedTuple):
  """One model's figures: medians by configuration, and what failed."""
  title: str  # "mlp: MLP 784-1024-1024-10, global batch 256"
  medians: Dict[str, Dict[str, float]]  # {config name: {column: median}}
  failed: List[str]  # config names
  # {config name: {column: (min, max) over the repeats}}, where known
  ranges: Dict[str, Dict[str, Tuple[float, float]]]


def main(argv=None):
  args = make_parser().parse_args(argv)
  with open(args.results) as results:
    panels, subtitle = read_results(results.read())
  stem = os.path.splitext(os.path.basename(args.results))[0]
  output = args.output or os.path.dirname(os.path.abspath(args.results))
  os.makedirs(output, exist_ok=True)
  paths = [os.path.join(output, "{}_{}.png".format(stem, kind))
           for kind in ("examples_per_sec", "scaling")]
  draw(*paths, panels, subtitle)
  print("Wrote {} and {} from {} ({} models).".format(
      *paths, args.results, len(panels)))
  return 0


def make_parser():
  """The command line; a bad value is a usage error naming its flag."""
  parser = cli.parser("python -m benchmarks.plot", __doc__.splitlines()[0])
  parser.add_argument("--results", metavar="FILE",
                      default=os.path.relpath(RESULTS),
                      help="a table written by python -m benchmarks --record")
  parser.add_argument("--output", metavar="DIR", default=None,
                      help="folder for <stem>_examples_per_sec.png and "
                      "<stem>_scaling.png (default: the folder of "
                      "--results)")
  return parser


def read_results(text: str) -> Tuple[Dict[str, Panel], str]:
  """RESULTS.md's panels, by model, and the figures' subtitle.

  The tables are read by `readme.parse`; a model's title is its `##`
  heading, the subtitle says the machine, date and repeats.
  """
  tables = readme.parse(text)
  # "## wide: wide: 100,000 x 16 ..." (a description that starts with the
  # model's name) is titled "wide: 100,000 x 16 ...".
  titles = {found.group(1): found.group(1) + ": " + found.group(2)
            for found in re.finditer(r"^## (\w+): (?:\1: )?(.*?)\s*$", text,
                                     re.MULTILINE)}
  panels = {}
  for model, rows in tables.items():
    if model not in titles:
      continue  # only the A/A line of a model without a table
    medians, failed, ranges = {}, [], {}
    for name, row in rows.items():
      if name == "A/A":
        continue
      if row.get("examples/sec", "").startswith("failed"):
        failed.append(name)
        continue
      medians[name] = {column: _median(row[column]) for column in COLUMNS
                       if _median(row.get(column)) is not None}
      ranges[name] = {column: _range(row[column]) for column in COLUMNS
                      if _range(row.get(column)) is not None}
    panels[model] = Panel(titles[model], medians, failed, ranges)
  repeats = re.search(r" over (\d+) repeats", text)
  return panels, subtitle_of(
      _line(text, "Machine") or "machine not recorded",
      _line(text, "Date") or "undated",
      int(repeats.group(1)) if repeats else None)


def subtitle_of(machine: str, date: str, repeats) -> str:
  """The figures' second title line: where, when, over how many repeats."""
  return "{}; {}, {}".format(machine, date, (
      "medians over repeats" if repeats is None else
      "one repeat" if repeats == 1 else "medians of {} repeats".format(
          repeats)))


def draw(rates_path: str, scaling_path: str, panels: Dict[str, Panel],
         subtitle: str) -> None:
  """Writes both figures: examples/sec, and step and build time."""
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  for figure, path in zip(figures(panels, subtitle),
                          (rates_path, scaling_path)):
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def figures(panels: Dict[str, Panel], subtitle: str):
  """Both figures, drawn and not saved: examples/sec, step and build time."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel

  rows = max(1, math.ceil(len(panels) / 2))  # 2 x 2 for RESULTS.md's 4
  figure, axes = pyplot.subplots(rows, 2, figsize=(12, 0.6 + 4.5 * rows),
                                 layout="constrained", squeeze=False)
  for axis, panel in zip(axes.flat, panels.values()):
    _lines(axis, panel, "examples/sec")
    axis.set_title(_wrap(panel.title), fontsize=10)
    axis.yaxis.set_major_formatter(_thousands())
    axis.set_ylabel("examples/sec")
    _ratio_axis(axis, panel, "examples/sec", "x single's examples/sec")
  for axis in axes.flat[len(panels):]:
    axis.set_visible(False)
  rates = _finish(figure,
                  "Training examples/sec against towers: higher is better",
                  subtitle)

  figure = pyplot.figure(figsize=(12, 0.8 + 5.1 * rows),
                         layout="constrained")
  cells = figure.subfigures(rows, 2, squeeze=False)
  for cell, panel in zip(cells.flat, panels.values()):
    step, build = cell.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    cell.suptitle(_wrap(panel.title), fontsize=10)
    _lines(step, panel, "step ms")
    step.set_ylabel("step time, ms")
    step.set_xlabel("")
    step.tick_params(labelbottom=True)
    _ratio_axis(step, panel, "step ms", "x single's step time")
    _lines(build, panel, "build s")
    build.set_ylabel("graph build, s")
  return rates, _finish(
      figure, "Step time and graph build time against towers: lower is "
      "better", subtitle)


def _lines(axis, panel, column):
  """A line per family and pipeline; `single` as horizontal lines."""
  measured = [configurations.parse_config(name) for name in panel.medians]
  measured = [config for config in measured if not config.is_again]
  top, has_bars = 0.0, False
  for family, (color, label) in FAMILIES.items():
    for pipeline, style in (("dynamic", "-"), ("static", "--")):
      points = sorted((c.towers, panel.medians[c.name][column])
                      + _bounds(panel, c.name, column)
                      for c in measured
                      if c.family == family and c.pipeline == pipeline
                      and column in panel.medians[c.name])
      if points:
        towers, medians, lows, highs = zip(*points)
        axis.errorbar(
            towers, medians, yerr=[[m - low for m, low in zip(medians, lows)],
                                   [high - m for m, high in
                                    zip(medians, highs)]],
            capsize=3, elinewidth=1, marker="o", markersize=4, color=color,
            linestyle=style, label=label if pipeline == "dynamic"
            else family + "-static: the same, static pipeline",
            linewidth=2.6 if family == "replicate-ps" else 1.4,
            zorder=3 if family == "replicate-ps" else 2)
        top = max(top, max(highs))
        if any(high > low for low, high in zip(lows, highs)):
          has_bars = True
    failed = sorted({configurations.parse_config(name).towers
                     for name in panel.failed
                     if configurations.parse_config(name).family == family})
    if failed:
      axis.plot(failed, [0] * len(failed), linestyle="none", marker="x",
                markersize=9, markeredgewidth=2, color=color, clip_on=False,
                zorder=4, label="x on the N axis: failed at that N")
  for name, (style, label) in SINGLE.items():
    if column in panel.medians.get(name, {}):
      value = panel.medians[name][column]
      axis.axhline(value, color="black", linestyle=style, linewidth=1.2,
                   label=label)
      low, high = _bounds(panel, name, column)
      if high > low:
        axis.axhspan(low, high, color="0.5", alpha=0.15, linewidth=0,
                     label="grey band: single's min to max")
      top = max(top, high)
  if has_bars:  # the legend's caption of the bars
    axis.plot([], [], color="0.3", marker="|", markersize=12,
              markeredgewidth=1.5, linestyle="none", label=BARS)
  towers = sorted({c.towers for c in measured})
  axis.set_xscale("log", base=2)
  axis.set_xticks(towers, [str(n) for n in towers])
  axis.minorticks_off()
  axis.set_xlim(towers[0] / 1.25, towers[-1] * 1.25)
  axis.set_xlabel("towers (N)")
  if top > 0:
    axis.set_ylim(0, top * 1.15)  # headroom above the highest point
  else:  # an older RESULTS.md without this column
    axis.text(0.5, 0.5, "no {!r} column in this table".format(column),
              transform=axis.transAxes, ha="center", color="0.4")
    axis.set_yticks([])
  axis.grid(True, color="0.9")


def _ratio_axis(axis, panel, column, label):
  """A right axis: the left one as a multiple of `single`'s value."""
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  single = panel.medians.get("single", {}).get(column)
  if not single:
    return
  right = axis.secondary_yaxis(
      "right", functions=(lambda y: y / single, lambda r: r * single))
  right.yaxis.set_major_formatter(ticker.FuncFormatter(
      lambda r, _: "{:.1f}\u00d7".format(r)))
  right.set_ylabel(label.replace("x ", "\u00d7 ", 1))


def _bounds(panel, name, column):
  """(min, max) over the repeats of a point; (median, median) if unknown."""
  median = panel.medians[name][column]
  return panel.ranges.get(name, {}).get(column, (median, median))


def _finish(figure, title, subtitle):
  """One legend for the figure, below the panels; the titles."""
  handles, labels = [], []
  for axis in figure.get_axes():
    for handle, label in zip(*axis.get_legend_handles_labels()):
      if label not in labels:
        handles.append(handle)
        labels.append(label)
  order = sorted(range(len(labels)), key=lambda i: _legend_rank(labels[i]))
  figure.legend([handles[i] for i in order], [labels[i] for i in order],
                loc="outside lower center", ncol=3, fontsize=9,
                frameon=False)
  figure.suptitle("{}\n{}".format(title, subtitle), fontsize=11)
  return figure


def _legend_rank(label):
  """Families in FAMILIES' order, each one's static line after it, then
  single's lines, then the failure mark."""
  keys = list(FAMILIES) + list(SINGLE)
  if label == BARS:
    return 2 * len(keys) + 1
  for rank, key in enumerate(keys):
    if label.startswith(key + ":"):
      return 2 * rank
    if label.startswith(key + "-static:"):
      return 2 * rank + 1
  return 2 * len(keys)


def _thousands():
  """Tick labels 0, 5k, 10k, ... (and 1.5k where ticks need a decimal)."""
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  return ticker.FuncFormatter(
      lambda value, _: "0" if value == 0 else "{:,.{}f}k".format(
          value / 1000, 0 if value % 1000 == 0 else 1))


def _wrap(title):
  return "\n".join(textwrap.wrap(title, 62))


def _median(text):
  """`27,885 (27,177-28,846)` or `8.88`: the median; None for `-` or none."""
  try:
    return float(text.split(" (")[0].replace(",", ""))
  except (AttributeError, ValueError):
    return None


def _range(text):
  """`27,885 (27,177-28,846)`: (27177.0, 28846.0); None without a range."""
  found = re.search(r"\(([\d,.]+)-([\d,.]+)\)", text or "")
  if not found:
    return None
  return tuple(float(bound.replace(",", "")) for bound in found.groups())


def _line(text, name):
  found = re.search(r"^{}: (.*?)\s*$".format(name), text, re.MULTILINE)
  return found.group(1) if found else None


if __name__ == "__main__":
  sys.exit(main())
