"""The zoo's models whose rows meet, or whose outputs' width is the batch's.

Written as their authors write them, for one device: two-tower retrieval
with in-batch negatives (the one concession: `replicate.all_rows` and
`replicate.row_offset`, which do nothing unwrapped; without them the
wrapper refuses the model, see test_zoo_batch.py); a sequence tagger
(`dynamic_rnn` with `sequence_length`) cutting its tokens at the batch's
longest sequence (`x[:, :tf.reduce_max(lengths)]`) and predicting per
token; and a beam search (the Transformer's: `top_k` over the beams'
continuations, `gather_nd` of the beams) whose `tf.while_loop` stops when
the rows of its batch are done, finished rows emitting zeros.

Then index ops that keep each row to itself (issue 38), as their authors
write them: TF-Ranking's groupwise scoring (index tuples whose row part is
`tf.range(batch_size)`, the groups' scores scattered back to their own
list's row, `tf.reverse(tf.range(list_size))` for the items' order), the
Transformer's feed-forward layer with its padding removed (`tf.gather_nd`
of `tf.where(mask)` over the flattened positions, `tf.scatter_nd` back:
each tower's own tokens only), and the census wide & deep canned
estimators (compat.v1 and TF 2) with crossed columns.

`ENTRIES` holds `oracle_zoo._custom`'s arguments, one dict a model (see
oracle_zoo_losses.py); `CANNED` `oracle_zoo.ZooModel`'s fields. The sequences: lengths 2, 3, 5 | 1, 4, 5 | 5 (6
positions, the last always padding), so every batch of 3 rows, the
remainder's one row and the 7 rows together are 5 tokens wide (one
device's predictions stack across batches), while a tower's own rows are
narrower on 2 towers (rows 0 and 1: 3) and 3 towers (2, 3, 5; 4 + 3 rows:
5 and 5; 3 + 2 + 2: 5, 4, 5), and "3_small" (rows 0 and 1) is 3 wide.
"""

import numpy as np
import tensorflow as tf

import replicate

ROWS = 7
ModeKeys = tf.estimator.ModeKeys
VOCAB, TAGS, WIDTH = 7, 4, 6
LENGTHS = np.array([2, 3, 5, 1, 4, 5, 5], np.int64)
MANY_TOWERS = ("2", "3", "3_small")


def _fixed(shape, dtype=tf.float32):
  return tf.io.FixedLenFeature(shape, dtype)


# ---------------------------------------------------------------------------
# Two-tower retrieval, in-batch negatives.


def _tower(inputs, name):
  hidden = tf.compat.v1.layers.dense(inputs, 8, activation=tf.nn.relu,
                                     name=name + "_hidden")
  return tf.nn.l2_normalize(
      tf.compat.v1.layers.dense(hidden, 4, name=name + "_embedding"), -1)


def retrieval_model_fn(features, labels, mode, params):
  """Each query's document is its own row's; the batch's other documents
  are its negatives. `params["all_rows"]`: False is the model as written
  for one device, which the wrapper refuses."""
  del labels
  query = _tower(features["query"], "query")
  document = _tower(features["document"], "document")
  documents, first = document, 0
  if params["all_rows"]:
    documents, first = replicate.all_rows(document), replicate.row_offset()
  logits = tf.matmul(query, documents, transpose_b=True) / 0.1
  labels = tf.range(tf.shape(query)[0]) + first
  best = tf.argmax(logits, axis=1, output_type=tf.int32)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "query_embedding": query, "best_document": best})
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "recall_at_1": tf.compat.v1.metrics.accuracy(labels, best)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def retrieval_data():
  rng = np.random.RandomState(31)
  query = rng.randn(ROWS, 5).astype(np.float32)
  document = (query + 0.5 * rng.randn(ROWS, 5)).astype(np.float32)
  return {"query": query, "document": document}, None


# ---------------------------------------------------------------------------
# A tagger predicting per token, up to the batch's longest sequence.


def tagger_model_fn(features, labels, mode):
  lengths = tf.cast(features["length"], tf.int32)
  max_length = tf.reduce_max(lengths)
  tokens = features["tokens"][:, :max_length]
  embedding = tf.compat.v1.get_variable(
      "embedding", [VOCAB, 4],
      initializer=tf.compat.v1.random_normal_initializer(stddev=0.5))
  embedded = tf.nn.embedding_lookup(embedding, tokens)
  with tf.compat.v1.variable_scope("rnn"):
    outputs, _ = tf.compat.v1.nn.dynamic_rnn(
        tf.compat.v1.nn.rnn_cell.GRUCell(5), embedded,
        sequence_length=lengths, dtype=tf.float32)
  logits = tf.compat.v1.layers.dense(outputs, TAGS, name="tags")
  mask = tf.sequence_mask(lengths)  # as wide as the batch's longest too
  tags = tf.argmax(logits, axis=-1) * tf.cast(mask, tf.int64)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={
        "tags": tags, "probabilities": tf.nn.softmax(logits)})
  weights = tf.cast(mask, tf.float32)
  labels = labels[:, :max_length]
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits,
                                                          weights=weights)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(labels, tags,
                                                  weights=weights)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _sequences(seed):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, VOCAB, (ROWS, WIDTH)).astype(np.int64)
  tokens[np.arange(WIDTH)[None, :] >= LENGTHS[:, None]] = 0
  return tokens


def tagger_data():
  tokens = _sequences(32)
  tags = (tokens % TAGS).astype(np.int64)
  return {"tokens": tokens, "length": LENGTHS.copy()}, tags


# ---------------------------------------------------------------------------
# A beam search whose loop stops when the rows of its batch are done.

BEAM = 2


def decoder_model_fn(features, labels, mode):
  """Encodes the source by its mean embedding; decodes one token a step,
  teacher-forced in training. PREDICT is a beam search written as the
  Transformer's: the top BEAM of every beam's continuations by `top_k`,
  the beams' state gathered with `gather_nd` at (row, beam) coordinates,
  and a `tf.while_loop` that runs while a row of the batch is alive (here:
  has not emitted its length's tokens); a finished row emits 0."""
  source, lengths = features["tokens"], tf.cast(features["length"], tf.int32)
  embedding = tf.compat.v1.get_variable(
      "embedding", [VOCAB, 4],
      initializer=tf.compat.v1.random_normal_initializer(stddev=0.5))
  mask = tf.cast(tf.not_equal(source, 0), tf.float32)[:, :, None]
  encoded = tf.reduce_sum(tf.nn.embedding_lookup(embedding, source) * mask,
                          1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)
  with tf.compat.v1.variable_scope("decoder"):
    kernel = tf.compat.v1.get_variable("kernel", [8, 4])
    bias = tf.compat.v1.get_variable(
        "bias", [4], initializer=tf.compat.v1.zeros_initializer())
    output = tf.compat.v1.get_variable("output", [4, VOCAB])

  def step(previous, state):
    inputs = tf.concat([tf.nn.embedding_lookup(embedding, previous), state], 1)
    state = tf.tanh(tf.matmul(inputs, kernel) + bias)
    return state, tf.matmul(state, output)

  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=_beam_search(
        step, encoded, lengths))
  state, previous, all_logits = encoded, tf.zeros_like(lengths), []
  for time in range(WIDTH):
    state, logits = step(previous, state)
    all_logits.append(logits)
    previous = tf.cast(labels[:, time], tf.int32)
  logits = tf.stack(all_logits, axis=1)
  weights = tf.cast(tf.not_equal(labels, 0), tf.float32)
  xentropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                            logits=logits)
  loss = tf.reduce_sum(xentropy * weights) / tf.reduce_sum(weights)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _beam_search(step, encoded, lengths):
  """{"outputs": the best beam's tokens [n, steps], "score": its log
  probability}; steps: the batch's longest length."""
  rows, words = tf.shape(encoded)[0], VOCAB - 1  # 0 is padding

  def alive(time, *unused):
    return tf.reduce_any(time < lengths)

  def body(time, previous, state, scores, ids):
    state, logits = step(tf.reshape(previous, [-1]), tf.reshape(state,
                                                                [-1, 4]))
    log_probs = tf.reshape(tf.nn.log_softmax(logits)[:, 1:],
                           [rows, BEAM, words]) + scores[:, :, None]
    top_scores, top_ids = tf.nn.top_k(
        tf.reshape(log_probs, [rows, BEAM * words]), k=BEAM)
    # The Transformer's _gather_beams: (row, beam) coordinates.
    row_positions = tf.reshape(tf.range(rows * BEAM) // BEAM, [rows, BEAM])
    coordinates = tf.stack([row_positions, top_ids // words], axis=2)
    running = (time < lengths)[:, None]
    tokens = tf.where(running, top_ids % words + 1, tf.zeros_like(top_ids))
    kept = lambda new, old: tf.where(
        tf.broadcast_to(running[:, :, None], tf.shape(old)), new, old)
    ids = tf.concat([kept(tf.gather_nd(ids, coordinates), ids),
                     tokens[:, :, None]], axis=2)
    state = kept(tf.gather_nd(tf.reshape(state, [rows, BEAM, 4]),
                              coordinates), tf.reshape(state,
                                                       [rows, BEAM, 4]))
    return (time + 1, tokens, state, tf.where(running, top_scores, scores),
            ids)

  first = tf.tile(tf.constant([[0.0] + [-1e9] * (BEAM - 1)]), [rows, 1])
  _, _, _, scores, ids = tf.while_loop(
      alive, body, (tf.constant(0), tf.zeros([rows, BEAM], tf.int32),
                    tf.tile(encoded[:, None, :], [1, BEAM, 1]), first,
                    tf.zeros([rows, BEAM, 1], tf.int32)),  # a start column
      shape_invariants=(tf.TensorShape([]), tf.TensorShape([None, BEAM]),
                        tf.TensorShape([None, BEAM, 4]),
                        tf.TensorShape([None, BEAM]),
                        tf.TensorShape([None, BEAM, None])))
  return {"outputs": ids[:, 0, 1:], "score": scores[:, 0]}


def decoder_data():
  tokens = _sequences(33)
  # The target: the source reversed within its length.
  targets = np.zeros_like(tokens)
  for row, length in enumerate(LENGTHS):
    targets[row, :length] = tokens[row, :length][::-1]
  return {"tokens": tokens, "length": LENGTHS.copy()}, targets


# ---------------------------------------------------------------------------
# TF-Ranking's groupwise scoring (`make_groupwise_ranking_fn`, group size
# 2): each list's items are scored in rolling groups of its valid items,
# gathered by index tuples whose row part is `tf.range(batch_size)`, and
# the groups' scores scattered back to their own list's row; its metrics
# weighted per list (`weights_feature_name`), a list without relevant
# items by the batch's mean list weight.

LIST, GROUP = 3, 2


def _seeded(seed):
  """Seeded initial values: the unit tests (tests/test_row_analysis.py)
  train these from their initializers, wrapped and not; the oracle's cells
  start both from one checkpoint anyway."""
  return tf.compat.v1.glorot_uniform_initializer(seed=seed)


def _rolling_windows(list_size, num_valid):
  """[batch, list_size, GROUP]: item i's group is items i, i + 1, ...
  (modulo the list's valid items)."""
  windows = (tf.expand_dims(tf.range(GROUP), 0) +
             tf.expand_dims(tf.range(list_size), 1))
  batch_size = tf.shape(num_valid)[0]
  windows = tf.tile(tf.expand_dims(windows, 0), [batch_size, 1, 1])
  return tf.math.floormod(
      windows, tf.maximum(tf.reshape(num_valid, [-1, 1, 1]), 1))


def _valid_first(is_valid):
  """[batch, list_size, 2]: each list's (row, item) pairs, valid items
  first, in their order."""
  batch_size, list_size = tf.unstack(tf.shape(is_valid))
  order = tf.ones_like(is_valid, tf.float32) * tf.reverse(
      tf.cast(tf.range(list_size), tf.float32), [-1])
  order = tf.where(is_valid, order, -1e-6 * tf.ones_like(order))
  _, items = tf.math.top_k(order, k=list_size)
  rows = tf.ones_like(items) * tf.expand_dims(tf.range(batch_size), 1)
  return tf.stack([rows, items], axis=2)


def _group_indices(is_valid):
  batch_size, list_size = tf.unstack(tf.shape(is_valid))
  num_valid = tf.reduce_sum(tf.cast(is_valid, tf.int32), axis=1)
  windows = tf.expand_dims(_rolling_windows(list_size, num_valid), 3)
  rows = tf.reshape(tf.range(batch_size), [-1, 1, 1, 1]) * tf.ones_like(
      windows)
  return tf.gather_nd(_valid_first(is_valid), tf.concat([rows, windows], 3))


def _per_list_weights(weights, relevance):
  """[batch, 1]: each list's weight, its items' weights averaged over its
  relevant ones (`weights_feature_name` in the metrics); a list with no
  relevant item gets the mean weight of the batch's lists that have one
  (sums over axis 0: a value over the batch, in a metric's weights)."""
  has_weight = tf.reduce_sum(weights, axis=1, keepdims=True) > 0.0
  list_relevance = tf.reduce_sum(relevance, axis=1, keepdims=True)
  counted = tf.compat.v1.where(
      has_weight, tf.cast(list_relevance > 0.0, tf.float32),
      tf.zeros_like(list_relevance))
  per_list = tf.compat.v1.math.divide_no_nan(
      tf.reduce_sum(weights * relevance, axis=1, keepdims=True),
      list_relevance)
  mean = tf.compat.v1.math.divide_no_nan(
      tf.reduce_sum(per_list, axis=0, keepdims=True),
      tf.reduce_sum(counted, axis=0, keepdims=True))
  return tf.compat.v1.where(
      has_weight,
      tf.where(list_relevance > 0.0, per_list,
               tf.ones_like(per_list) * mean),
      tf.zeros_like(per_list))


def _reciprocal_rank(logits, labels, is_valid):
  """[batch, 1]: 1 / the rank of each list's first relevant item by score
  (padding last), 0 for a list without one."""
  list_size = tf.shape(logits)[1]
  scores = tf.where(is_valid, logits,
                    tf.reduce_min(logits) - 1.0 + tf.zeros_like(logits))
  _, order = tf.math.top_k(scores, k=list_size)
  relevant = tf.gather(labels, order, batch_dims=1)
  ranks = tf.cast(tf.range(1, list_size + 1), tf.float32)
  return tf.reduce_max(relevant / ranks, axis=1, keepdims=True)


def ranking_model_fn(features, labels, mode):
  items = features["items"]  # [batch, LIST, 2]; an all-zero item is padding
  is_valid = tf.reduce_any(tf.not_equal(items, 0.0), axis=2)
  batch_size, list_size = tf.unstack(tf.shape(is_valid))
  with tf.name_scope("groupwise_dnn_v2"):
    indices = _group_indices(is_valid)  # [batch, list, GROUP, 2]
    groups = tf.reshape(tf.gather_nd(items, indices),
                        [batch_size * list_size, GROUP * 2])
    hidden = tf.compat.v1.layers.dense(groups, 4, tf.nn.relu, name="hidden",
                                       kernel_initializer=_seeded(1))
    scores = tf.reshape(
        tf.compat.v1.layers.dense(hidden, GROUP, name="scores",
                                  kernel_initializer=_seeded(2)),
        [batch_size, list_size, GROUP])
    with tf.name_scope("accumulate_scores"):
      valid = tf.gather_nd(is_valid, indices)
      scores = tf.where(valid, scores, tf.zeros_like(scores))
      logits = tf.scatter_nd(indices, scores, [batch_size, list_size])
      counts = tf.scatter_nd(indices, tf.cast(valid, tf.float32),
                             [batch_size, list_size])
      logits = tf.compat.v1.div_no_nan(logits, counts)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  weights = tf.cast(is_valid, tf.float32)
  loss = tf.compat.v1.losses.sigmoid_cross_entropy(labels, logits,
                                                   weights=weights)
  if mode == ModeKeys.EVAL:
    list_weights = _per_list_weights(features["weight"] * weights, labels)
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "mean_logit": tf.compat.v1.metrics.mean(logits, weights=weights),
        "weighted_mrr": tf.compat.v1.metrics.mean(
            _reciprocal_rank(logits, labels, is_valid),
            weights=list_weights),
        "list_weight": tf.compat.v1.metrics.mean(list_weights)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdagradOptimizer(0.3)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def ranking_data():
  rng = np.random.RandomState(35)
  items = rng.randn(ROWS, LIST, 2).astype(np.float32)
  items[[1, 4], 2] = 0.0  # two lists of 2 items
  labels = (items[:, :, 0] > 0).astype(np.float32)  # lists 0, 4: none
  weight = rng.randint(1, 4, (ROWS, LIST)).astype(np.float32)
  return {"items": items, "weight": weight}, labels


# ---------------------------------------------------------------------------
# tensorflow/models' Transformer feed-forward layer with its padding
# removed (`allow_ffn_pad`): the non-padding tokens gathered by
# `tf.where(mask)` over the flattened [batch * length] positions, the
# dense layers on them only, then scattered back to the same positions.

HIDDEN, FILTER = 4, 6


def _feed_forward(x, padding):
  batch_size, length = tf.shape(x)[0], tf.shape(x)[1]
  with tf.name_scope("remove_padding"):
    pad_mask = tf.reshape(padding, [-1])
    nonpad_ids = tf.cast(tf.where(pad_mask < 1e-9), dtype=tf.int32)
    x = tf.reshape(x, [-1, HIDDEN])
    x = tf.gather_nd(x, indices=nonpad_ids)
    x.set_shape([None, HIDDEN])
    x = tf.expand_dims(x, axis=0)
  output = tf.compat.v1.layers.dense(x, FILTER, tf.nn.relu,
                                     name="filter_layer",
                                     kernel_initializer=_seeded(3))
  output = tf.compat.v1.layers.dense(output, HIDDEN, name="output_layer",
                                     kernel_initializer=_seeded(4))
  with tf.name_scope("re_add_padding"):
    output = tf.squeeze(output, axis=0)
    output = tf.scatter_nd(indices=nonpad_ids, updates=output,
                           shape=[batch_size * length, HIDDEN])
    output = tf.reshape(output, [batch_size, length, HIDDEN])
  return output


def _position_encoding(length):
  """The Transformer's `get_position_encoding`: sinusoids of `tf.range(
  length)` at `tf.range(num_timescales)` timescales, `num_timescales` a
  Python number (its `hidden_size // 2`): a constant range, here of 6,
  a multiple of a tower's 3 rows on a batch of known size, which is not
  the rows' positions (on 907cb2e taken for them: the Transformer's
  training on static batches was refused on 2 towers)."""
  timescales = 6
  position = tf.cast(tf.range(length), tf.float32)
  inverse = tf.exp(tf.cast(tf.range(timescales), tf.float32) * -0.5)
  scaled = tf.expand_dims(position, 1) * tf.expand_dims(inverse, 0)
  signal = tf.concat([tf.sin(scaled), tf.cos(scaled)], axis=1)
  return tf.matmul(signal, tf.constant(np.random.RandomState(9).randn(
      2 * timescales, HIDDEN).astype(np.float32)))


def pad_remover_model_fn(features, labels, mode):
  tokens = features["tokens"]
  embedding = tf.compat.v1.get_variable(
      "embedding", [VOCAB, HIDDEN],
      initializer=tf.compat.v1.random_normal_initializer(stddev=0.5, seed=6))
  padding = tf.cast(tf.equal(tokens, 0), tf.float32)
  hidden = tf.gather(embedding, tokens)
  hidden += _position_encoding(tf.shape(hidden)[1])
  hidden += _feed_forward(hidden, padding)
  logits = tf.compat.v1.layers.dense(hidden, VOCAB, name="logits",
                                     kernel_initializer=_seeded(5))
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  weights = 1.0 - padding
  xentropy = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits)
  loss = tf.reduce_sum(xentropy * weights) / tf.reduce_sum(weights)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(
            labels, tf.argmax(logits, -1), weights=weights)})
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
          loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def pad_remover_data():
  tokens = _sequences(37)
  return {"tokens": tokens}, (tokens * 2 + 1) % VOCAB * (tokens != 0)


# ---------------------------------------------------------------------------
# tensorflow/models' census wide & deep: canned estimators (compat.v1 and
# TF 2) with crossed columns, in the linear part and embedded in the DNN's.

_CENSUS = {"education": np.array([[e] for e in "abcabca"]).astype(
               bytes).astype(object),
           "job": np.array([[j] for j in "xyyxzzx"]).astype(bytes).astype(
               object),
           "age": np.linspace(-1.0, 1.0, ROWS, dtype=np.float32)[:, None]}
_CENSUS_LABELS = np.array([0, 1, 1, 0, 1, 0, 0], np.int64)


def _census_build(family):
  module = tf.estimator if family == "v2" else tf.compat.v1.estimator
  fc = tf.feature_column

  def build(model_dir, config, wrap):
    education = fc.categorical_column_with_vocabulary_list(
        "education", [b"a", b"b", b"c"])
    job = fc.categorical_column_with_hash_bucket("job", 5)
    crossed = fc.crossed_column([education, "job"], hash_bucket_size=7)
    if family == "v2":
      linear, deep = (lambda: tf.keras.optimizers.legacy.Ftrl(0.1),
                      lambda: tf.keras.optimizers.legacy.Adagrad(0.1))
    else:
      linear, deep = (lambda: tf.compat.v1.train.FtrlOptimizer(0.1),
                      lambda: tf.compat.v1.train.AdagradOptimizer(0.1))
    canned = module.DNNLinearCombinedClassifier(
        linear_feature_columns=[education, job, crossed],
        linear_optimizer=replicate.TowerOptimizer(linear),
        dnn_feature_columns=[fc.numeric_column("age"),
                             fc.embedding_column(crossed, 2)],
        dnn_hidden_units=[3], dnn_optimizer=replicate.TowerOptimizer(deep),
        model_dir=model_dir, config=config)
    if wrap is None:
      return canned
    reduction = (tf.compat.v1.losses.Reduction.SUM if family == "v1" else
                 tf.compat.v1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS)
    return tf.estimator.Estimator(
        replicate.replicate_model_fn(canned.model_fn,
                                     loss_reduction=reduction, **wrap),
        model_dir=model_dir, config=config)
  return build


# `oracle_zoo.ZooModel`s' fields, for models built otherwise than from a
# model_fn (canned estimators).
CANNED = [
    dict(name="census_wide_deep_crossed_" + family,
         build=_census_build(family), data=(_CENSUS, _CENSUS_LABELS),
         example_spec={"education": _fixed([1], tf.string),
                       "job": _fixed([1], tf.string), "age": _fixed([1]),
                       "label": _fixed([], tf.int64)},
         serving_keys=("education", "job", "age"),
         only={"pipeline": ("batch",), "towers": MANY_TOWERS,
               "strategy": ("parameter_server", "replicated")})
    for family in ("v1", "v2")]


_SEQUENCE_SPEC = {"tokens": _fixed([WIDTH], tf.int64),
                  "length": _fixed([], tf.int64),
                  "label": _fixed([WIDTH], tf.int64)}

_RANKING_SPEC = {"items": _fixed([LIST, 2]), "weight": _fixed([LIST]),
                 "label": _fixed([LIST])}

ENTRIES = [
    dict(name="ranking_groupwise_scatter", model_fn=ranking_model_fn,
         data=ranking_data(), example_spec=_RANKING_SPEC,
         serving_keys=["items"],
         only={"pipeline": ("batch", "from_tensors"), "towers": MANY_TOWERS,
               "strategy": ("parameter_server", "replicated")}),
    dict(name="transformer_ffn_pad_remover", model_fn=pad_remover_model_fn,
         data=pad_remover_data(),
         example_spec={"tokens": _fixed([WIDTH], tf.int64),
                       "label": _fixed([WIDTH], tf.int64)},
         serving_keys=["tokens"],
         only={"pipeline": ("batch", "from_tensors"), "towers": MANY_TOWERS,
               "strategy": ("parameter_server",)}),
    dict(name="in_batch_negatives_all_rows", model_fn=retrieval_model_fn,
         data=retrieval_data(),
         example_spec={"query": _fixed([5]), "document": _fixed([5])},
         serving_keys=["query", "document"], params={"all_rows": True},
         only={"pipeline": ("batch", "drop_remainder"),
               "towers": MANY_TOWERS,
               "strategy": ("parameter_server", "replicated"),
               "mode": ("train", "eval", "predict")}),
    dict(name="tagger_per_token", model_fn=tagger_model_fn,
         data=tagger_data(), example_spec=_SEQUENCE_SPEC,
         serving_keys=["tokens", "length"],
         only={"pipeline": ("batch", "from_tensors"), "towers": MANY_TOWERS,
               "strategy": ("parameter_server",)}),
    dict(name="decoder_stops_when_its_rows_are_done",
         model_fn=decoder_model_fn, data=decoder_data(),
         example_spec=_SEQUENCE_SPEC, serving_keys=["tokens", "length"],
         only={"pipeline": ("batch", "from_tensors"), "towers": MANY_TOWERS,
               "strategy": ("parameter_server",),
               "mode": ("train", "predict", "export")}),
]
