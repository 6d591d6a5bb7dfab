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
      "examples/sec after warm-up: median (min-max) over repeats. x single "
      "and x mirrored: medians of ratios paired within a repeat (x mirrored: "
      "against the faster of mirrored-N-default and mirrored-N-r1d, same N). "
      "build: seconds from train() to the built graph. cpu/wall: process CPU "
      "seconds per wall second while timed.", ""
  ]
  for model, by_config in cells.items():
    spec = MODELS[model]
    lines += [
        "## {}: {}, global batch {}".format(model, spec.description,
                                            spec.global_batch), "",
        "| config | examples/sec | x single | x mirrored | build s | step ms "
        "| cpu/wall |", "|---|---|---|---|---|---|---|"
    ]
    for config in configs:
      runs = by_config[config.name]
      rates = [c.examples_per_second for c in runs]
      lines.append(
          "| {} | {:,.0f} ({:,.0f}-{:,.0f}) | {} | {} | {:.2f} | {:.2f} | "
          "{:.2f} |".format(
              config.name, statistics.median(rates), min(rates), max(rates),
              _ratio(runs, by_config.get("single")),
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


def plot(rates_path, scaling_path, cells, configs):
  """examples/sec against N (a panel per model); build and step time vs N."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel

  families = sorted({_family(c) for c in configs if c.kind != "single"})
  figure, axes = pyplot.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.8),
                                 squeeze=False)
  for axis, (model, by_config) in zip(axes[0], cells.items()):
    for family in families:
      points = sorted(
          (c.towers, statistics.median(r.examples_per_second
                                       for r in by_config[c.name]))
          for c in configs if _family(c) == family)
      axis.plot(*zip(*points), marker="o", label=family)
    if "single" in by_config:
      axis.axhline(statistics.median(
          r.examples_per_second for r in by_config["single"]), color="black",
                   linestyle="--", label="single")
    axis.set_title(model)
    axis.set_xticks(sorted({c.towers for c in configs}))
    axis.set_xlabel("towers (N)")
    axis.set_ylabel("examples/sec")
    axis.set_ylim(bottom=0)
  axes[0][0].legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(rates_path, dpi=110)
  pyplot.close(figure)

  figure, (build_axis, step_axis) = pyplot.subplots(1, 2, figsize=(10, 3.8))
  for model, by_config in cells.items():
    for family in families:
      if not family.startswith(("replicate", "mirrored")):
        continue
      points = sorted((c.towers, by_config[c.name]) for c in configs
                      if _family(c) == family)
      towers = [n for n, _ in points]
      style = "-" if family.startswith("replicate") else ":"
      build_axis.plot(towers, [statistics.median(r.build_seconds for r in runs)
                               for _, runs in points], style, marker="o",
                      label="{} {}".format(model, family))
      step_axis.plot(towers, [1000 * statistics.median(
          r.step_seconds for r in runs) for _, runs in points], style,
                     marker="o", label="{} {}".format(model, family))
  build_axis.set_title("graph build time")
  build_axis.set_ylabel("seconds")
  step_axis.set_title("step time")
  step_axis.set_ylabel("ms")
  for axis in (build_axis, step_axis):
    axis.set_xticks(sorted({c.towers for c in configs}))
    axis.set_xlabel("towers (N)")
  step_axis.legend(fontsize=6, ncol=2)
  figure.tight_layout()
  figure.savefig(scaling_path, dpi=110)
  pyplot.close(figure)


def _family(config):
  """replicate-ps, mirrored-r1d, ...: a configuration without its N."""
  return config.kind if config.kind == "single" else "{}-{}".format(
      config.kind, config.variant)


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
