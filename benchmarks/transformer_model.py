"""A Transformer `model_fn` as a TF 1 Estimator user of tensorflow/models
writes one, for `python -m benchmarks.build_time`.

An encoder-decoder: shared embedding weights read by a gather (zeroed on
padding) and, transposed, as the output layer; sinusoidal positions;
multi-head attention with a padding bias and the decoder's causal bias;
a feed-forward network that, with `allow_ffn_pad` (the original's default
off TPU), runs on the batch's real tokens only: `gather_nd` of the
non-padding positions (`tf.where`), the two dense layers, then
`scatter_nd` back to the same positions; pre-layer-norm residual blocks
with dropout in training; a label-smoothed cross entropy weighted by the
targets' padding; Adam.

Only the training graph is built here (the benchmark times graph
construction), so there is no beam search.
"""

import math
from typing import Dict

import tensorflow as tf

import replicate

v1 = tf.compat.v1

CONFIGS: Dict[str, Dict] = {
    "tiny": dict(vocab_size=64, hidden_size=32, num_heads=4, filter_size=64,
                 num_hidden_layers=2),
    "base": dict(vocab_size=33708, hidden_size=512, num_heads=8,
                 filter_size=2048, num_hidden_layers=6),
}
_DEFAULTS = dict(dropout=0.1, label_smoothing=0.1, allow_ffn_pad=True,
                 learning_rate=1e-3)


def params_of(config: str, **overrides) -> Dict:
  """The `params` of configuration `config` ("tiny" or "base")."""
  return {**_DEFAULTS, **CONFIGS[config], **overrides}


def model_fn(features, labels, mode, params):
  """Trains on `features["inputs"]` -> `labels`, int ids padded with 0."""
  train = mode == tf.estimator.ModeKeys.TRAIN
  initializer = v1.variance_scaling_initializer(
      1.0, mode="fan_avg", distribution="uniform")
  with v1.variable_scope("Transformer", initializer=initializer):
    inputs = features["inputs"]
    embedding = v1.get_variable(
        "embedding_shared_weights/weights",
        [params["vocab_size"], params["hidden_size"]],
        initializer=tf.random_normal_initializer(
            0., params["hidden_size"] ** -0.5))
    input_padding = tf.cast(tf.equal(inputs, 0), tf.float32)
    bias = input_padding[:, tf.newaxis, tf.newaxis, :] * -1e9
    encoded = _encoder(_embed(embedding, inputs, params, train), bias,
                       input_padding, params, train)
    decoded = _decoder(labels, embedding, encoded, bias, params, train)
    logits = tf.einsum("btd,vd->btv", decoded, embedding)
  loss = _smoothed_loss(logits, labels, params)
  optimizer = replicate.TowerOptimizer(
      v1.train.AdamOptimizer(params["learning_rate"]))
  train_op = optimizer.minimize(loss, v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _embed(embedding, ids, params, train, shift=False):
  """Scaled embeddings of `ids` (zero on padding) plus positions."""
  values = tf.gather(embedding, ids) * params["hidden_size"] ** 0.5
  values *= tf.expand_dims(tf.cast(tf.not_equal(ids, 0), tf.float32), -1)
  if shift:  # the decoder sees the targets one position late
    values = tf.pad(values, [[0, 0], [1, 0], [0, 0]])[:, :-1, :]
  values += _positions(tf.shape(values)[1], params["hidden_size"])
  return _dropout(values, params, train)


def _positions(length, hidden_size):
  """Sinusoids of `length` positions, half sine and half cosine."""
  position = tf.cast(tf.range(length), tf.float32)
  increments = math.log(1.0e4) / (hidden_size // 2 - 1)
  inverse = tf.exp(tf.range(hidden_size // 2, dtype=tf.float32) *
                   -increments)
  scaled = tf.expand_dims(position, 1) * tf.expand_dims(inverse, 0)
  return tf.concat([tf.sin(scaled), tf.cos(scaled)], axis=1)


def _encoder(x, bias, padding, params, train):
  for layer in range(params["num_hidden_layers"]):
    with v1.variable_scope("encoder_stack/layer_%d" % layer):
      x = _block(x, "self_attention", params, train,
                 lambda y: _attention(y, y, bias, params, train))
      x = _block(x, "ffn", params, train,
                 lambda y: _feed_forward(y, padding, params, train))
  return _layer_norm(x, "encoder_stack")


def _decoder(targets, embedding, encoded, bias, params, train):
  x = _embed(embedding, targets, params, train, shift=True)
  length = tf.shape(x)[1]
  causal = tf.linalg.band_part(tf.ones([length, length]), -1, 0)
  causal_bias = tf.reshape((1.0 - causal) * -1e9, [1, 1, length, length])
  for layer in range(params["num_hidden_layers"]):
    with v1.variable_scope("decoder_stack/layer_%d" % layer):
      x = _block(x, "self_attention", params, train,
                 lambda y: _attention(y, y, causal_bias, params, train))
      x = _block(x, "encdec_attention", params, train,
                 lambda y: _attention(y, encoded, bias, params, train))
      x = _block(x, "ffn", params, train,
                 lambda y: _feed_forward(y, None, params, train))
  return _layer_norm(x, "decoder_stack")


def _block(x, name, params, train, layer):
  """x + dropout(layer(layer_norm(x))): the pre-norm residual block."""
  with v1.variable_scope(name):
    y = layer(_layer_norm(x, "pre"))
    return x + _dropout(y, params, train)


def _attention(x, memory, bias, params, train):
  hidden, heads = params["hidden_size"], params["num_heads"]
  query = v1.layers.dense(x, hidden, use_bias=False, name="q")
  key = v1.layers.dense(memory, hidden, use_bias=False, name="k")
  value = v1.layers.dense(memory, hidden, use_bias=False, name="v")

  def split(t):  # [batch, length, hidden] -> [batch, heads, length, depth]
    batch, length = tf.shape(t)[0], tf.shape(t)[1]
    t = tf.reshape(t, [batch, length, heads, hidden // heads])
    return tf.transpose(t, [0, 2, 1, 3])

  query, key, value = split(query), split(key), split(value)
  query *= (hidden // heads) ** -0.5
  weights = tf.nn.softmax(tf.matmul(query, key, transpose_b=True) + bias)
  weights = _dropout(weights, params, train)
  out = tf.transpose(tf.matmul(weights, value), [0, 2, 1, 3])
  out = tf.reshape(out, [tf.shape(x)[0], tf.shape(x)[1], hidden])
  return v1.layers.dense(out, hidden, use_bias=False, name="output")


def _feed_forward(x, padding, params, train):
  """Two dense layers; with `allow_ffn_pad`, on the real tokens only."""
  batch, length = tf.shape(x)[0], tf.shape(x)[1]
  hidden = params["hidden_size"]
  if padding is not None and params["allow_ffn_pad"]:
    flat_padding = tf.reshape(padding, [-1])
    kept = tf.cast(v1.where(flat_padding < 1e-9), tf.int32)
    x = tf.expand_dims(tf.gather_nd(tf.reshape(x, [-1, hidden]), kept), 0)
  y = v1.layers.dense(x, params["filter_size"], tf.nn.relu, name="filter")
  y = _dropout(y, params, train)
  y = v1.layers.dense(y, hidden, name="output")
  if padding is not None and params["allow_ffn_pad"]:
    y = tf.scatter_nd(kept, tf.squeeze(y, 0), [batch * length, hidden])
    y = tf.reshape(y, [batch, length, hidden])
  return y


def _layer_norm(x, name):
  with v1.variable_scope(name + "_norm"):
    hidden = x.shape[-1]
    scale = v1.get_variable("layer_norm_scale", [hidden],
                            initializer=tf.ones_initializer())
    shift = v1.get_variable("layer_norm_bias", [hidden],
                            initializer=tf.zeros_initializer())
  mean = tf.reduce_mean(x, axis=[-1], keepdims=True)
  variance = tf.reduce_mean(tf.square(x - mean), axis=[-1], keepdims=True)
  return (x - mean) * tf.math.rsqrt(variance + 1e-6) * scale + shift


def _dropout(x, params, train):
  return tf.nn.dropout(x, rate=params["dropout"]) if train else x


def _smoothed_loss(logits, labels, params):
  """The padded, label-smoothed cross entropy over the real tokens."""
  vocab = params["vocab_size"]
  confidence = 1.0 - params["label_smoothing"]
  low = params["label_smoothing"] / float(vocab - 1)
  soft = tf.one_hot(labels, vocab, on_value=confidence, off_value=low)
  xent = tf.nn.softmax_cross_entropy_with_logits(labels=soft, logits=logits)
  normalizing = -(confidence * math.log(confidence) +
                  (vocab - 1) * low * math.log(low + 1e-20))
  weights = tf.cast(tf.not_equal(labels, 0), tf.float32)
  return (tf.reduce_sum((xent - normalizing) * weights) /
          tf.reduce_sum(weights))
