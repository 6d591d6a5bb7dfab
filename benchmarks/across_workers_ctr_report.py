"""The CTR model's `## Across workers: a CTR model` section, and its plot.

`section` renders the figures of `python -m benchmarks.across_workers
--model ctr` (`benchmarks.across_workers_ctr` measures them), its raw
figures kept in an HTML comment at its end; `publish` writes it into a
RESULTS.md and draws `<stem>_across_workers_ctr.png` beside it.
"""

import json
import statistics

from benchmarks import cluster_runs, ctr_model, results_md

SECTION = "## Across workers: a CTR model"
DATA = "<!-- across_workers ctr data: "
COLORS = {"replicate": "tab:green", "hybrid": "tab:olive",
          "mwms": "tab:blue", "ps-async": "tab:gray", "ps-sync": "tab:orange"}


def rows_a_step(approach, tasks, batch):
  """Rows a global step trains on: the global batch, but one task's share
  with ps-async (each task's step is a global step of its own)."""
  return batch // tasks if approach == "ps-async" else batch


def rate(record, approach, batch):
  return (rows_a_step(approach, record["tasks"], batch) *
          record["global_steps"] / record["seconds"])


def total(figures):
  """Bytes a traced step moved between tasks: collectives and send/recv."""
  return figures["collectives"] + figures["send/recv"]


def _median(values):
  return statistics.median(values) if values else None


def table(data):
  """One row per (approach, tasks): speed, bytes a step, memory."""
  batch = data["batch"]
  lines = ["| approach | tasks | ps tasks | devices | rows a device | "
           "examples/sec | ms a global step | x replicate | bytes a step, quarter "
           "batch | bytes a step, whole batch | of which collectives (ops) / "
           "received / sent | chief's peak memory, MB |", "|" + "---|" * 12]
  for approach, tasks in data["cells"]:
    key = cluster_runs.key(approach, tasks)
    count = tasks * (1 if approach == "mwms" else data["towers"])
    head = "| {} | {} | {} | {} | {} |".format(
        approach, tasks, 1 if approach in cluster_runs.PS_MODES else 0, count,
        batch // count)
    if key in data["failures"]:
      lines.append(head + " failed: {} |".format(
          data["failures"][key].replace("|", "/")) + " - |" * 6)
      continue
    runs = [r for r in data["runs"][key] if r]
    mine = [rate(r, approach, batch) for r in runs]
    reference = [
        rate(r, "replicate", batch) if r else None
        for r in data["runs"].get(cluster_runs.key("replicate", tasks), [])
    ]
    ratios = [a / b for a, b in zip(
        [rate(r, approach, batch) if r else None for r in
         data["runs"][key]], reference) if a and b]
    traced = {name: _median([total(r["bytes"][name]) for r in runs
                             if name in r.get("bytes", {})])
              for name in ("quarter", "whole")}
    whole = [r["bytes"]["whole"] for r in runs if "whole" in r.get(
        "bytes", {})]
    lines.append(head + " {} | {} | {} | {} | {} | {} | {} |".format(
        cluster_runs.spread(mine, "{:,.0f}"),
        cluster_runs.spread(
            [1000 * r["seconds"] / r["global_steps"] for r in runs], "{:.1f}"),
        cluster_runs.spread(ratios) if approach != "replicate" else "-",
        *("-" if traced[n] is None else "{:,.0f}".format(traced[n])
          for n in ("quarter", "whole")), "{:,} ({}) / {} / {}".format(
              whole[0]["collectives"], whole[0].get("collective ops", "-"),
              *("{:,}".format(whole[0][kind]) if kind in whole[0] else "-"
                for kind in ("received", "sent"))) if whole else "-",
        cluster_runs.spread(
            [r["memory_mb"] for r in runs if r.get("memory_mb")], "{:,.0f}")))
  return "\n".join(lines)


def touched_text(data):
  """What the chief's traced steps look up, at each task count."""
  seen = {}
  for runs in data["runs"].values():
    for record in runs:
      if record and record.get("touched"):
        seen.setdefault(record["tasks"], record["touched"])
  return "; ".join(
      "{} tasks: {:,} rows look up {:,} ids ({:,} distinct), a quarter "
      "{:,} rows {:,} ids ({:,} distinct)".format(
          tasks, t["whole"]["rows"], t["whole"]["ids"],
          t["whole"]["distinct"], t["quarter"]["rows"], t["quarter"]["ids"],
          t["quarter"]["distinct"]) for tasks, t in sorted(seen.items()))


def growth(data, approach):
  """{tasks: (whole - quarter bytes, whole / quarter)} of `approach`'s
  runs (medians)."""
  out = {}
  for name, tasks in data["cells"]:
    runs = [r for r in data["runs"][cluster_runs.key(name, tasks)] if r and {
        "quarter", "whole"} <= set(r.get("bytes", {}))]
    if name == approach and runs:
      pairs = [(total(r["bytes"]["whole"]), total(r["bytes"]["quarter"]))
               for r in runs]
      out[tasks] = (statistics.median(w - q for w, q in pairs),
                    statistics.median(w / q for w, q in pairs))
  return out


def dense_parameters(data):
  """The MLP's parameters on top of the embeddings (all float32)."""
  sizes = [data["fields"] * data["dim"]] + list(data["hidden"]) + [1]
  return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def fastest_synchronous(data):
  """{tasks: [(approach, median examples/sec), ...] fastest first} over the
  synchronous approaches that ran."""
  out = {}
  for approach, tasks in data["cells"]:
    runs = [r for r in data["runs"][cluster_runs.key(approach, tasks)] if r]
    if approach != "ps-async" and runs:
      out.setdefault(tasks, []).append((approach, statistics.median(
          rate(r, approach, data["batch"]) for r in runs)))
  return {tasks: sorted(ranked, key=lambda pair: -pair[1])
          for tasks, ranked in out.items()}


def _wall(data):
  """How long the runs took, start-up included, if they say."""
  walls = [r["wall"] for runs in data["runs"].values() for r in runs
           if r and r.get("wall")]
  return ", the runs {:.0f} s in all".format(sum(walls)) if walls else ""


def section(data):
  """The `## Across workers: a CTR model` section, from a run's figures."""
  rows_a_table = ctr_model.table_rows(data["table_rows"], data["fields"])
  table_bytes = rows_a_table * data["fields"] * data["dim"] * 4
  hidden = "-".join(str(u) for u in data["hidden"])
  parts = [
      SECTION, "", "`{}`, {}; {}; {}{}.{}".format(
          data["command"], data["date"], data["machine"],
          cluster_runs.repeats(data["repeats"]), _wall(data),
          cluster_runs.load_note(data)), ""
  ] + [
      line for note in data.get("notes", []) for line in ("Note: " + note, "")
  ] + [
      "The CTR model of `benchmarks/ctr_model.py`, as a TF1 Estimator user "
      "writes it: {} int64 fields, each with its own table of {:,} x {} "
      "({:,} rows, {:.1f} MB of float32 in all), `get_variable(..., "
      "partitioner=fixed_size_partitioner({}))` and "
      "`embedding_lookup(..., partition_strategy=\"div\")`, whose gradients "
      "are `IndexedSlices`; the embeddings concatenated, an MLP {}-{}-1, a "
      "logistic loss, Adagrad (a slot as large as each table). Power-law "
      "(Zipf {}) ids, so hot rows repeat. The same global batch of {} rows "
      "split evenly over the tasks, each task its own process, on loopback "
      "gRPC: `replicate` (synchronous cluster, `start_server`, "
      "`variable_strategy=\"replicated\"`, {} towers a task, no ps: the "
      "tables' slices all-gathered), `hybrid` (the same with 1 ps task, "
      "which holds the partitioned tables; the rest replicated and "
      "all-reduced), `mwms` (`MultiWorkerMirroredStrategy`, one replica a "
      "task; it ignores the partitioner, so every task holds every table, "
      "and all-gathers `IndexedSlices`), `ps-async` (1 ps task, "
      "`parameter_server`, {} towers a task, each task updating on its "
      "own) and `ps-sync` (the same with `SyncReplicasOptimizer`). The "
      "chief times {} global steps after {} untimed ones. examples/sec = "
      "rows a global step x global steps / seconds, where a global step "
      "is the global batch, except with ps-async: one task's share. "
      "x replicate is paired within a repeat.".format(
          data["fields"], rows_a_table, data["dim"], rows_a_table *
          data["fields"], table_bytes / 1e6, data["shards"], data["fields"] *
          data["dim"], hidden, ctr_model.ZIPF_EXPONENT, data["batch"],
          data["towers"], data["towers"], data["steps"], data["warmup"]), "",
      "Bytes a step, counted from tensor sizes: the chief traces two of "
      "its warm-up steps (`RunOptions(trace_level=FULL_TRACE, "
      "output_partition_graphs=True)`), one on a quarter of its batch and "
      "one on all of it, and sums, from its own devices' stats of the step "
      "(`benchmarks/ctr_model.py`, `step_bytes`): the output of every "
      "collective op the step ran (an all-reduce's reduced tensor, an "
      "all-gather's slices of every task, padding included); every tensor "
      "it received from another task by gRPC (its `RecvTensor` records: "
      "variable reads and embedding rows from the ps task); every tensor "
      "it sent to another task (each cross-task `_Send` of the step's "
      "partition graphs, sized by its producer's output: ids, gradients "
      "and updates to the ps task). These are the chief's tensors, not "
      "the bytes on the wire (a ring all-reduce sends about 2(K-1)/K of "
      "its tensor; gRPC frames), and not the other tasks'. "
      "`mwms` runs the whole batch from its first step (its all-gathers "
      "keep their first shape), so it has no quarter figure. The tables "
      "are {:.1f} MB: summed densely, as replicate did before slices, a "
      "step would move at least that.".format(table_bytes / 1e6), "",
      table(data), ""
  ]
  touched = touched_text(data)
  if touched:
    parts += ["Rows touched (the chief's batch): {}.".format(touched), ""]
  fastest = fastest_synchronous(data)
  if fastest:
    parts += ["Fastest synchronous approach (replicate, hybrid, mwms, "
              "ps-sync; median examples/sec): {}.".format("; ".join(
                  "{} tasks: {} ({:,.0f}, then {} {:,.0f})".format(
                      tasks, *ranked[0], *ranked[1]) if len(ranked) > 1
                  else "{} tasks: {} ({:,.0f})".format(tasks, *ranked[0])
                  for tasks, ranked in sorted(fastest.items()))), ""]
  grown = ["{}: {}".format(a, ", ".join(
      "+{:.2f} MB (x {:.2f}) at {} tasks".format(v[0] / 1e6, v[1], t)
      for t, v in sorted(g.items())))
           for a in ("replicate", "hybrid", "ps-sync", "ps-async")
           for g in [growth(data, a)] if g]
  if grown:
    parts += ["From a quarter of the batch to all of it (4 x the ids looked "
              "up), the chief's bytes a step grow by: {}. What does not grow "
              "is the dense layers' part ({:.2f} MB of gradients, or of "
              "reads from the ps task, a tower), and the tables' {:.1f} MB "
              "are in none of it: the bytes follow the rows looked up."
              .format("; ".join(grown), dense_parameters(data) * 4 / 1e6,
                      table_bytes / 1e6), ""]
  parts += ["", DATA + json.dumps(data, separators=(",", ":")) + " -->",
            ""]
  return "\n".join(parts)


def publish(path, data):
  """Writes the section of `data` into `path`, and its plot beside it."""
  results_md.publish_section(path, section(data), SECTION,
                             "_across_workers_ctr.png",
                             lambda plot_path: draw(plot_path, data),
                             "the CTR section")


def draw(path, data):
  """Examples/sec and bytes a step by approach and tasks; False without
  matplotlib."""

  def fill(left, right):
    approaches = [a for a in cluster_runs.CTR_APPROACHES
                  if any(c[0] == a for c in data["cells"])]
    tasks = sorted({c[1] for c in data["cells"]})
    width = 0.8 / max(1, len(approaches))
    for index, approach in enumerate(approaches):
      positions, rates, whole, quarter = [], [], [], []
      for position, count in enumerate(tasks):
        runs = [
            r for r in data["runs"].get(cluster_runs.key(approach, count), [])
            if r
        ]
        if not runs:
          continue
        positions.append(position + (index - (len(approaches) - 1) / 2) * width)
        rates.append(_median([rate(r, approach, data["batch"]) for r in runs]))
        whole.append((_median([total(r["bytes"]["whole"]) for r in runs
                               if "whole" in r.get("bytes", {})]) or 0) / 1e6)
        quarter.append((_median([total(r["bytes"]["quarter"]) for r in runs
                                 if "quarter" in r.get("bytes", {})]) or 0)
                       / 1e6)
      if not positions:
        continue  # every run of it failed
      left.bar(positions, rates, width, color=COLORS[approach], label=approach)
      right.bar(positions, whole, width, color=COLORS[approach],
                label=approach)
      right.bar(positions, quarter, width, color="white", hatch="//",
                edgecolor=COLORS[approach], alpha=0.9)
    for axes in (left, right):
      axes.set_xticks(range(len(tasks)), ["{} tasks".format(t) for t in tasks])
      axes.grid(True, axis="y", color="0.9")
    left.set_ylabel("examples/sec (median)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    left.set_title("Measured: CTR model, global batch {}, 2 shared cores, "
                   "loopback gRPC".format(data["batch"]), fontsize=10)
    right.set_ylabel("MB a step of the chief (hatched: a quarter batch)")
    right.set_title("Bytes a step: collectives' outputs + gRPC tensors "
                    "between tasks", fontsize=10)

  title = "The CTR model across workers\n{}; {}, {}".format(
      data["machine"], data["date"], cluster_runs.repeats(data["repeats"]))
  return results_md.two_panels(path, title, fill)
