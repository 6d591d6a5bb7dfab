"""A cost model of one synchronous training step on a real cluster.

A step is the model's own compute on each GPU, then the sum of the
gradients over every GPU of every machine. The sum is a ring all-reduce
among K members: each member sends (and receives) 2(K-1)/K of the
gradient bytes S, in 2(K-1) ring steps, so over a link of bandwidth B
with a latency of λ a hop, and with a software overhead α for each
collective op, the step's communication takes

    t_comm = 2(K-1)/K * S / B  +  rounds * 2(K-1) * λ
             + α_first + (collectives - 1) * α_more

where `collectives` is how many collective ops the step runs, `rounds`
how many of them must run one after the other (the others run
concurrently: TensorFlow's executor starts every collective whose inputs
are ready), α_first the cost of a collective alone and α_more that of each
further one run alongside it. α_first and α_more are measured on this
machine (`benchmarks.across_workers`'s probe, cross-process
`CollectiveReduceV2` over gRPC on loopback); S, K and the collectives are
counted; B, λ and the compute time are assumptions, stated with the
table.

Two arrangements of M machines of G GPUs each are modelled:

- `flat ring`: every GPU is a ring member (K = M * G), as Horovod and
  NCCL arrange it. A ring laid machine by machine crosses each machine's
  network link once each way, so that link carries 2(K-1)/K * S. The
  gradients travel in fused buffers (Horovod's 64 MiB fusion buffer:
  ceil(S / 64 MiB) collectives, one after the other).
- `replicate`: each machine first sums its towers' gradients locally, then
  one device per machine joins the ring (K = M), with one collective per
  dtype pack of small gradients, one per large gradient, one for the
  statistics (batch-norm moving means and variances, packed), one for the
  loss, and
  an all-gather of the rows before the step (`replicate.communication
  .allreduce` and `replicate.cluster`): two rounds, the gather, then
  everything else.

The step is then `compute + t_comm` if communication waits for the whole
backward pass (no overlap), or `max(compute, forward + t_comm)` if it
overlaps with the backward pass entirely (`backward_share` of the
compute); the truth lies between. Scaling efficiency is compute / step:
the images a second of K GPUs over K times one GPU's.

What the model leaves out: the sum inside a machine (over NVLink or PCIe,
assumed much faster than the network), contention between the NCCL rings
or gRPC streams that share a link, the optimizer's update, the input
pipeline, stragglers, and whether TensorFlow's gRPC collectives reach the
link's bandwidth at all (the `replicate` rows at the throughput measured
here show what happens if they do not).

The CTR part at the end models what a click-through-rate model's
embedding gradient costs to synchronise (summed densely, all-gathered as
slices, or through ps tasks beside an all-reduced MLP): bytes on each link
phase by phase, collectives, memory; `benchmarks.ctr_cost` renders it.
"""

import math
from typing import Dict, List, NamedTuple, Sequence, Tuple

FLOAT32_BYTES = 4
GBIT_BYTES = 1e9 / 8  # bytes a second in one Gb/s
PACK_MAX_ELEMENTS = 32768  # replicate.communication.allreduce's
HOROVOD_FUSION_BYTES = 64 * 2**20  # Horovod's default fusion buffer


# --- models: the shapes of their trainable variables -------------------------


def mlp_shapes(inputs: int, hidden: Sequence[int], classes: int
              ) -> List[Tuple[int, ...]]:
  """Kernels and biases of a dense MLP, inputs-hidden...-classes."""
  shapes, width = [], inputs
  for units in list(hidden) + [classes]:
    shapes += [(width, units), (units,)]
    width = units
  return shapes


def resnet50_shapes() -> Tuple[List[Tuple[int, ...]], int]:
  """ResNet-50's trainable shapes (v1.5, convolutions without biases,
  batch norm's scale and offset, the 1000-way classifier) and its number
  of batch-norm layers, each with a moving mean and variance."""
  shapes, norms = [], 0

  def conv(size, inputs, outputs):
    nonlocal norms
    shapes.extend([(size, size, inputs, outputs), (outputs,), (outputs,)])
    norms += 1

  conv(7, 3, 64)
  inputs = 64
  for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
    for block in range(blocks):
      conv(1, inputs, width)
      conv(3, width, width)
      conv(1, width, 4 * width)
      if block == 0:
        conv(1, inputs, 4 * width)  # the shortcut's projection
      inputs = 4 * width
  shapes += [(inputs, 1000), (1000,)]
  return shapes, norms


def parameters(shapes: Sequence[Tuple[int, ...]]) -> int:
  return sum(math.prod(shape) for shape in shapes)


def replicate_collectives(shapes: Sequence[Tuple[int, ...]],
                          statistics: int = 0) -> Dict[str, int]:
  """The cross-task collectives of one `replicate` step, by what they sum.

  Dense float32 gradients of at most PACK_MAX_ELEMENTS elements share one
  packed all-reduce, each larger one has its own; the statistic writes
  (UPDATE_OPS: `statistics` of them) share one; the loss has one; the rows
  one all-gather.
  """
  large = sum(math.prod(shape) > PACK_MAX_ELEMENTS for shape in shapes)
  packs = 1 if large < len(shapes) else 0
  return {"packed gradients": packs, "large gradients": large,
          "statistics": 1 if statistics else 0, "loss": 1,
          "rows (all-gather)": 1}


# --- the model ---------------------------------------------------------------


class Overhead(NamedTuple):
  """Seconds of software cost: one collective alone, each further one."""
  first: float
  more: float


class Arrangement(NamedTuple):
  """Who is in the ring and how many collectives a step runs."""
  name: str
  members: int  # K
  collectives: int
  rounds: int  # collectives that must run one after the other


class Step(NamedTuple):
  compute: float  # seconds
  transfer: float
  latency: float
  overhead: float
  no_overlap: float  # the step, communication after the backward pass
  overlap: float  # the step, communication during the backward pass

  @property
  def communication(self) -> float:
    return self.transfer + self.latency + self.overhead

  @property
  def efficiency_no_overlap(self) -> float:
    return self.compute / self.no_overlap

  @property
  def efficiency_overlap(self) -> float:
    return self.compute / self.overlap


def ring_bytes_per_member(total_bytes: float, members: int) -> float:
  """What each member of a ring all-reduce of `total_bytes` sends."""
  if members < 1:
    raise ValueError("A ring has at least 1 member; got {}.".format(members))
  return 2 * (members - 1) / members * total_bytes


def flat_ring(machines: int, gpus: int, gradient_bytes: float) -> Arrangement:
  collectives = max(1, math.ceil(gradient_bytes / HOROVOD_FUSION_BYTES))
  return Arrangement("flat ring", machines * gpus, collectives, collectives)


def replicate_ring(machines: int, collectives: int) -> Arrangement:
  return Arrangement("replicate", machines, collectives, 2)


def step(arrangement: Arrangement, gradient_bytes: float,
         bandwidth: float, hop_latency: float, overhead: Overhead,
         compute: float, backward_share: float = 2 / 3) -> Step:
  """One step's times, in seconds; `bandwidth` in bytes a second."""
  members = arrangement.members
  transfer = ring_bytes_per_member(gradient_bytes, members) / bandwidth
  if members == 1:  # nothing crosses the network
    latency = cost = 0.0
  else:
    latency = arrangement.rounds * 2 * (members - 1) * hop_latency
    cost = overhead.first + (arrangement.collectives - 1) * overhead.more
  communication = transfer + latency + cost
  forward = compute * (1 - backward_share)
  return Step(compute, transfer, latency, cost, compute + communication,
              max(compute, forward + communication))


# --- a CTR step: sparse traffic ----------------------------------------------
#
# A click-through-rate model: F categorical fields, each id a row of one
# embedding table of V rows x d float32 (26 tables of V rows in all move the
# same bytes), an MLP on top; each of K workers (one device, one network
# link each) trains b rows a step, so it looks up F x b ids, of which `rows`
# are distinct. What the embedding's gradient costs to synchronise:
#
# - `all-dense`: the table's gradient summed as a dense V x d tensor (today's
#   `replicate` across tasks): a ring all-reduce of the table and the MLP.
# - `all-gather`: each worker's slices (an int64 index and d floats a row)
#   all-gathered, every worker applying every worker's slices to its own
#   full copy: a ring all-gather, each member sending and receiving (K-1)
#   x rows x (4d + 8) B, the MLP all-reduced beside it.
# - `hybrid`: the table sharded over P ps tasks (own machines, own links,
#   rows spread evenly over them), the MLP all-reduced among the workers.
#   Each worker sends every id it looks up to the ps (8 B each, as
#   `embedding_lookup` does: measured), gets a row back for each (4d B),
#   and after backward its distinct rows' slices reach the ps one of two
#   ways: `gathered`, all-gathered among the workers, then the chief pushes
#   all K workers' slices to the ps and applies them there, or `straight`,
#   each worker sends its own slices to the ps that hold their rows (as
#   into a `SparseConditionalAccumulator`), where they are summed and
#   applied once all K arrived. Both end with a collective barrier.
#
# Links are full duplex: a phase takes its busiest link's max(bytes out,
# bytes in) / bandwidth, and the phases of a step run one after the other.
# Nothing overlaps the compute: the embedding's gradient is the backward
# pass's last, and the rows must be read before the forward pass.

INDEX_BYTES = 8  # an int64 row id


class Ctr(NamedTuple):
  """A CTR model's step on each worker."""
  rows: int  # V: embedding rows in all
  dim: int  # d
  fields: int  # F: ids an example (one a field)
  batch: int  # b: examples a worker a step
  unique: float  # distinct rows among a worker's F x b ids
  mlp: Tuple[Tuple[int, ...], ...]  # the dense layers' shapes
  compute: float  # seconds of a worker's forward and backward pass
  slots: int = 1  # optimizer slots of the table's size: Adagrad 1, Adam 2

  @property
  def ids(self) -> int:
    return self.fields * self.batch

  @property
  def touched(self) -> int:
    return round(self.unique * self.ids)

  @property
  def slice_bytes(self) -> int:
    return FLOAT32_BYTES * self.dim + INDEX_BYTES

  @property
  def table_bytes(self) -> int:
    return self.rows * self.dim * FLOAT32_BYTES

  @property
  def mlp_bytes(self) -> int:
    return parameters(self.mlp) * FLOAT32_BYTES


class Traffic(NamedTuple):
  """What one scheme's step moves and holds; bytes a step."""
  scheme: str
  sent: float  # by a worker (not the chief)
  received: float
  busiest: str  # the link that carries most: "a worker", "the chief", "a ps"
  busiest_bytes: float  # max(out, in) on it
  phases: Tuple[float, ...]  # the busiest link's max(out, in), phase by phase
  collectives: int  # among the workers
  rounds: int  # of them, one after the other
  exchanges: int  # worker-ps request and reply, one after the other
  ps_messages: int  # transfers a worker (or the chief) makes to the ps
  worker_memory: float  # bytes a worker holds: variables, slots, buffers
  ps_memory: float  # bytes a ps task holds


def _mlp_collectives(ctr: Ctr) -> int:
  return sum(replicate_collectives(ctr.mlp).values())


def all_dense(ctr: Ctr, workers: int) -> Traffic:
  summed = ring_bytes_per_member(ctr.table_bytes + ctr.mlp_bytes, workers)
  collectives = sum(replicate_collectives(
      list(ctr.mlp) + [(ctr.rows, ctr.dim)]).values())
  # The table, its slots, and its dense gradient; the MLP's likewise.
  memory = (ctr.table_bytes + ctr.mlp_bytes) * (2 + ctr.slots)
  return Traffic("all-dense", summed, summed, "a worker", summed, (summed,),
                 collectives, 2, 0, 0, memory, 0.0)


def all_gather(ctr: Ctr, workers: int, rows: int,
               scheme: str = "all-gather") -> Traffic:
  """`rows`: the slices a worker puts on the wire (padding included)."""
  moved = ((workers - 1) * rows * ctr.slice_bytes +
           ring_bytes_per_member(ctr.mlp_bytes, workers))
  # The MLP's, then a gather of the lengths, of the indices, of the values;
  # rounds: the batch rows, the lengths, the rest.
  collectives = _mlp_collectives(ctr) + 3
  memory = (ctr.table_bytes * (1 + ctr.slots) + ctr.mlp_bytes *
            (2 + ctr.slots) + workers * rows * ctr.slice_bytes)
  return Traffic(scheme, moved, moved, "a worker", moved, (moved,),
                 collectives, 3, 0, 0, memory, 0.0)


def hybrid(ctr: Ctr, workers: int, ps: int, gathered: bool) -> Traffic:
  """The hybrid's step, its slices `gathered` (the chief pushes them) or
  sent straight to the ps by each worker."""
  k = workers
  # The lookups send every id and get a row back for each (as
  # `embedding_lookup` does, measured on the CTR benchmark: no unique
  # first); the slices are the distinct rows' (each task sums its
  # duplicates before they leave it).
  ids, looked_up = ctr.ids * INDEX_BYTES, ctr.ids * FLOAT32_BYTES * ctr.dim
  slices, mlp = ctr.touched * ctr.slice_bytes, ring_bytes_per_member(
      ctr.mlp_bytes, k)
  lookup = (max(ids, k * ids / ps), max(looked_up, k * looked_up / ps))
  ps_in = k * (ids + slices) / ps
  ps_memory = ctr.table_bytes * (1 + ctr.slots) / ps + k * slices / ps
  worker_memory = ctr.mlp_bytes * (2 + ctr.slots) + 2 * looked_up
  if gathered:
    gather = (k - 1) * slices + mlp
    sent, received = ids + gather, looked_up + gather
    chief = sent + k * slices
    phases = lookup + (gather, max(k * slices, k * slices / ps))
    return Traffic("hybrid (gathered)", sent, received, "the chief",
                   max(chief, received), phases,
                   _mlp_collectives(ctr) + 3 + 1, 4, 2, 2 * ps,
                   worker_memory + k * slices, ps_memory)
  sent, received = ids + slices + mlp, looked_up + mlp
  phases = lookup + (max(sent - ids, k * slices / ps),)
  busiest = max((max(sent, received), "a worker"),
                (max(ps_in, k * looked_up / ps), "a ps"))
  # The MLP's collectives, then a barrier after the ps's apply.
  return Traffic("hybrid (straight)", sent, received, busiest[1], busiest[0],
                 phases, _mlp_collectives(ctr) + 1, 3, 2, 2 * ps,
                 worker_memory, ps_memory)


class CtrStep(NamedTuple):
  compute: float  # seconds
  transfer: float
  latency: float
  overhead: float

  @property
  def step(self) -> float:
    return self.compute + self.transfer + self.latency + self.overhead

  @property
  def efficiency(self) -> float:
    return self.compute / self.step


def ctr_step(traffic: Traffic, workers: int, bandwidth: float,
             hop_latency: float, overhead: Overhead,
             compute: float) -> CtrStep:
  """A CTR step's times, in seconds; `bandwidth` in bytes a second. A
  collective round costs 2(K-1) hops, a worker-ps exchange 2; the first
  collective α_first, every further collective or ps transfer α_more."""
  if workers == 1 and not traffic.ps_messages:
    return CtrStep(compute, 0.0, 0.0, 0.0)
  latency = (traffic.rounds * 2 * (workers - 1) + 2 * traffic.exchanges
             ) * hop_latency
  cost = overhead.first + (traffic.collectives - 1 +
                           traffic.ps_messages) * overhead.more
  return CtrStep(compute, sum(traffic.phases) / bandwidth, latency, cost)
