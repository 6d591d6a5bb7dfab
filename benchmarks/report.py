"""Turning benchmark cells into a markdown table, a JSON file and plots.

Ratios are paired: for each repeat, a configuration's examples/sec is
divided by its reference's from the same repeat, so that a slow stretch of
the shared machine slows both sides of a ratio. A ratio is shown as the
median of those per-repeat ratios and, in parentheses, their minimum and
maximum (with 5 repeats the range is the honest spread; an interquartile
range of 5 numbers would hide the two outer ones). The A/A line gives the
same for `single-again` / `single`, with both statistics of a cell (see
`benchmarks.harness`).
"""

import datetime
import json
import statistics

from benchmarks import plot as plotting
from benchmarks.models import MODELS

AA_TWIN, AA_REFERENCE = "single-again", "single"
COLUMNS = ("config", "examples/sec", "x single", "x ps", "x mirrored",
           "x static", "build s", "step ms", "cpu/wall")


def markdown(cells, failures, configs, command, machine):
  """The whole report: a header, the A/A lines, a table per model.

  `failures[model][name]` is the error of a configuration that failed; its
  row says so and it is no reference for the others.
  """
  lines = [
      "# Benchmark results", "",
      "Command: `{}`  ".format(command),
      "Machine: {}  ".format(machine),
      "Date: {}".format(datetime.date.today().isoformat()), "",
      "examples/sec: rows per second over each cell's measured steps "
      "without their slowest tenth, median (min-max) over repeats. Ratios: "
      "median (min-max) of ratios paired within a repeat. x single: against "
      "`single` on the same pipeline. x ps: against replicate-N-ps, same N "
      "and pipeline (for a -sync configuration: the same one without "
      "-sync, per-tower batch norm). x mirrored: against the faster of "
      "mirrored-N-default and mirrored-N-r1d in that repeat, same N. x "
      "static: the dynamic "
      "pipeline (`.batch(b)`, a partial batch each epoch) against the same "
      "configuration on the static one (one fixed batch); on `single` it is "
      "the pipeline's own cost, above it what the towers add. build: "
      "seconds from train() to the built graph. step ms: median step. "
      "cpu/wall: process CPU seconds per wall second while measured.", ""
  ]
  for model, by_config in cells.items():
    lines += ["A/A, {}: {}  ".format(model, aa_line(by_config))]
  lines.append("")
  for model, by_config in cells.items():
    lines += [
        "## " + title(model), "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS)
    ]
    for config in configs:
      if config.name in failures[model]:
        lines.append("| {} | failed: {} |".format(
            config.name, failures[model][config.name]) + " - |" * (
                len(COLUMNS) - 2))
        continue
      runs = by_config[config.name]
      rates = [c.examples_per_second for c in runs]
      lines.append(
          "| {} | {:,.0f} ({:,.0f}-{:,.0f}) | {} | {} | {} | {} | {:.2f} "
          "| {:.2f} | {:.2f} |".format(
              config.name, statistics.median(rates), min(rates), max(rates),
              ratio_text(runs, _single(by_config, config)),
              ratio_text(runs, _parameter_server(by_config, config)),
              ratio_text(runs, _best_mirrored(by_config, config)),
              ratio_text(runs, _static(by_config, config)),
              statistics.median(c.build_seconds for c in runs),
              1000 * statistics.median(c.step_seconds for c in runs),
              statistics.median(c.cpu_per_wall for c in runs)))
    lines.append("")
  return "\n".join(lines)


def aa_line(by_config):
  """`single-again` / `single` by both statistics, or why there is none."""
  twin, reference = by_config.get(AA_TWIN), by_config.get(AA_REFERENCE)
  if not twin or not reference:
    return "not measured (no {} and {} in the grid)".format(AA_TWIN,
                                                           AA_REFERENCE)
  trimmed = paired_ratios(twin, reference)
  window = paired_ratios(twin, reference, "window_examples_per_second")
  return ("{} / {} {} over {} repeats, spread {:.1%}; by the whole window "
          "{}, spread {:.1%}".format(AA_TWIN, AA_REFERENCE,
                                     spread_text(trimmed), len(trimmed),
                                     spread(trimmed), spread_text(window),
                                     spread(window)))


def paired_ratios(runs, reference, field="examples_per_second"):
  """Per repeat, runs[i].field / reference[i].field."""
  return [getattr(a, field) / getattr(b, field)
          for a, b in zip(runs, reference)]


def spread(ratios):
  """max - min of the paired ratios: how far apart the repeats landed."""
  return max(ratios) - min(ratios)


def spread_text(ratios):
  """`median (min-max)`, two decimals: `0.96 (0.93-0.99)`."""
  return "{:.2f} ({:.2f}-{:.2f})".format(statistics.median(ratios),
                                         min(ratios), max(ratios))


def ratio_text(runs, reference):
  return spread_text(paired_ratios(runs, reference)) if reference else "-"


def write_json(path, cells, failures, command, machine):
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
        "failures": failures,
    }, output, indent=1)


def plot(rates_path, scaling_path, cells, failures, configs, machine):
  """The run's figures, as `python -m benchmarks.plot` draws RESULTS.md's.

  A point is the median over repeats of the table's column of that name.
  """
  panels = {}
  for model, by_config in cells.items():
    panels[model] = plotting.Panel(
        title(model),
        {name: _medians(runs) for name, runs in by_config.items() if runs},
        [c.name for c in configs if c.name in failures[model]],
        {name: _ranges(runs) for name, runs in by_config.items() if runs})
  repeats = max((len(runs) for by_config in cells.values()
                 for runs in by_config.values()), default=0)
  plotting.draw(rates_path, scaling_path, panels, plotting.subtitle_of(
      machine, datetime.date.today().isoformat(), repeats))


def title(model):
  """`wide: 100,000 x 16 embedding, ..., global batch 256`: the model's name
  once, though its description may start with it too."""
  spec = MODELS[model]
  description = spec.description
  if description.startswith(model + ": "):
    description = description[len(model) + 2:]
  return "{}: {}, global batch {}".format(model, description,
                                          spec.global_batch)


def _columns(runs):
  """{column: each repeat's value} for the plotted columns of the table."""
  return {"examples/sec": [c.examples_per_second for c in runs],
          "step ms": [1000 * c.step_seconds for c in runs],
          "build s": [c.build_seconds for c in runs]}


def _ranges(runs):
  """{column: (min, max) over the repeats}: the plots' error bars."""
  return {column: (min(values), max(values))
          for column, values in _columns(runs).items()}


def _medians(runs):
  """{column: median} for the plotted columns of the table."""
  return {"examples/sec": statistics.median(c.examples_per_second
                                            for c in runs),
          "step ms": 1000 * statistics.median(c.step_seconds for c in runs),
          "build s": statistics.median(c.build_seconds for c in runs)}


def _single(by_config, config):
  """`single`'s runs on the config's pipeline (not for `single` itself)."""
  reference = "single" if config.pipeline == "dynamic" else "single-static"
  return None if config.name == reference else by_config.get(reference)


def _parameter_server(by_config, config):
  """replicate-N-ps's runs, for another replicate configuration with N > 1.

  For a `-sync` one that is the same strategy with per-tower batch norm:
  what synchronizing costs.
  """
  if (config.kind != "replicate" or config.towers < 2 or
      (config.variant == "ps" and not config.sync_batch_norm)):
    return None
  if config.sync_batch_norm:
    return by_config.get(config.measured.replace("-sync", ""))
  suffix = "-static" if config.pipeline == "static" else ""
  return by_config.get("replicate-{}-ps{}".format(config.towers, suffix))


def _best_mirrored(by_config, config):
  """Per repeat, the faster dynamic mirrored variant with the same N."""
  if (config.kind != "replicate" or config.towers < 2 or
      config.pipeline != "dynamic"):
    return None
  variants = [by_config.get("mirrored-{}-{}".format(config.towers, v))
              for v in ("default", "r1d")]
  variants = [runs for runs in variants if runs]
  if not variants:
    return None
  return [max(runs, key=lambda c: c.examples_per_second)
          for runs in zip(*variants)]


def _static(by_config, config):
  """The same configuration's runs on the static pipeline, for a dynamic one."""
  if config.pipeline != "dynamic":
    return None
  return by_config.get(config.measured + "-static")
