"""The binary Concrete (relaxed Bernoulli) distribution on (0, 1) (Maddison, Mnih and Teh, 2017, section 3.3).

With location `alpha = exp(logit)` and temperature `lambda`, a draw is

    y = sigmoid((logit + log u - log(1 - u)) / lambda),   u ~ U(0, 1),

and its density is

    p(y) = lambda alpha y^(-lambda-1) (1-y)^(-lambda-1) / (alpha y^(-lambda) + (1-y)^(-lambda))^2.

As lambda -> 0 the draws approach Bern(sigmoid(logit)); `P(y > 1/2)` is
`sigmoid(logit)` at every temperature. `log_prob` computes the density in
log space, the denominator by `logaddexp`.
"""

import tensorflow as tf

from poecaps import distribute
from poecaps.validation import check_setting

# Draws are kept this far inside (0, 1) so that logarithms stay finite; `log_prob` clips its argument
# to within one unit of rounding of 1 in its own precision.
_EDGE = 1e-6


def logaddexp(a, b):
    """`log(exp(a) + exp(b))`, broadcasting, without overflow."""
    big = tf.maximum(a, b)
    return big + tf.math.log1p(tf.exp(-tf.abs(a - b)))


def log_prob(y, logit, temperature=1.0):
    """`log p(y)` of the binary Concrete with `logit` (any broadcastable shapes) at `temperature` (> 0)."""
    check_setting(temperature, "temperature", above=0)
    y = tf.convert_to_tensor(y)
    edge = 1e-15 if y.dtype == tf.float64 else 1e-7
    y = tf.clip_by_value(y, edge, 1.0 - edge)
    as_y = lambda x: tf.cast(x, y.dtype) if tf.is_tensor(x) else tf.constant(x, y.dtype)
    logit, lam = as_y(logit), as_y(temperature)
    log_y, log_1my = tf.math.log(y), tf.math.log1p(-y)
    return (tf.math.log(lam) + logit - (lam + 1.0) * (log_y + log_1my)
            - 2.0 * logaddexp(logit - lam * log_y, -lam * log_1my))


def sample(logit, temperature=1.0, seed=None):
    """One reparameterised draw per entry of `logit`: differentiable in `logit`.

    `seed` is a stateless seed (a shape-[2] integer tensor) or None. With
    a seed, under a `tf.distribute` strategy each replica's draws for its
    rows are one device's for the global batch (`distribute.per_example_draw`). `temperature` is > 0 (0 divides
    by zero; a negative one flips the draws).
    """
    check_setting(temperature, "temperature", above=0)
    logit = tf.convert_to_tensor(logit)
    shape = tuple(tf.unstack(tf.shape(logit)))
    uniform = lambda size, seed: tf.random.stateless_uniform(size, seed, _EDGE, 1.0 - _EDGE, dtype=logit.dtype)
    u = (distribute.per_example_draw(uniform, shape, seed) if seed is not None
         else tf.random.uniform(shape, _EDGE, 1.0 - _EDGE, dtype=logit.dtype))
    return tf.sigmoid((logit + tf.math.log(u) - tf.math.log1p(-u)) / temperature)
