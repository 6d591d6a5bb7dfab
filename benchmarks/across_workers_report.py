"""The MLP's `## Across workers` section of RESULTS.md, and its plot.

`section` renders a run's figures (`benchmarks.across_workers` measures
them) as the section, its raw figures kept in an HTML comment at its end;
`publish` writes it into a RESULTS.md and draws `<stem>_across_workers.png`
beside it. The cost model's part is `benchmarks.across_workers_cost`'s, a
CTR model's step on paper `benchmarks.ctr_cost`'s.
"""

import json
import statistics

from benchmarks import across_workers_cost as probe_cost
from benchmarks import cluster_runs
from benchmarks import ctr_cost, results_md
from benchmarks import step_cost_model as cost

SECTION = "## Across workers"


def rate(record, batch):
  """Examples/sec of a run: global batch x global steps / seconds."""
  return batch * record["global_steps"] / record["seconds"]


def devices(approach, tasks, towers):
  """Devices that compute: MWMS has one replica a task on CPUs."""
  return tasks * (1 if approach == "mwms" else towers)


def paired(data, key, reference):
  """Per repeat where both ran, rate(key) / rate(reference)."""
  batch = data["batch"]
  return [rate(a, batch) / rate(b, batch)
          for a, b in zip(data["runs"][key], data["runs"][reference])
          if a is not None and b is not None]


def throughput_table(data):
  """The runs' table: examples/sec and ratios per (approach, tasks)."""
  lines = ["| approach | tasks | devices | rows a device | examples/sec | "
           "step ms | x 1 task | x replicate | chief's threads at the end |",
           "|---|---|---|---|---|---|---|---|---|"]
  for approach, tasks in data["cells"]:
    key = cluster_runs.key(approach, tasks)
    count = devices(approach, tasks, data["towers"])
    head = "| {} | {} | {} | {} |".format(approach, tasks, count,
                                          data["batch"] // count)
    if key in data["failures"]:
      lines.append(head + " failed: {} | - | - | - | - |".format(
          data["failures"][key].replace("|", "/")))
      continue
    runs = [r for r in data["runs"][key] if r is not None]
    one, replicate = cluster_runs.key(approach,
                                      1), cluster_runs.key("replicate", tasks)
    threads = [r["threads"] for r in runs if r.get("threads")]
    lines.append(head + " {} | {} | {} | {} | {} |".format(
        cluster_runs.spread([rate(r, data["batch"]) for r in runs], "{:,.0f}"),
        cluster_runs.spread(
            [1000 * r["seconds"] / r["global_steps"] for r in runs], "{:.1f}"),
        cluster_runs.spread(paired(data, key, one)
                           ) if tasks != 1 and one in data["runs"] else "-",
        cluster_runs.spread(paired(data, key, replicate))
        if approach != "replicate" and replicate in data["runs"] else "-",
        cluster_runs.spread(threads, "{:,.0f}")))
  return "\n".join(lines)


def section(data):
  """The `## Across workers` section of RESULTS.md, from a run's figures."""
  batch, towers = data["batch"], data["towers"]
  hidden = "-".join(str(u) for u in data["hidden"])
  mlp = cost.mlp_shapes(784, data["hidden"], 10)
  mlp_collectives = cost.replicate_collectives(mlp)
  counted = [r["collectives"] for key, runs in data["runs"].items()
             if key.startswith("replicate x") and key != "replicate x1"
             for r in runs if r]
  probe = probe_cost.probe_figures(data["probes"].get("2", []))
  shapes, norms = cost.resnet50_shapes()
  resnet = cost.parameters(shapes)
  resnet_collectives = cost.replicate_collectives(shapes, 2 * norms)
  parts = [
      SECTION, "", "`{}`, {}; {}; {}, the order of the runs reversed on odd "
      "repeats.{}".format(data["command"], data["date"], data["machine"],
                          cluster_runs.repeats(data["repeats"]),
                          cluster_runs.load_note(data)), ""
  ] + [
      line for note in data.get("notes", []) for line in ("Note: " + note, "")
  ] + [
      "The same model (MLP 784-{}-10, {:,} float32 parameters, {:.2f} MB of "
      "gradients; plain gradient descent) on the same global batch of {} "
      "rows, split evenly over 1 to {} local tasks, each task its own "
      "process, all on loopback gRPC: `replicate` (`start_server`, "
      "`variable_strategy=\"replicated\"`, {} a task, no ps), "
      "`mwms` (`MultiWorkerMirroredStrategy` through `RunConfig("
      "train_distribute=...)` under `disable_eager_execution()`: one "
      "replica a task, since on CPUs it uses no virtual devices) and "
      "`ps-sync` (1 ps task more, `SyncReplicasOptimizer` in "
      "`TowerOptimizer`, `parameter_server`, {} a task). The chief "
      "times {} global steps after {} untimed ones: examples/sec = "
      "global batch x global steps / seconds, median (min-max) over the "
      "repeats; x 1 task and x replicate are ratios paired within a "
      "repeat. At 1 task nothing crosses processes except ps-sync's "
      "variables, which live on the ps task.".format(
          hidden, cost.parameters(mlp),
          cost.parameters(mlp) * 4 / 1e6,
          batch, max(t for _, t in data["cells"]), _towers(towers),
          _towers(towers), data["steps"], data["warmup"]), "",
      "What 2 shared cores can show: every task, the ps task included, "
      "runs on the same 2 cores, so adding tasks adds no compute, only "
      "processes and messages. On N machines the ideal x 1 task would be "
      "N; here it is 1.0, and what falls short of 1.0 is what each "
      "approach's communication and its extra processes cost on loopback. "
      "How it scales across machines is the cost model's part below.", "",
      throughput_table(data), ""
  ]
  if counted:
    parts += ["Collective ops in the replicate chief's graph: {}; a step "
              "runs {} of them: {}, as the cost model counts them (the "
              "rest run once, at start-up: the model check and the "
              "broadcast of the variables).".format(
                  _counts(counted[0]), sum(mlp_collectives.values()),
                  probe_cost.described(mlp_collectives)), ""]
  parts += _threads_paragraph(data)
  parts += [
      "### Collectives timed alone", "",
      "Bare cross-process `CollectiveReduceV2` (ring, one CPU device a "
      "task, group leader the chief in each `tf.distribute.Server`'s own "
      "config) between 2 and 3 local task processes, each fetch a "
      "`session.run` of its own, median of {} runs then median over the "
      "repeats, after the training runs of each repeat. Overhead of one: "
      "a 4-byte all-reduce's run less the empty run's. Of each further "
      "one: ({} concurrent 4-byte all-reduces in one run less one alone) "
      "/ {}. Timed: the same with an op timeout ({:g} s here), as "
      "replicate's start has (its step's collectives have none). "
      "Throughput: the bytes a ring member "
      "sends for 8 MiB, 2(K-1)/K x 8 MiB, over (8 MiB run - 4 B "
      "run).".format(data.get("probe_rounds", "-"), probe_cost.PROBE_CONCURRENT,
                     probe_cost.PROBE_CONCURRENT - 1, probe_cost.PROBE_TIMEOUT),
      "",
      probe_cost.probe_table(data), ""
  ]
  parts += probe_cost.cost_section(probe, resnet, resnet_collectives, norms)
  if probe:
    parts += ["", probe_cost.loopback_check(data, probe, mlp, mlp_collectives)]
  parts += [""] + ctr_cost.section(probe["untimed"] if probe else None)
  parts += [
      "", probe_cost.DATA + json.dumps(data, separators=(",", ":")) + " -->", ""
  ]
  return "\n".join(parts)


def _towers(count):
  return "{} tower{}".format(count, "" if count == 1 else "s")


def _threads_paragraph(data):
  """What the chiefs' thread counts say, when replicate's run up."""
  threads = {key: statistics.median(r["threads"] for r in runs)
             for key, runs in ((k, [r for r in v if r and r.get("threads")])
                               for k, v in data["runs"].items()) if runs}
  mine = {k: v for k, v in threads.items() if k.startswith("replicate x")
          and k != "replicate x1"}
  if not mine or max(mine.values()) < 1000:
    return []
  others = {k: v for k, v in threads.items() if k.startswith("mwms x")
            and k != "mwms x1"}
  return [
      "Threads: after {} steps the replicate chief has {} threads ({}), "
      "MWMS's {}. TensorFlow 2.15 gives each collective that has an op "
      "timeout a thread of its own that sleeps for the whole timeout "
      "(tensorflow/tensorflow#62466), and every cross-task collective of "
      "replicate has one (`REPLICATE_SYNC_TIMEOUT_SECS`, 120 s by "
      "default), so threads pile up at (collectives a second) x 120 s; "
      "MWMS sets no timeout. Seen on this machine on 2026-11-25, outside "
      "this table: a 2-task replicate run meant to train 2,520 steps (this "
      "job, `--steps 2500`) was killed by SIGABRT after 73 s, both tasks "
      "printing `terminate called after throwing an instance of "
      "'std::system_error' what(): Resource temporarily unavailable`, at "
      "about 15,000 threads a process; with `REPLICATE_SYNC_TIMEOUT_SECS=3` "
      "a 420-step run peaked at about 1,000 threads, with 120 s at 4,300. "
      "The timing runs here are short enough to finish.".format(
          data["warmup"] + data["steps"],
          "-".join("{:,.0f}".format(v) for v in (min(mine.values()),
                                                  max(mine.values()))),
          ", ".join("{} tasks: {:,.0f}".format(k.split("x")[1], v)
                    for k, v in sorted(mine.items())),
          ", ".join("{} at {} tasks".format("{:,.0f}".format(v), k.split(
              "x")[1]) for k, v in sorted(others.items())) or "-"), ""]


def _counts(counted):
  return ", ".join("{} {}".format(n, kind) for kind, n in counted.items())


def publish(path, data):
  """Writes the section of `data` into `path`, and its plot beside it."""
  results_md.publish_section(path, section(data), SECTION,
                             "_across_workers.png",
                             lambda plot_path: draw(plot_path, data),
                             "the across-workers section")


def draw(path, data):
  """Measured examples/sec by tasks; predicted efficiency. False without
  matplotlib."""

  def fill(left, right):
    colors = {"replicate": "tab:green", "mwms": "tab:blue",
              "ps-sync": "tab:orange"}
    for approach in [a for a in cluster_runs.APPROACHES
                     if any(c[0] == a for c in data["cells"])]:
      points = []
      for cell in data["cells"]:
        runs = [r for r in data["runs"][cluster_runs.key(*cell)] if r]
        if cell[0] == approach and runs:
          rates = [rate(r, data["batch"]) for r in runs]
          points.append((cell[1], statistics.median(rates), min(rates),
                         max(rates)))
      if points:
        tasks, medians, lows, highs = zip(*sorted(points))
        left.errorbar(tasks, medians, yerr=[[m - l for m, l in zip(
            medians, lows)], [h - m for m, h in zip(medians, highs)]],
                      marker="o", capsize=4, color=colors[approach],
                      label=approach)
    left.set_xticks(sorted({c[1] for c in data["cells"]}))
    left.set_xlabel("local tasks (processes), global batch {} split evenly"
                    .format(data["batch"]))
    left.set_ylabel("examples/sec (median, min-max bars)")
    left.set_ylim(bottom=0)
    left.grid(True, color="0.9")
    left.legend()
    left.set_title("Measured: MLP 784-{}-10 on 2 shared cores, loopback gRPC"
                   .format("-".join(str(u) for u in data["hidden"])),
                   fontsize=10)
    probe = probe_cost.probe_figures(data["probes"].get("2", []))
    if probe:
      rows = probe_cost.cost_rows(probe["untimed"], probe["timed"],
                                  probe["bandwidth"])
      labels = ["{}, {}\n{}".format(
          r["cluster"], r["link"] if isinstance(r["link"], str) else
          "{} Gb/s".format(r["link"]), r["arrangement"].name) for r in rows]
      low = [r["step"].efficiency_no_overlap for r in rows]
      high = [r["step"].efficiency_overlap for r in rows]
      positions = range(len(rows))
      right.bar(positions, low, color=["tab:purple" if r[
          "arrangement"].name == "flat ring" else "tab:green" for r in rows],
                label="no overlap")
      right.bar(positions, [h - l for h, l in zip(high, low)], bottom=low,
                color="0.85", label="gain with full overlap")
      right.axhline(0.9, color="black", linestyle=":", linewidth=1,
                    label="90%: Horovod's and tf_cnn_benchmarks' published "
                    "figures")
      right.set_xticks(list(positions), labels, fontsize=7, rotation=90)
      right.set_ylim(0, 1.3)
      right.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0])
      right.set_ylabel("predicted scaling efficiency")
      right.legend(fontsize=8, loc="upper center", ncol=2)
      right.set_title("Cost model: ResNet-50, {:.0f} images/sec a GPU "
                      "(purple: flat ring, green: replicate)".format(
                          probe_cost.GPU_IMAGES_PER_SECOND), fontsize=10)
    else:
      right.set_visible(False)

  title = "Synchronous training across workers\n{}; {}, {}".format(
      data["machine"], data["date"], cluster_runs.repeats(data["repeats"]))
  return results_md.two_panels(path, title, fill)
