"""Turning benchmark cells into a markdown table, a JSON file and plots.

Ratios are paired: for each repeat, a configuration's examples/sec is
divided by `single`'s (or the faster `mirrored-N` variant's) from the same
repeat, and the median over repeats is reported, so that a slow stretch of
the shared machine slows both sides of a ratio.
"""

import datetime
import json
import statistics

from benchmarks.models import MODELS


def markdown(cells, configs, command, machine):
  lines = [
      "# Benchmark results", "",
      "Command: `{}`  ".format(command),
      "Machine: {}  ".format(machine),
      "Date: {}".format(datetime.date.today().isoformat()), "",
      "examples/sec after warm-up: median (min-max) over repeats. x single, "
      "x ps and x mirrored: medians of ratios paired within a repeat (x ps: "
      "against replicate-N-ps, same N; x mirrored: against the faster of "
      "mirrored-N-default and mirrored-N-r1d, same N). "
      "build: seconds from train() to the built graph. cpu/wall: process CPU "
      "seconds per wall second while timed.", ""
  ]
  for model, by_config in cells.items():
    spec = MODELS[model]
    lines += [
        "## {}: {}, global batch {}".format(model, spec.description,
                                            spec.global_batch), "",
        "| config | examples/sec | x single | x ps | x mirrored | build s "
        "| step ms | cpu/wall |", "|---|---|---|---|---|---|---|---|"
    ]
    for config in configs:
      runs = by_config[config.name]
      rates = [c.examples_per_second for c in runs]
      lines.append(
          "| {} | {:,.0f} ({:,.0f}-{:,.0f}) | {} | {} | {} | {:.2f} | {:.2f} "
          "| {:.2f} |".format(
              config.name, statistics.median(rates), min(rates), max(rates),
              _ratio(runs, by_config.get("single")),
              _ratio(runs, _parameter_server(by_config, config)),
              _ratio(runs, _best_mirrored(by_config, config)),
              statistics.median(c.build_seconds for c in runs),
              1000 * statistics.median(c.step_seconds for c in runs),
              statistics.median(c.cpu_per_wall for c in runs)))
    lines.append("")
  return "\n".join(lines)


def write_json(path, cells, command, machine):
  with open(path, "w") as output:
    json.dump({
        "command": command,
        "machine": machine,
        "date": datetime.date.today().isoformat(),
        "cells": {
            model: {name: [c._asdict() for c in runs]
                    for name, runs in by_config.items()}
            for model, by_config in cells.items()
        },
    }, output, indent=1)


_COLORS = {"replicate-ps": "tab:green", "replicate-rr": "tab:red",
           "replicate-gather": "tab:purple", "replicate-ring": "tab:brown",
           "replicate-handring": "tab:olive",
           "replicate-nccl": "tab:pink", "mirrored-default": "tab:blue",
           "mirrored-r1d": "tab:orange"}
_METRICS = {  # name: (label, value of a cell)
    "examples/sec": ("examples/sec", lambda c: c.examples_per_second),
    "build": ("graph build, seconds", lambda c: c.build_seconds),
    "step": ("step time, ms", lambda c: 1000 * c.step_seconds),
}


def plot(rates_path, scaling_path, cells, configs):
  """examples/sec against N (a panel per model); build and step time vs N."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel

  for path, metrics in ((rates_path, ["examples/sec"]),
                        (scaling_path, ["build", "step"])):
    figure, axes = pyplot.subplots(
        len(metrics), len(cells), figsize=(4.2 * len(cells),
                                           3.4 * len(metrics)), squeeze=False)
    for row, metric in enumerate(metrics):
      for axis, (model, by_config) in zip(axes[row], cells.items()):
        _panel(axis, by_config, configs, metric)
        axis.set_title("{}: {}".format(model, _METRICS[metric][0]),
                       fontsize=9)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def _panel(axis, by_config, configs, metric):
  """One line per configuration family against N, `single` as a line."""
  value = _METRICS[metric][1]
  for family, color in _COLORS.items():
    points = sorted((c.towers, statistics.median(
        value(r) for r in by_config[c.name])) for c in configs
                    if _family(c) == family)
    if points:
      axis.plot(*zip(*points), marker="o", color=color, label=family)
  if "single" in by_config:
    axis.axhline(statistics.median(value(r) for r in by_config["single"]),
                 color="black", linestyle="--", label="single")
  axis.set_xticks(sorted({c.towers for c in configs}))
  axis.set_xlabel("towers (N)")
  axis.set_ylim(bottom=0)


def _family(config):
  """replicate-ps, mirrored-r1d, ...: a configuration without its N."""
  return config.kind if config.kind == "single" else "{}-{}".format(
      config.kind, config.variant)


def _parameter_server(by_config, config):
  """replicate-N-ps's runs, for another replicate configuration with N > 1."""
  if (config.kind != "replicate" or config.towers < 2 or
      config.variant == "ps"):
    return None
  return by_config.get("replicate-{}-ps".format(config.towers))


def _best_mirrored(by_config, config):
  """Per repeat, the faster mirrored variant with the same N (or None)."""
  if config.kind != "replicate" or config.towers < 2:
    return None
  variants = [by_config.get("mirrored-{}-{}".format(config.towers, v))
              for v in ("default", "r1d")]
  variants = [runs for runs in variants if runs]
  if not variants:
    return None
  return [max(runs, key=lambda c: c.examples_per_second)
          for runs in zip(*variants)]


def _ratio(runs, reference):
  if not reference:
    return "-"
  return "{:.2f}".format(statistics.median(
      a.examples_per_second / b.examples_per_second
      for a, b in zip(runs, reference)))
