"""The arithmetic of batch norm over towers: moments, their sum, their gradient.

On the combination: each tower brings its shard's (count c_i, mean m_i,
variance v_i) per channel, two-pass moments of its own rows. The whole
batch's are Chan's combination, as PyTorch's `SyncBatchNorm`:
`C = sum c_i`, `M = sum w_i m_i`, `V = sum w_i (v_i + (m_i - M)^2)` with
`w_i = c_i / C`. It weighs uneven shards by their rows (a tower without rows
counts 0), and does not lose the variance to cancellation far from 0, as
`E[x^2] - E[x]^2` does.

On the gradient: with G_M and G_V the sums over towers of what each tower's
loss sends back to (M, V), tower i's moments get
`dL/dm_i = w_i (G_M + 2 (m_i - M) G_V)` and `dL/dv_i = w_i G_V`; through
the moments to the rows that is `(G_M + 2 (x - M) G_V) / C`, one device's.

On the fused kernel: `normalized` keeps `FusedBatchNormV3` in inference mode
on (M, V) and adds the gradient with respect to M and V that inference mode
leaves out, from the sums the gradient kernel computes anyway.
"""

from typing import Any, Callable, Sequence, Tuple

import tensorflow as tf

from replicate.shard import sharding


def local_moments(x: tf.Tensor, axes: Sequence[int], keepdims: bool
                  ) -> Tuple[tf.Tensor, tf.Tensor]:
  """This shard's mean and (biased) variance over `axes`, as Keras takes them.

  Their gradient to x is `dm / n + 2 dv (x - m) / n`, made as one multiply
  and one add over x (differentiating `tf.nn.moments` takes five).
  """

  @tf.custom_gradient
  def moments(x):
    mean, variance = tf.nn.moments(x, axes, keepdims=True)
    count = tf.cast(tf.size(x) // tf.size(mean), x.dtype)

    def grad(grad_mean, grad_variance):
      grad_mean = tf.zeros_like(mean) if grad_mean is None else grad_mean
      grad_variance = (tf.zeros_like(variance) if grad_variance is None
                       else grad_variance)
      scale = 2.0 * grad_variance / count
      return x * scale + (grad_mean / count - scale * mean)

    return (mean, variance), grad

  mean, variance = moments(x)
  if not keepdims:
    mean, variance = (tf.squeeze(t, list(axes)) for t in (mean, variance))
  return mean, variance


def element_count(x: tf.Tensor, axes: Sequence[int], has_rows: Any
                  ) -> tf.Tensor:
  """How many elements each channel's moments are over: 0 without rows.

  float64, so that counts beyond 2^24 stay exact.
  """
  if has_rows is False:
    return tf.zeros([], tf.float64)
  count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), list(axes))),
                  tf.float64)
  if has_rows is True:
    return count
  return tf.where(has_rows, count, tf.zeros_like(count))


def combine(counts: Sequence[tf.Tensor], means: Sequence[tf.Tensor],
            variances: Sequence[tf.Tensor], has_rows: Sequence[Any]
           ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """The whole batch's (count, mean, variance), Chan's combination.

  Never NaN: an empty batch gives 0 and 0, and a tower without rows (on a
  stand-in row) is chosen away, not multiplied by 0.
  """
  total = tf.math.add_n(list(counts))
  dtype = means[0].dtype
  terms = [(weight_of(count, total, dtype), sharding.zero_unless_rows(
      mean, rows), sharding.zero_unless_rows(variance, rows))
           for count, mean, variance, rows in zip(counts, means, variances,
                                                  has_rows)
           if rows is not False]
  mean = tf.math.add_n([weight * m for weight, m, _ in terms])
  variance = tf.math.add_n([weight * (v + tf.math.squared_difference(m, mean))
                            for weight, m, v in terms])
  return total, mean, variance


def combine_over_tasks(count: tf.Tensor, mean: tf.Tensor,
                       variance: tf.Tensor, cross_task
                      ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """Every task's (count, mean, variance) combined, by Chan's combination.

  One all-gather of each task's moments (in float64: a cast of float32 and
  back is exact), combined in rank order the same way on every task, so
  every task gets the same whole batch's moments.
  """
  channels = mean.shape.num_elements()
  packed = tf.concat([
      tf.reshape(count, [1]), tf.reshape(tf.cast(mean, tf.float64), [-1]),
      tf.reshape(tf.cast(variance, tf.float64), [-1])], axis=0)
  every_task = cross_task.gather(packed[tf.newaxis])
  tasks = cross_task.group.size
  parts = lambda start: [
      tf.cast(tf.reshape(every_task[task, start:start + channels], mean.shape),
              mean.dtype) for task in range(tasks)]
  return combine(tf.unstack(every_task[:, 0], num=tasks), parts(1),
                 parts(1 + channels), [True] * tasks)


def weight_of(count: tf.Tensor, total: tf.Tensor, dtype) -> tf.Tensor:
  """A tower's share of the batch's elements, `c_i / C` (0 when C is 0)."""
  return tf.cast(tf.math.divide_no_nan(count, total), dtype)


def moments_gradient(weight: tf.Tensor, mean: tf.Tensor,
                     batch_mean: tf.Tensor, grad_mean: tf.Tensor,
                     grad_variance: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  """(dL/dm_i, dL/dv_i) from the summed (G_M, G_V); see the module doc."""
  return (weight * (grad_mean + 2.0 * (mean - batch_mean) * grad_variance),
          weight * grad_variance)


def unbiased(variance: tf.Tensor, count: tf.Tensor) -> tf.Tensor:
  """`V C / (C - 1)`: what the fused kernel returns as the batch variance.

  Keras moves a fused layer's moving variance towards it. Like the kernel,
  a batch of one element per channel keeps V.
  """
  factor = tf.where(count > 1.0, count / tf.maximum(count - 1.0, 1.0),
                    tf.ones_like(count))
  return variance * tf.cast(factor, variance.dtype)


def normalized(fused: Callable, x: tf.Tensor, scale: tf.Tensor,
               offset: tf.Tensor, mean: tf.Tensor, variance: tf.Tensor,
               epsilon: float, data_format: str) -> tf.Tensor:
  """`fused` (TensorFlow's `fused_batch_norm`) in inference mode on (M, V).

  Its registered gradient gives x, scale and offset theirs and M and V
  none; here M and V get `-scale / s * sum(dy)` and
  `-scale / (2 s^2) * sum(dy * x_hat)`, s = sqrt(V + epsilon), where the
  two sums are the offset's and the scale's gradients.
  """

  @tf.custom_gradient
  def inference(x, scale, offset, mean, variance):
    y, _, _ = fused(x, scale, offset, mean=mean, variance=variance,
                    epsilon=epsilon, data_format=data_format,
                    is_training=False)

    def grad(dy):
      dx, dscale, doffset = tf.gradients(y, [x, scale, offset], dy)
      factor = scale * tf.math.rsqrt(variance + epsilon)
      return (dx, dscale, doffset, -factor * doffset,
              -0.5 * factor * tf.math.rsqrt(variance + epsilon) * dscale)

    return y, grad

  return inference(x, scale, offset, mean, variance)
