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
