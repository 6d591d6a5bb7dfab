"""The row analysis: where a tower's rows are in each tensor it computes.

On what it knows of a tensor (a `Fact`):
- `kind` and `axis`: how the tower's rows lie along one axis. ALIGNED:
  index i along `axis` is row i (the shard itself, `tf.range(rows)`).
  BLOCKED: the axis holds rows * k entries, row-major (`tf.reshape(x, [-1,
  d])` of a `[rows, length, d]` tensor): entry p is row p // k (`block`:
  what k is made of, where known). SELECTED:
  the entries along `axis` are an order-kept selection of the rows' entries
  (`tf.where(mask)`, a `SparseTensor`'s values, `tf.gather_nd(x,
  tf.where(mask))`), each labelled by the index tensor `source`. NONE: no
  axis of rows (a value that does not depend on the rows, or one reduced
  over them: those are the batch reductions' and the metrics' rule).
  UNKNOWN: it depends on the rows and the analysis cannot tell along which
  axis: the index rules take any axis as possibly the rows'.
- `ids` (integer tensors): ROW when each value is the row its own entry
  belongs to (`tf.range(rows)`, a `SparseTensor`'s `indices[:, 0]`); BPOS
  when each value is its entry's position along a BLOCKED axis (`tf.where`
  of a `[rows * k]` mask); STARTS when each is its row's first position
  (`tf.range(rows) * k`, which plus an offset within the row is BPOS, as
  BERT's flat positions are). `component`: which entry of the last axis
  holds them (the index tuples of `tf.gather_nd` and `tf.scatter_nd`), or
  None for the value itself.
- `dims`: for a shape-like integer scalar or vector, what each entry counts
  (ROWS, ROWS_K: rows times something, SELECTED_COUNT, a known number, or
  OTHER), so that `tf.shape(x)[0]` is told from `tf.shape(x)[1]`.

On loops: a TF 2 `While` by its body (`replicate.graph.loop_layout`), a
TF 1 loop by its frame's Merges (`replicate.graph.frame_layout`): each
until its variables' facts agree from one step to the next, the same
facts either way; lists (TensorLists, TF 1 TensorArrays) hold their
elements' facts.

On cost: one pass forward over the ops the tower built, each op's facts
computed once from its inputs' (iterative, memoized): linear in the graph,
a loop's body followed at most `loop_layout.ROUNDS` times more.
"""

import collections

import tensorflow as tf

from replicate import graph_walk
from replicate.graph import frame_layout
from replicate.graph import layout_ops
from replicate.graph import loop_layout
from replicate.graph import static_layout
from replicate.graph.row_facts import (
    ALIGNED, NONE, NO_ROWS, OTHER, ROW, ROWS, ROWS_K, ROWS_PLUS, SELECTED,
    SELECTED_COUNT, UNKNOWN_ROWS, Fact)


class RowLayout:
  """The facts of the tensors one tower computed.

  Args:
    shard: the tower's features and labels (any structure; `SparseTensor`s
      too).
    within: the ops the tower built; inputs from elsewhere have no rows.
    depends: `replicate.shard.rows.TowerRows.depend`-like: whether values
      depend on the rows (a tensor that does not has no rows: NO_ROWS).
    static_rows: the shard's row count when known at build time (a shape
      TensorFlow folded to a constant counts it).
    outer: for the body of a TF 1 loop followed in one round of its
      fixpoint (`replicate.graph.frame_layout`): the layout that found the
      loop, whose facts hold here; what is found here stays here.
  """

  def __init__(self, shard, within, depends, static_rows=None, outer=None):
    self._within = within
    self._depends = depends
    self.static_rows = static_rows
    self._facts = ({} if outer is None else
                   collections.ChainMap({}, outer._facts))
    self._frames = {}  # a TF 1 loop's Merge: its `frame_layout.Frame`
    for leaf in tf.nest.flatten(shard, expand_composites=False):
      if isinstance(leaf, tf.SparseTensor):
        source = leaf.indices.ref()
        self._facts[leaf.indices.ref()] = Fact(
            SELECTED, 0, source, ROW, 0)
        self._facts[leaf.values.ref()] = Fact(SELECTED, 0, source)
        rank = leaf.dense_shape.shape[0]
        rank = tf.compat.dimension_value(rank) or 0
        self._facts[leaf.dense_shape.ref()] = Fact(
            dims=(ROWS,) + (OTHER,) * max(rank - 1, 0))
      elif isinstance(leaf, tf.Tensor) and leaf.shape.rank != 0:
        self._facts[leaf.ref()] = Fact(ALIGNED, 0)

  def fact(self, tensor: tf.Tensor) -> Fact:
    """What is known of `tensor`'s rows (computed once per op)."""
    if tensor.ref() not in self._facts:
      self._compute(tensor.op)
    return self._facts[tensor.ref()]

  def _compute(self, start: tf.Operation) -> None:
    """Facts of `start`'s outputs, and of every op before it not yet known,
    inputs first (an explicit stack: real models are deep). A TF 1 loop's
    Merge is computed after what enters its loop (`_reads`), by the
    fixpoint of `_loop_facts`, never through its back edge."""
    stack, on_path = [(start, iter(self._reads(start)))], {start}
    while stack:
      op, inputs = stack[-1]
      tensor = next(inputs, None)
      if tensor is not None:
        source = tensor.op
        if (tensor.ref() not in self._facts and source not in on_path and
            self._inside(source)):
          on_path.add(source)
          stack.append((source, iter(self._reads(source))))
        continue
      stack.pop()
      on_path.discard(op)
      if all(t.ref() in self._facts for t in op.outputs):
        continue
      for tensor, fact in zip(op.outputs, self._op_facts(op)):
        self._facts.setdefault(tensor.ref(), fact)

  def _inside(self, op) -> bool:
    return op in self._within

  def _reads(self, op):
    """The inputs to know before `op`: for a TF 1 loop's Merge, every
    Enter of its loop (its body reads nothing else from outside)."""
    if not frame_layout.is_loop_merge(op):
      return op.inputs
    frame = self._frame(op)
    if frame is None:
      return [t for t in op.inputs
              if t.op.type not in frame_layout.NEXT_ITERATION]
    return frame.entries

  def _frame(self, merge):
    if merge not in self._frames:
      self._frames[merge] = frame_layout.frame_of(merge)
    return self._frames[merge]

  def _loop_facts(self, merge):
    """The facts of a TF 1 loop's variables (`merge`'s and its loop's
    others'): `replicate.graph.frame_layout`'s fixpoint."""
    frame = self._frame(merge)
    if frame is None:
      return [UNKNOWN_ROWS if self._depends([merge]) else NO_ROWS, NO_ROWS]
    facts = [self.fact(frame_layout.enter_of(m)) for m in frame.merges]
    for _ in range(loop_layout.ROUNDS):
      body = RowLayout((), self._within, self._depends, self.static_rows,
                       outer=self)
      for other, fact in zip(frame.merges, facts):
        body.given(other.outputs[0], fact)
        body.given(other.outputs[1], NO_ROWS)  # the input's index
      joined = [loop_layout.join(fact, body.fact(frame_layout.back_edge(m)))
                for m, fact in zip(frame.merges, facts)]
      if joined == facts:  # the body as followed holds: keep its facts
        self._facts.update(body._facts.maps[0])
        return [self._facts[t.ref()] for t in merge.outputs]
      facts = joined
    for other, fact in zip(frame.merges, facts):
      self.given(other.outputs[0], fact if fact.kind == NONE else
                 UNKNOWN_ROWS)
      self.given(other.outputs[1], NO_ROWS)
    return [self._facts[t.ref()] for t in merge.outputs]

  def input_fact(self, tensor: tf.Tensor) -> Fact:
    """An input's fact during the pass (outside the tower: no rows; not
    known yet, which only a loop not as `tf.while_loop` builds it leaves:
    UNKNOWN if it depends on the rows)."""
    known = self._facts.get(tensor.ref())
    if known is not None:
      return known
    if not self._inside(tensor.op):
      return static_layout.constant_fact(tensor, self.static_rows)
    return UNKNOWN_ROWS if self._depends([tensor]) else NO_ROWS

  def _op_facts(self, op):
    if frame_layout.is_loop_merge(op):
      return self._loop_facts(op)
    if op.type == "Const":
      return [static_layout.constant_fact(op.outputs[0], self.static_rows)]
    positions = op.type == "Range" and static_layout.positions(
        op, self.static_rows)
    if positions:
      return [positions]
    inputs = [self.input_fact(t) for t in op.inputs]
    if not self._depends([op]) and not any(_about_rows(f) for f in inputs):
      return [static_layout.constant_fact(t, self.static_rows)
              if t.shape.rank in (0, 1) else static_layout.filled_fact(t)
              for t in op.outputs]
    try:
      facts = (loop_layout.calls_facts(self._of_body, op, inputs) or
               layout_ops.transfer(op, inputs))
    except (ValueError, TypeError, IndexError):  # an attr not as expected
      facts = None
    if facts is None:
      facts = layout_ops.default(op, inputs)
    facts = list(facts)
    if op.type == "Reshape" and facts and facts[0] == UNKNOWN_ROWS:
      facts[0] = static_layout.unblocked(op, inputs[0], self.static_rows)
    return facts + [UNKNOWN_ROWS] * (len(op.outputs) - len(facts))

  def _of_body(self, body, facts) -> "RowLayout":
    """The layout of a loop's body (a `FuncGraph`) given its arguments'
    facts: what depends on the rows is what the arguments with rows reach."""
    reached = graph_walk.ops_after(
        [arg for arg, fact in zip(body.inputs, facts) if fact.kind != NONE])
    layout = RowLayout((), frozenset(body.get_operations()),
                       lambda values: any(getattr(v, "op", v) in reached
                                          for v in values), self.static_rows)
    for arg, fact in zip(body.inputs, facts):
      layout.given(arg, fact)
    return layout

  def loop_body(self, op: tf.Operation):
    """(the ops of a TF 2 `While`'s body, its layout at the loop's
    fixpoint: its arguments' facts those of the loop's outputs), or None
    where the body is not known."""
    body = loop_layout.body_of(op)
    if body is None:
      return None
    return body.get_operations(), self._of_body(
        body, [self.fact(t) for t in op.outputs])

  def given(self, tensor: tf.Tensor, fact: Fact) -> None:
    """States `tensor`'s fact (a function's argument, given by its caller)."""
    self._facts[tensor.ref()] = fact

def _about_rows(fact: Fact) -> bool:
  """Whether a fact says something of the rows that an op not computed
  from their values passes on: rows along an axis, or a shape-like value
  counting them (a `SparseTensor`'s `dense_shape`, sliced and multiplied
  by `safe_embedding_lookup_sparse` into the shape it reshapes to)."""
  return fact.carries or bool(fact.dims and set(fact.dims) & {
      ROWS, ROWS_K, ROWS_PLUS, SELECTED_COUNT})
