"""The across-workers section's cost model part: the probe of bare
collectives, and a ResNet-50 step on a real cluster predicted from it.

`probe_figures` turns the probe's records (bare cross-process
`CollectiveReduceV2`s, run by `benchmarks/across_workers_job.py probe`)
into the overhead of one collective and of each further one, and the
loopback throughput; `cost_section` feeds them to
`benchmarks.step_cost_model`. `benchmarks.ctr_cost` reads the same figures.
"""

import statistics

from benchmarks import cluster_runs
from benchmarks import step_cost_model as cost

# Where the MLP's section keeps its run's figures, the probe's among them
# (`benchmarks.ctr_cost` reads them too).
DATA = "<!-- across_workers data: "
PROBE_SIZES = (1, 262144, 2097152)  # float32 elements: 4 B, 1 MiB, 8 MiB
PROBE_CONCURRENT = 32
# The probe's timed collectives give up after this many seconds. Short:
# TensorFlow 2.15 starts a thread per collective with a timeout that sleeps
# for the whole timeout (tensorflow/tensorflow#62466), and the probe's
# thousands of collectives a second would pile up more threads than a
# process can have.
PROBE_TIMEOUT = 2.0

# The cost model's assumptions (see step_cost_model and the section's text).
GPU_IMAGES_PER_SECOND = 360.0  # ResNet-50, one V100, float32, batch 64
GPU_BATCH = 64
HOP_LATENCY = 25e-6  # seconds a hop on the cluster's network
CLUSTERS = ((2, 8), (16, 8))  # (machines, GPUs each)
LINKS_GBIT = (25, 100)


def probe_figures(records, concurrent=PROBE_CONCURRENT):
  """Medians over repeats: ms of each probe fetch, and what follows."""
  records = [r for r in records if r]
  if not records:
    return None
  ms = {name: statistics.median(r["median_ms"][name] for r in records)
        for name in records[0]["median_ms"]}
  tasks = records[0]["tasks"]
  tiny, big = ms[str(PROBE_SIZES[0])], ms[str(PROBE_SIZES[-1])]
  moved = cost.ring_bytes_per_member(PROBE_SIZES[-1] * 4, tasks)
  figures = {"ms": ms, "bandwidth": moved / ((big - tiny) / 1000),
             "repeats": len(records),
             "threads": statistics.median(r.get("threads") or 0
                                          for r in records)}
  for suffix, name in (("", "untimed"), (" timed", "timed")):
    one, many = "1" + suffix, "{}x1{}".format(concurrent, suffix)
    figures[name] = cost.Overhead(
        (ms[one] - ms["none"]) / 1000,
        (ms[many] - ms[one]) / (concurrent - 1) / 1000) if (
            one in ms and many in ms) else None
  return figures


def probe_table(data):
  """The probe's table: a row of milliseconds and overheads per task count."""
  lines = ["| tasks | empty run ms | 4 B ms | 1 MiB ms | 8 MiB ms | "
           "{n} x 4 B ms | timed: 4 B ms | timed: {n} x 4 B ms | overhead "
           "of one, ms | of each further one, ms | timed: of one, ms | timed: "
           "of each further one, ms | loopback throughput, MB/s | chief's "
           "threads at the end |".format(n=PROBE_CONCURRENT),
           "|" + "---|" * 14]
  for tasks, records in data["probes"].items():
    figures = probe_figures(records)
    if figures is None:
      lines.append("| {} | failed |".format(tasks) + " - |" * 12)
      continue
    ms = figures["ms"]
    timed = figures["timed"] or cost.Overhead(float("nan"), float("nan"))
    lines.append(
        "| {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {} | {} | {:.2f} "
        "| {:.2f} | {:.2f} | {:.2f} | {:,.0f} | {:,.0f} |".format(
            tasks, ms["none"], *(ms[str(s)] for s in PROBE_SIZES),
            ms["{}x1".format(PROBE_CONCURRENT)],
            *("{:.2f}".format(ms[name]) if name in ms else "-"
              for name in ("1 timed", "{}x1 timed".format(
                  PROBE_CONCURRENT))),
            1000 * figures["untimed"].first, 1000 * figures["untimed"].more,
            1000 * timed.first, 1000 * timed.more,
            figures["bandwidth"] / 1e6, figures["threads"]))
  return "\n".join(lines).replace("| nan |", "| - |")


def cost_rows(untimed, timed, measured_bandwidth):
  """The cost model's predictions for ResNet-50: one dict per row.

  `timed` (the overhead with an op timeout) is not used: no step's
  collective has one.
  """
  del timed
  shapes, norms = cost.resnet50_shapes()
  gradient_bytes = cost.parameters(shapes) * cost.FLOAT32_BYTES
  collectives = sum(cost.replicate_collectives(shapes, 2 * norms).values())
  compute = GPU_BATCH / GPU_IMAGES_PER_SECOND
  rows = []
  for machines, gpus in CLUSTERS:
    links = [(gbit, gbit * cost.GBIT_BYTES) for gbit in LINKS_GBIT]
    if measured_bandwidth:
      links.append(("loopback here", measured_bandwidth))
    for link, bandwidth in links:
      for arrangement in (cost.flat_ring(machines, gpus, gradient_bytes),
                          cost.replicate_ring(machines, collectives)):
        if link == "loopback here" and arrangement.name != "replicate":
          continue
        # A step's collectives have no op timeout, replicate's (only its
        # start's have one) or a flat ring's.
        overhead = untimed
        timing = cost.step(arrangement, gradient_bytes, bandwidth,
                           HOP_LATENCY, overhead, compute)
        rows.append({"cluster": "{} x {}".format(machines, gpus),
                     "gpus": machines * gpus, "link": link,
                     "arrangement": arrangement, "step": timing,
                     "bytes": cost.ring_bytes_per_member(
                         gradient_bytes, arrangement.members)})
  return rows


def cost_table(rows):
  """`cost_rows` as the section's table."""
  lines = ["| cluster | link | arrangement | ring members K | MB a link "
           "carries | collectives | transfer ms | latency ms | overhead ms "
           "| step ms, no overlap - full overlap | efficiency, no overlap - "
           "full overlap | images/sec |", "|---|---|---|---|---|---|---|---|"
           "---|---|---|---|"]
  for row in rows:
    step, arrangement = row["step"], row["arrangement"]
    link = row["link"] if isinstance(row["link"], str) else (
        "{} Gb/s".format(row["link"]))
    images = [row["gpus"] * GPU_BATCH / s for s in (step.no_overlap,
                                                     step.overlap)]
    lines.append(
        "| {} | {} | {} | {} | {:.1f} | {} | {:.1f} | {:.2f} | {:.1f} | "
        "{:.0f} - {:.0f} | {:.0%} - {:.0%} | {:,.0f} - {:,.0f} |".format(
            row["cluster"], link, arrangement.name, arrangement.members,
            row["bytes"] / 1e6, arrangement.collectives,
            1000 * step.transfer, 1000 * step.latency, 1000 * step.overhead,
            1000 * step.no_overlap, 1000 * step.overlap,
            step.efficiency_no_overlap, step.efficiency_overlap, *images))
  return "\n".join(lines)


def cost_section(probe, resnet, collectives, norms):
  """The section's lines on a ResNet-50 step on a real cluster."""
  compute_ms = 1000 * GPU_BATCH / GPU_IMAGES_PER_SECOND
  lines = [
      "### A step on a real cluster: the cost model", "",
      "`benchmarks/step_cost_model.py` (its docstring has the model): a "
      "step is each GPU's compute, then a ring all-reduce of the gradients "
      "in which each of K members sends 2(K-1)/K of the bytes S: t_comm = "
      "2(K-1)/K x S / B + rounds x 2(K-1) x latency + overhead(first) + "
      "(collectives - 1) x overhead(further). `flat ring`: every GPU in "
      "the ring (K = all GPUs, Horovod's and NCCL's arrangement; gradients "
      "in 64 MiB fusion buffers, one after the other). `replicate`: each "
      "machine sums its towers first, then one device a machine joins the "
      "ring (K = machines) with one collective per pack of small "
      "gradients, per large gradient, for the batch-norm statistics (one "
      "pack), for the loss, and the rows' all-gather before the step ({} "
      "in all for "
      "ResNet-50: {}), in 2 rounds. Efficiency is compute / step time; "
      "images/sec = GPUs x {} / step time.".format(
          sum(collectives.values()), described(collectives), GPU_BATCH),
      "",
      "Assumptions: ResNet-50 (v1.5, counted here: {:,} float32 parameters, "
      "S = {:.1f} MB; {} batch-norm layers, so {} statistics); each GPU "
      "computes a batch of {} in {:.1f} ms (the {:.0f} images/sec of one "
      "V100 in float32, an assumption not checked here against a "
      "published table; TensorFlow's published "
      "tf_cnn_benchmarks table of May 2017 gives 219 images/sec on a P100 "
      "at batch 64, which would make communication matter less); backward "
      "is 2/3 of that compute; {:.0f} us a network hop; the bandwidth of "
      "each machine's link as given. No overlap: the all-reduce starts "
      "after the whole backward pass; full overlap: it runs during "
      "backward, so the step is max(compute, forward + t_comm). "
      "TensorFlow runs a collective once its input is ready, so large "
      "gradients can overlap backward, but replicate's pack of small "
      "gradients waits for the last of them (the first layers'), and the "
      "statistics and loss are summed after the forward pass.".format(
          resnet, resnet * 4 / 1e6, norms, 2 * norms, GPU_BATCH, compute_ms,
          GPU_IMAGES_PER_SECOND, HOP_LATENCY * 1e6), ""]
  if not probe:
    lines += ["No probe ran (--probe-rounds 0, or no 2-task probe), so no "
              "overhead was measured and the model's table is left out."]
    return lines
  untimed, timed = probe["untimed"], probe["timed"] or probe["untimed"]
  lines += [
      "Measured here (2 tasks, above): overhead of one collective {:.2f} "
      "ms, of each further one {:.2f} ms, without an op timeout, as both "
      "arrangements' step collectives run ({:.2f} and {:.2f} ms with one, "
      "as only replicate's start runs); loopback throughput {:,.0f} "
      "MB/s. These come from processes sharing 2 busy cores, so they are "
      "likely above what a dedicated machine pays; the `loopback here` "
      "rows show the prediction if TensorFlow's gRPC collectives moved "
      "data no faster than that on the cluster.".format(
          1000 * untimed.first, 1000 * untimed.more, 1000 * timed.first,
          1000 * timed.more, probe["bandwidth"] / 1e6), "",
      cost_table(cost_rows(untimed, timed, probe["bandwidth"])), "",
      "Published, for comparison: Horovod's benchmark page reports 90% "
      "scaling efficiency for Inception V3 and ResNet-101 and 68% for "
      "VGG-16 on 512 Pascal GPUs (128 servers of 4) over 25 Gbit/s RoCE "
      "(https://github.com/horovod/horovod/blob/master/docs/benchmarks.rst); "
      "its paper (Sergeev and Del Balso, arXiv:1802.05799, 2018) reports "
      "about 90% for the same models up to 128 GPUs, ResNet-50 alike "
      "(as the issue for this work quotes it; not re-read here). "
      "TensorFlow's tf_cnn_benchmarks page (tensorflow/docs_src/"
      "performance/benchmarks.md, May 2017, `distributed_replicated`, "
      "8 K80s a server on Amazon EC2, batch 64 a GPU, synthetic data) "
      "gives ResNet-50 378 images/sec on 8 GPUs, 751 on 16 (2 x 8) and "
      "2,744 on 64 (8 x 8) against 52.4 on 1: 90%, 90% and 82% of linear; "
      "on one DGX-1 (8 P100s) 1,734 against 219, 99%. Those slower GPUs "
      "leave more time to hide communication in than the V100 assumed "
      "here. The flat ring's band brackets Horovod's figure; replicate "
      "sends less over each link (K = machines, not GPUs: 1.0 x S at 2 "
      "machines against 1.88 x S), but pays the measured per-collective "
      "overhead on {} collectives a step.".format(
          sum(collectives.values())),
      "",
      "What the model ignores: the sum inside each machine (NVLink or "
      "PCIe, taken as free), contention between rings or streams on one "
      "link, the optimizer's update and the copy back to every tower, the "
      "input pipeline, stragglers and jitter, and TensorFlow's own gRPC "
      "costs beyond the measured overhead (whether its collectives reach "
      "25 or 100 Gb/s is not measured: the `loopback here` rows are the "
      "pessimistic case)."]
  return lines


def loopback_check(data, probe, mlp, collectives):
  """The model on this machine's own runs: predicted against measured."""
  medians = {}
  for key, runs in data["runs"].items():
    kept = [r for r in runs if r]
    if kept:
      medians[key] = statistics.median(r["seconds"] / r["global_steps"]
                                       for r in kept)
  if "replicate x1" not in medians:
    return ""
  overhead = probe["untimed"]  # the step's collectives have no timeout
  texts = []
  for tasks in sorted(t for a, t in data["cells"] if a == "replicate"
                      and t > 1 and cluster_runs.key(a, t) in medians):
    predicted = cost.step(
        cost.replicate_ring(tasks, sum(collectives.values())),
        cost.parameters(mlp) * 4, probe["bandwidth"], 0.0, overhead,
        0.0).communication
    texts.append("{} tasks: {:.1f} ms predicted, the step {:.1f} ms longer "
                 "than at 1 task".format(
                     tasks, 1000 * predicted,
                     1000 * (medians[cluster_runs.key("replicate", tasks)] -
                             medians["replicate x1"])))
  return ("The model against this machine's own replicate runs (the MLP's "
          "{:.2f} MB, its {} collectives a step, the measured overhead and "
          "throughput; no network latency): {}. The step also grows "
          "because the tasks share the 2 cores and each runs its own "
          "graph, so the prediction is the communication's share of the "
          "growth, not all of it.".format(
              cost.parameters(mlp) * 4 / 1e6, sum(collectives.values()),
              "; ".join(texts)))


def described(collectives):
  """"2 all-reduce, 1 all-gather": the kinds of collective counted."""
  return ", ".join("{} {}".format(n, kind) for kind, n in collectives.items()
                   if n)
