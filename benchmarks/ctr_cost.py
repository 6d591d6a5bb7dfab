"""python -m benchmarks.ctr_cost: a CTR step on a real cluster, on paper.

Prints the `### A CTR step on a real cluster: sparse traffic` subsection:
`benchmarks.step_cost_model`'s prediction of the step time, scaling
efficiency, examples/sec, bytes on the links and memory of a CTR model with
a 100M-row embedding table at 16 workers on 25 and 100 Gb/s links, for
three ways of synchronising the embedding's gradient: summed densely,
all-gathered as slices, and the hybrid (the table on ps tasks, the MLP
all-reduced). Nothing here runs TensorFlow.

The per-collective overhead is the one `benchmarks.across_workers`
measured (its 2-task probe, kept in `--results`); without one it is taken
as 0. The subsection is part of RESULTS.md's `## Across workers` section:
`python -m benchmarks.across_workers --redraw --record
benchmarks/RESULTS.md` writes it there with this module's defaults. The
flags below print it under other assumptions.
"""

import argparse
import sys

from benchmarks import across_workers_cost, cli, results_md
from benchmarks import step_cost_model as cost

HEADING = "### A CTR step on a real cluster: sparse traffic"
WORKERS = 16
PS_TASKS = 4
LINKS_GBIT = (25, 100)
HOP_LATENCY = 25e-6  # seconds a hop, as for ResNet-50 (across_workers)
DENSE_FEATURES = 13  # Criteo's numeric features, fed to the MLP
HIDDEN = (1024, 512, 256)
SENSITIVITY = ((0.1, None), (1.0, None), (None, 0.1))  # (unique, compute)


def ctr_model(rows=100_000_000, dim=16, fields=26, batch=4096, unique=0.5,
              compute=0.020, slots=1) -> cost.Ctr:
  """The model the subsection assumes (each argument its default)."""
  mlp = tuple(cost.mlp_shapes(fields * dim + DENSE_FEATURES, HIDDEN, 1))
  return cost.Ctr(rows, dim, fields, batch, unique, mlp, compute, slots)


def schemes(ctr, workers=WORKERS, ps=PS_TASKS):
  """Each scheme's traffic: what it sends, in what phases, what it holds."""
  return [cost.all_dense(ctr, workers),
          cost.all_gather(ctr, workers, ctr.ids, "all-gather (static cap)"),
          cost.all_gather(ctr, workers, ctr.touched,
                          "all-gather (distinct rows)"),
          cost.hybrid(ctr, workers, ps, gathered=True),
          cost.hybrid(ctr, workers, ps, gathered=False)]


def rows(ctr, overhead, workers=WORKERS, ps=PS_TASKS, links=LINKS_GBIT):
  """One dict a (scheme, link): its traffic and predicted step."""
  found = []
  for traffic in schemes(ctr, workers, ps):
    for gbit in links:
      found.append({"traffic": traffic, "link": gbit, "step": cost.ctr_step(
          traffic, workers, gbit * cost.GBIT_BYTES, HOP_LATENCY, overhead,
          ctr.compute)})
  return found


def table(found, ctr, workers=WORKERS):
  lines = ["| scheme | link | MB a worker sends | MB a worker receives | "
           "busiest link: MB (out or in) | transfer ms | latency + overhead "
           "ms | step ms | efficiency | examples/sec, {} workers |".format(
               workers), "|---|---|---|---|---|---|---|---|---|---|"]
  for row in found:
    traffic, step = row["traffic"], row["step"]
    lines.append(
        "| {} | {} Gb/s | {:,.1f} | {:,.1f} | {}: {:,.1f} | {:,.1f} | "
        "{:.2f} | {:,.1f} | {:.0%} | {:,.0f} |".format(
            traffic.scheme, row["link"], traffic.sent / 1e6,
            traffic.received / 1e6, traffic.busiest,
            traffic.busiest_bytes / 1e6, 1000 * step.transfer,
            1000 * (step.latency + step.overhead), 1000 * step.step,
            step.efficiency, workers * ctr.batch / step.step))
  return "\n".join(lines)


def memory_table(ctr, workers=WORKERS, ps=PS_TASKS):
  lines = ["| scheme | a worker holds, GB | a ps task holds, GB |",
           "|---|---|---|"]
  for traffic in schemes(ctr, workers, ps):
    lines.append("| {} | {:.2f} | {} |".format(
        traffic.scheme, traffic.worker_memory / 1e9,
        "{:.2f}".format(traffic.ps_memory / 1e9) if traffic.ps_memory
        else "-"))
  return "\n".join(lines)


SUMMARY = (("all-dense", "all-dense"),
           ("all-gather (distinct rows)", "all-gather of distinct rows"),
           ("hybrid (straight)", "the hybrid, slices straight to the ps"))


def summary(found):
  """docs/benchmarks.md's sentence: SUMMARY's efficiencies on each link."""
  efficiency = {(r["traffic"].scheme, r["link"]): r["step"].efficiency
                for r in found}
  parts = []
  for number, gbit in enumerate(LINKS_GBIT):
    figures = ["{:.0f} %{}".format(100 * efficiency[(scheme, gbit)], (
        " ({})".format(name) if number == 0 else ""))
               for scheme, name in SUMMARY]
    parts.append("{} and {} at {} Gb/s".format(", ".join(figures[:-1]),
                                                 figures[-1], gbit))
  return ", and ".join(parts)


def _efficiencies(ctr, overhead, workers, ps):
  found = rows(ctr, overhead, workers, ps, links=(LINKS_GBIT[0],))
  return ", ".join("{} {:.0%}".format(r["traffic"].scheme,
                                      r["step"].efficiency) for r in found)


def section(overhead=None, ctr=None, workers=WORKERS, ps=PS_TASKS):
  """The subsection's lines; `overhead`: the measured `cost.Overhead`."""
  ctr = ctr or ctr_model()
  measured = overhead is not None
  overhead = overhead or cost.Overhead(0.0, 0.0)
  mlp = cost.parameters(ctr.mlp)
  lines = [
      HEADING, "",
      "`benchmarks/step_cost_model.py` (its CTR part says the model): K "
      "workers, each one device with its own link, train a CTR model: "
      "{fields} categorical fields, each id a row of {rows:,} x {dim} "
      "float32 embeddings in all, an MLP on top. A worker's {batch:,} "
      "examples a step look up F x b = {ids:,} ids, {touched:,} of them "
      "distinct rows. A slice is an int64 index and d floats, 4d + 8 = "
      "{slice} B. `all-dense`: the table's gradient summed as a dense V x d "
      "tensor, as replicate does across tasks today: a ring all-reduce of "
      "the table and the MLP, 2(K-1)/K x (V x d x 4 + MLP) B a link. "
      "`all-gather`: every worker's slices all-gathered and applied by "
      "every worker to its own full copy, (K-1) x rows x (4d + 8) B a link "
      "each way, plus the MLP's all-reduce; `static cap` pads every worker "
      "to F x b rows (one fixed shape: a graph's `CollectiveGatherV2` "
      "keeps the shape of its first run), `distinct rows` sends the distinct "
      "rows only (a lookup through `tf.unique`, as `embedding_lookup_"
      "sparse` does, or duplicates summed before sending, gathered at the "
      "step's longest). `hybrid`: the table sharded over P = {ps} ps tasks "
      "on machines of their own, the MLP all-reduced among the workers; "
      "each worker sends every id it looks up to the ps (8 B each) and "
      "gets a row back for each (4d B) before its forward pass, as "
      "`embedding_lookup` does (no unique first: the bytes measured on "
      "loopback in `Across workers: a CTR model` are these); after "
      "backward its distinct rows' slices (each task sums its duplicates "
      "first) reach the ps either `gathered` (all-gathered among the "
      "workers, then the chief sends all K workers' slices to the ps and "
      "applies them there, as replicate's hybrid does where the "
      "`model_fn` reads the gradients, a clip by global norm) or "
      "`straight` (each worker sends its own slices to the ps that hold "
      "their rows, into a `SparseConditionalAccumulator` there, summed and "
      "applied once all K arrived, as replicate's hybrid does otherwise); "
      "then a 1-float all-reduce is the barrier before the "
      "next lookup. Links are full duplex: each phase (lookup ids, rows "
      "back, slices out, the chief's push) takes its busiest link's "
      "max(out, in) / bandwidth, one phase after the other; no "
      "communication overlaps compute, since the embedding's gradient is "
      "the backward pass's last and the rows must arrive before the "
      "forward pass. Latency: 2(K-1) hops a round of collectives "
      "(dense 2 rounds, all-gather 3, hybrid 3 or 4), 2 hops for each of "
      "the hybrid's 2 worker-ps exchanges (lookup, slices); overhead: the "
      "first collective's, then each further "
      "collective or ps transfer (P for the lookups, P for the slices) "
      "costs the further one's. Efficiency = compute / step; examples/sec "
      "= K x b / step.".format(
          fields=ctr.fields, rows=ctr.rows, dim=ctr.dim, batch=ctr.batch,
          ids=ctr.ids, touched=ctr.touched, slice=ctr.slice_bytes, ps=ps),
      "",
      "Assumptions: K = {workers} workers; V = {rows:,} rows, d = {dim} "
      "(the table {table:.1f} GB); an MLP {inputs}-{hidden}-1 on the "
      "{fields} embeddings and {dense} numeric features ({mlp:,} "
      "parameters, {mlp_mb:.2f} MB); Adagrad, so one slot the table's "
      "size; {unique:.0%} of a worker's ids are distinct rows (an "
      "assumption, not measured: a Zipf-like click log repeats its hot "
      "ids within a batch, and a few fields have only a handful of "
      "values; the sparse schemes' bytes scale with it, below), every "
      "worker the same; each worker's forward and backward pass takes "
      "{compute:.0f} ms for its {batch:,} examples (about {rate:,.0f} "
      "examples/sec a worker, a GPU's order; an assumption, not checked "
      "against a published table); ids hashed so that rows spread evenly "
      "over the ps tasks; {hop:.0f} us a hop. {overhead}".format(
          workers=workers, rows=ctr.rows, dim=ctr.dim,
          table=ctr.table_bytes / 1e9, inputs=ctr.fields * ctr.dim +
          DENSE_FEATURES, hidden="-".join(str(h) for h in HIDDEN),
          fields=ctr.fields, dense=DENSE_FEATURES, mlp=mlp,
          mlp_mb=mlp * 4 / 1e6, unique=ctr.unique,
          compute=1000 * ctr.compute, batch=ctr.batch,
          rate=ctr.batch / ctr.compute, hop=HOP_LATENCY * 1e6,
          overhead=(
              "Overhead: {:.2f} ms for the first collective, {:.2f} ms for "
              "each further one, as measured on loopback above (2 tasks, "
              "without an op timeout; `Collectives timed alone`), ps "
              "transfers taken as costing the same.".format(
                  1000 * overhead.first, 1000 * overhead.more) if measured
              else "No overhead was measured (no 2-task probe), so it is "
              "taken as 0.")), "",
      table(rows(ctr, overhead, workers, ps), ctr, workers), "",
      "Memory, for the same step: a worker's variables, their Adagrad "
      "slot and gradient buffers (all-dense: a dense gradient the table's "
      "size; all-gather: every worker's slices; hybrid: its rows and their "
      "gradient, and under `gathered` every worker's slices); a ps task "
      "its shard of the table and slot and the step's slices:", "",
      memory_table(ctr, workers, ps), "",
      "So all-dense and all-gather hold a full copy of the table and its "
      "slot on every worker, {:.1f} GB and more, which grows with V and d "
      "(at d = 64, {:.1f} GB; Adam's second slot adds a table's size): a "
      "large host's memory, and all-dense's more than a 16 GB GPU holds; "
      "the hybrid's worker holds the MLP and its rows only, and P ps tasks "
      "share the table.".format(
          ctr.table_bytes * (1 + ctr.slots) / 1e9,
          ctr._replace(dim=64).table_bytes * (1 + ctr.slots) / 1e9), "",
      "Sensitivity, efficiency at {} Gb/s: {}.".format(LINKS_GBIT[0], "; ".join(
          "with {}: {}".format(
              "{:.0%} distinct rows".format(unique) if unique else
              "{:.0f} ms of compute (a CPU worker's order)".format(
                  1000 * compute),
              _efficiencies(ctr._replace(
                  unique=unique or ctr.unique,
                  compute=compute or ctr.compute), overhead, workers, ps))
          for unique, compute in SENSITIVITY)), "",
      "What the model leaves out: the optimizer's apply (all-gather: K x "
      "rows on every worker's copy; hybrid: on the ps, before the "
      "barrier), the dense sum's own arithmetic over V x d, skew (hot rows "
      "on one ps shard, one worker with more distinct rows: every step "
      "waits for the largest), contention between the MLP's all-reduce "
      "and the slices on one link, whether TensorFlow's gRPC reaches the "
      "link's bandwidth at all (not measured: the ResNet-50 table's "
      "`loopback here` rows show what a slower transport costs), and that "
      "the {} ps tasks are machines beyond the workers the efficiency "
      "counts.".format(ps)]
  return lines


def unique_fraction(text):
  try:
    value = float(text)
  except ValueError:
    value = None
  if value is None or not 0 < value <= 1:
    raise argparse.ArgumentTypeError(
        "must be a fraction above 0 and at most 1; received {!r}".format(
            text))
  return value


def make_parser():
  parser = cli.parser("python -m benchmarks.ctr_cost", __doc__.split(
      "\n\n")[0])
  parser.add_argument("--results", default="benchmarks/RESULTS.md",
                      help="the RESULTS.md whose across_workers probe "
                      "gives the per-collective overhead")
  parser.add_argument("--workers", type=cli.whole_number(1), default=WORKERS,
                      help="workers, one device and one link each")
  parser.add_argument("--ps", type=cli.whole_number(1), default=PS_TASKS,
                      help="ps tasks of the hybrid")
  parser.add_argument("--rows", type=cli.whole_number(1),
                      default=100_000_000, help="embedding rows in all")
  parser.add_argument("--dim", type=cli.whole_number(1), default=16,
                      help="the embeddings' width d")
  parser.add_argument("--batch", type=cli.whole_number(1), default=4096,
                      help="examples a worker a step")
  parser.add_argument("--unique", type=unique_fraction, default=0.5,
                      help="the fraction of a worker's ids that are "
                      "distinct rows")
  parser.add_argument("--compute-ms", type=cli.positive_number, default=20.0,
                      help="a worker's forward and backward pass")
  return parser


def main(argv=None):
  parser = make_parser()
  args = parser.parse_args(argv)
  try:
    with open(args.results) as results:
      data = results_md.read_data(results.read(),
                                  across_workers_cost.DATA)
  except FileNotFoundError:
    parser.error("argument --results: no file {!r}; name a RESULTS.md "
                 "(benchmarks/RESULTS.md from the repository's root)".format(
                     args.results))
  probe = data and across_workers_cost.probe_figures(data["probes"].get(
      "2", []))
  ctr = ctr_model(rows=args.rows, dim=args.dim, batch=args.batch,
                  unique=args.unique, compute=args.compute_ms / 1000)
  print("\n".join(section(probe["untimed"] if probe else None, ctr,
                          args.workers, args.ps)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
