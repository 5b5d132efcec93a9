"""EM routing from moment contractions, with a written-out gradient (TensorFlow).

`EMRouting`'s default implementation. The votes enter EM only through two
contractions per round, so both are batched matrix-vector products over
`vv = [v, v*v]` in the parent-major layout `[B, J, I, 2D]` and no other
`[B, I, J, D]` tensor is formed, forward or backward.
"""

import math

import tensorflow as tf


def activation_logits(r_sum, log_sigma, beta_u, beta_a, inverse_temperature, standardize):
    """Eqs. 26-27: `lambda (beta_a - cost_j)` from `sum_i R'_ij [B, J]` and `log sigma [B, J, D]`."""
    cost = tf.reduce_sum(beta_u[:, None] + log_sigma, axis=-1) * r_sum
    if standardize:
        mean = tf.reduce_mean(cost, axis=-1, keepdims=True)
        std = tf.sqrt(tf.reduce_mean(tf.square(cost - mean), axis=-1, keepdims=True) + 1e-8)
        cost = (cost - mean) / std
    return inverse_temperature * (beta_a - cost)


def _em_rounds(vv, a_in, beta_u, beta_a, temperatures, floor, standardize, record):
    """EM's rounds on `vv = [v, v*v]` `[B, J, I, 2D]` (v centred); records each contraction."""
    dim = vv.shape[-1] // 2
    r = tf.ones_like(vv[..., 0]) / vv.shape[1]                                 # [B, J, I]
    for t, temperature in enumerate(temperatures):
        rw = r * a_in[:, None, :]
        r_sum = tf.reduce_sum(rw, axis=-1) + 1e-8                              # [B, J]
        s = tf.matmul(rw[:, :, None, :], vv)[:, :, 0]                          # [B, J, 2D]
        record["rw"].append(rw)
        record["s"].append(s)
        mean = s[..., :dim] / r_sum[..., None]
        var = tf.maximum(s[..., dim:] / r_sum[..., None] - tf.square(mean), 0.0) + floor
        log_sigma = 0.5 * tf.math.log(var)
        logit_a = activation_logits(r_sum, log_sigma, beta_u, beta_a, temperature, standardize)
        if t == len(temperatures) - 1:
            break
        # sum_h (v^h - mean^h)^2 / var^h = [v, v*v] . [-2 mean / var, 1 / var] + sum_h mean^2 / var
        q = tf.concat([-2.0 * mean / var, 1.0 / var], axis=-1)                 # [B, J, 2D]
        quad = tf.matmul(vv, q[..., None])[..., 0]                             # [B, J, I]
        record["q"].append(q)
        record["quad"].append(quad)
        log_p = (-0.5 * (quad + tf.reduce_sum(tf.square(mean) / var, axis=-1)[..., None])
                 - tf.reduce_sum(log_sigma, axis=-1)[..., None] - 0.5 * dim * math.log(2 * math.pi))
        r = tf.nn.softmax(tf.math.log_sigmoid(logit_a)[..., None] + log_p, axis=1)
    return mean, logit_a, r


def em_by_moments(votes, activations, beta_u, beta_a, temperatures, variance_floor, standardize):
    """EM routing (Hinton et al. 2018, eqs. 21-29) on parent-major votes.

    Per round, with `R'_ij = R_ij a_i`, the M-step needs `sum_i R'_ij V_ij`
    and `sum_i R'_ij V_ij^2`, one product `R'_j [I] x vv_j [I, 2D]` per
    (example, parent); then `var_j = E[V^2] - mu_j^2 + floor`. The E-step
    needs `sum_h (V_ij^h - mu_j^h)^2 / var_j^h`, one product
    `vv_j [I, 2D] x [-2 mu_j / var_j, 1 / var_j]`. The votes are first
    centred on the first round's means (the `a_i`-weighted means, which do
    not depend on R), so the one-pass variance cancels only as far as the
    means move between rounds.

    The gradient is written out: vv is used only in those products, so
    `dL/dvv = sum_t R'_t (x) dL/ds_t + sum_t dL/dquad_t (x) q_t`, all rounds
    in one batched matmul, while autodiff handles the small `[B, J, ...]`
    tensors between them. Equal to autodiff of the direct implementation
    (tests/test_em_routing.py).

    Args:
        votes: `[B, J, I, D]` float32.
        activations: `[B, I]` float32.
        beta_u, beta_a: `[J]`.
        temperatures: the inverse temperature of each round (a Python list).
        variance_floor: added to every variance.
        standardize: whether costs are standardised over the parents.

    Returns:
        `(mu [B, J, D], logit_a [B, J], R [B, J, I])`.
    """
    weights = activations / (tf.reduce_sum(activations, axis=-1, keepdims=True) + 1e-8)
    center = tf.stop_gradient(tf.matmul(votes, weights[:, None, :, None], transpose_a=True)[..., 0])

    @tf.custom_gradient
    def rounds(centred, a_in, beta_u, beta_a):
        vv = tf.stop_gradient(tf.concat([centred, tf.square(centred)], axis=-1))
        record = {"rw": [], "s": [], "q": [], "quad": []}
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([a_in, beta_u, beta_a])
            outputs = _em_rounds(vv, a_in, beta_u, beta_a, temperatures, variance_floor,
                                 standardize, record)

        def grad(*upstream):
            sources = [a_in, beta_u, beta_a] + record["s"] + record["quad"]
            grads = tape.gradient(list(outputs), sources, output_gradients=list(upstream),
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            rounds_done = len(record["s"])
            d_s, d_quad = grads[3:3 + rounds_done], grads[3 + rounds_done:]
            left = tf.stack(record["rw"] + d_quad, axis=-1)                    # [B, J, I, K]
            right = tf.stack(d_s + record["q"], axis=-2)                       # [B, J, K, 2D]
            d_vv = tf.matmul(left, right)
            dim = centred.shape[-1]
            return [d_vv[..., :dim] + 2.0 * centred * d_vv[..., dim:]] + grads[:3]

        return outputs, grad

    mean, logit_a, r = rounds(votes - center[:, :, None], activations,
                              tf.identity(beta_u), tf.identity(beta_a))
    return center + mean, logit_a, r
