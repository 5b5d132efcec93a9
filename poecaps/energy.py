"""Energy of a product of expert capsules (Hauser 2019, section 3).

One capsule layer: lower capsules `x [B, I, D_in]`, transformation matrices
`W [I, J, D_out, D_in]`, routing coefficients `c [B, I, J]` and

    z_j = sum_i c_ij W_ij x_i                              (eq. 3)
    E(x, h) = - sum_j h_j log |z_j|^2                      (eq. 7)
    F(x)    = - sum_j log(1 + |z_j|^2)                     (eq. 10)
    P(h_j = 1 | x) = |z_j|^2 / (1 + |z_j|^2) = |squash(z_j)|  (eq. 12-13)

Mixing by dynamic routing (Algorithm 1), with the data's `c` held fixed:

    x~_i = squash(sum_j c_ij W_ij^T squash(z_j)),   z~_j = sum_i c_ij W_ij x~_i

and the CD update (eq. 18), which is `-grad_W [F(x) - F(x~)]` with `c` and
`x~` held fixed:

    dW_ij = 2 c_ij ( z_j x_i^T / (1 + |z_j|^2) - z~_j x~_i^T / (1 + |z~_j|^2) )

The capsule decoder (section 4.1) is the mirror image: its visible units are
the upper capsules `x_j`, its hidden units the lower capsules `i`, its
matrices `U [J, I, D_in, D_out]` and coefficients `e [B, J, I]`; every
function below applies unchanged with the roles swapped (the `decoder_*`
names say so).

Layout: no function forms the `[B, I, J, D_out]` votes. Internally the
upper-capsule axis leads (`cj [J, B, I]`, `zj [J, B, D_out]`) and every
contraction is a loop over J with one matmul per upper capsule, so that one
capsule's intermediates (`c_ij x_i` or `W_ij^T v_j`, `[B, I*D_in]`: 2.4 MB at
the paper's sizes) stay in cache instead of a `[J, B, I*D_in]` tensor (47 MB)
going through memory; `kernel_views` gives W as `[J, I*D_in, D_out]` and
`[J, D_out, I*D_in]`.
"""

from keras import ops

from poecaps.capsules import EPSILON, root, squash
from poecaps.errors import InputError
from poecaps.validation import check_integer, shape_fits

# The axes of each argument of the public functions, named as in the module docstring.
_LAYOUTS = {"x": ("B", "I", "D_in"), "x_neg": ("B", "I", "D_in"), "c": ("B", "I", "J"), "c_neg": ("B", "I", "J"),
            "h": ("B", "J"), "v": ("B", "J", "D_out")}


def check_layer(kernel, **arrays):
    """`(kernel, *arrays)` as tensors, in the order given, if every array fits `kernel [I, J, D_out, D_in]` and
    one batch B; else an `InputError` naming the first that does not.

    Each array is named by its role (`x`, `x_neg [B, I, D_in]`; `c`, `c_neg [B, I, J]`; `h [B, J]`;
    `v [B, J, D_out]`); None is skipped (an argument left to its default). Sizes unknown while tracing fit any.
    Without the check a batch, capsule or parent axis of size 1 would be broadcast against the others (one
    example's coefficients used for every example, say) and the result would come without a word.
    """
    kernel = ops.convert_to_tensor(kernel)
    if len(kernel.shape) != 4:
        raise InputError(f"kernel must be [I, J, D_out, D_in]. Received: shape={tuple(kernel.shape)}")
    sizes = dict(zip(("I", "J", "D_out", "D_in"), kernel.shape))
    tensors = []
    for name, array in arrays.items():
        if array is None:
            tensors.append(None)
            continue
        array = ops.convert_to_tensor(array)
        axes = _LAYOUTS[name]
        if sizes.get("B") is None and len(array.shape) == len(axes):
            sizes["B"] = array.shape[0]
        expected = tuple(sizes.get(axis) for axis in axes)
        if not shape_fits(tuple(array.shape), expected):
            wanted = ", ".join(f"{axis}={sizes[axis]}" if sizes.get(axis) is not None else axis for axis in axes)
            raise InputError(f"{name} must be [{', '.join(axes)}] ({wanted}) for a kernel of shape "
                             f"{list(kernel.shape)}. Received: {name} of shape {list(array.shape)}")
        tensors.append(array)
    return (kernel, *tensors)

# ---- internal, upper-capsule-major helpers ---------------------------------

def kernel_views(kernel):
    """W `[I, J, D_out, D_in]` as `(Wr [J, I*D_in, D_out], Wt [J, D_out, I*D_in])`."""
    num_in, num_out, d_out, d_in = kernel.shape
    wr = ops.reshape(ops.transpose(kernel, (1, 0, 3, 2)), (num_out, num_in * d_in, d_out))
    wt = ops.reshape(ops.transpose(kernel, (1, 2, 0, 3)), (num_out, d_out, num_in * d_in))
    return wr, wt


def to_j_major(c):
    """`[B, I, J] -> [J, B, I]`."""
    return ops.transpose(c, (2, 0, 1))


def from_j_major(cj):
    """`[J, B, I] -> [B, I, J]`."""
    return ops.transpose(cj, (1, 2, 0))


def _weighted_input(c, x):
    """One upper capsule's `c_ij x_i` as `[B, I*D_in]`; `c [B, I]`, `x [B, I, D_in]`."""
    return ops.reshape(c[:, :, None] * x, (ops.shape(x)[0], -1))


def _transpose_vote(v, w, d_in):
    """One upper capsule's `W_ij^T v_j` for every i, `[B, I, D_in]`."""
    # [B, D_out] x [D_out, I*D_in] -> [B, I*D_in]
    return ops.reshape(ops.matmul(v, w), (ops.shape(v)[0], -1, d_in))


def routed_sum_j(x, wr, cj):
    """`z_j = sum_i c_ij W_ij x_i` as `[J, B, D_out]`, one upper capsule at a time."""
    # [B, I*D_in] x [I*D_in, D_out] -> [B, D_out], for each j
    return ops.map(lambda cw: ops.matmul(_weighted_input(cw[0], x), cw[1]), (cj, wr))


def vote_agreement_j(vj, wt, x):
    """`v_j . W_ij x_i = (W_ij^T v_j) . x_i` for every pair, `[J, B, I]`."""
    return ops.map(lambda vw: ops.sum(_transpose_vote(vw[0], vw[1], x.shape[-1]) * x, axis=-1), (vj, wt))


def reconstruct_j(vj, wt, cj, d_in):
    """`sum_j c_ij W_ij^T v_j`, `[B, I, D_in]`, accumulated one upper capsule at a time."""
    def add_one(j, total):
        return total + cj[j][:, :, None] * _transpose_vote(vj[j], wt[j], d_in)

    shape = (ops.shape(cj)[1], cj.shape[2], d_in)
    return ops.fori_loop(0, vj.shape[0], add_one, ops.zeros(shape, dtype=vj.dtype))


def mix_j(x, wr, wt, cj, steps=1, zj=None):
    """Algorithm 1's mixing, `steps` times; returns `(x~ [B, I, D_in], z~ [J, B, D_out])`."""
    for _ in range(steps):
        zj = routed_sum_j(x, wr, cj) if zj is None else zj
        x = squash(reconstruct_j(squash(zj), wt, cj, x.shape[-1]))
        zj = None
    return x, routed_sum_j(x, wr, cj)


def sparsity_pull_j(zj, target, cost, population_cost=0.0):
    """Minus the positive-phase factor of the sparsity penalty's gradient, `[J, B, D_out]`.

    With `q_j = mean_b P(h_j = 1 | x_b)` and `Omega = cost sum_j (q_j - target)^2`
    (Lee, Ekanadham and Ng 2008; Hinton's guide to RBMs, section 11),
    `dOmega/dW_ij = 2/B sum_b c_ij x_i^T (2 cost (q_j - target) z_j / (1 + |z_j|^2)^2)`,
    which has the shape of eq. 18's positive term; this returns the factor
    that, added to `z_j / (1 + |z_j|^2)`, makes the update ascend
    `log p - Omega`.

    `population_cost` adds the same penalty across capsules instead of
    across the batch: `population_cost J mean_b (r_b - target)^2` with
    `r_b = mean_j P(h_j = 1 | x_b)`, each image's own share of capsules on
    (population sparsity; Willmore and Tolhurst 2001). Its factor has the
    same form with `r_b` in place of `q_j`. The lifetime term alone lets an
    image turn on many capsules as long as each capsule is on rarely
    over the batch; the population term asks each image to be explained by
    few of them, as a capsule that stands for an object should be.
    """
    sq = ops.sum(ops.square(zj), axis=-1, keepdims=True)                 # [J, B, 1]
    p = sq / (1.0 + sq)
    excess = cost * (ops.mean(p, axis=1, keepdims=True) - target)        # [J, 1, 1]
    if population_cost:
        excess = excess + population_cost * (ops.mean(p, axis=0, keepdims=True) - target)  # [1, B, 1]
    return -2.0 * excess * zj / ops.square(1.0 + sq)


def cd_gradient_j(x, zj, cj, x_neg, zj_neg, cj_neg, sparsity=None):
    """Eq. 18 from both phases, averaged over the batch, as W's shape `[I, J, D_out, D_in]`.

    `sparsity=(target, cost, population_cost)` adds the ascent direction of
    the penalty of `sparsity_pull_j` on the positive phase's `zj`, at no
    extra matmul.
    """
    scale = lambda z: z / (1.0 + ops.sum(ops.square(z), axis=-1, keepdims=True))
    positive = scale(zj)
    if sparsity is not None:
        positive = positive + sparsity_pull_j(zj, *sparsity)
    negative = scale(zj_neg)

    def one_capsule(args):
        c, c_neg, pos, neg = args
        # [D_out, B] x [B, I*D_in] -> [D_out, I*D_in], both phases
        return (ops.matmul(ops.transpose(pos), _weighted_input(c, x))
                - ops.matmul(ops.transpose(neg), _weighted_input(c_neg, x_neg)))

    return _kernel_mean(ops.map(one_capsule, (cj, cj_neg, positive, negative)), x)


def delta_gradient_j(x, zj, cj, zj_target):
    """The delta rule `2 mean_b c_ij (t_j - z_j) x_i^T` as W's shape `[I, J, D_out, D_in]`.

    Minus the gradient of `mean_b sum_j |t_j - z_j|^2` with `c` held fixed:
    the hidden pre-activations `z_j` regressed onto targets `t_j`.
    """
    def one_capsule(args):
        c, error = args
        # [D_out, B] x [B, I*D_in] -> [D_out, I*D_in]
        return ops.matmul(ops.transpose(error), _weighted_input(c, x))

    return _kernel_mean(ops.map(one_capsule, (cj, zj_target - zj)), x)


def _kernel_mean(grad, x):
    """`[J, D_out, I*D_in]` sums over the batch -> `2 / B` times them as `[I, J, D_out, D_in]`."""
    num_out, d_out = grad.shape[0], grad.shape[1]
    grad = ops.reshape(grad, (num_out, d_out, -1, x.shape[-1]))
    return 2.0 * ops.transpose(grad, (2, 0, 1, 3)) / ops.cast(ops.shape(x)[0], x.dtype)


# ---- public functions, in the layout of the design -------------------------

def routed_sum(x, kernel, c):
    """`z_j = sum_i c_ij W_ij x_i` (eq. 3): `[B, I, D_in] -> [B, J, D_out]`."""
    kernel, x, c = check_layer(kernel, x=x, c=c)
    wr, _ = kernel_views(kernel)
    return ops.transpose(routed_sum_j(x, wr, to_j_major(c)), (1, 0, 2))


def transpose_votes(v, kernel):
    """`W_ij^T v_j` for every pair: `[B, J, D_out] -> [B, I, J, D_in]`."""
    kernel, v = check_layer(kernel, v=v)
    # [B, J, D_out] x [I, J, D_out, D_in] -> [B, I, J, D_in]
    return ops.einsum("bjo,ijoe->bije", v, kernel)


def reconstruct(v, kernel, c):
    """Top-down pre-activation `z~_i = sum_j c_ij W_ij^T v_j`: `[B, J, D_out] -> [B, I, D_in]`."""
    kernel, v, c = check_layer(kernel, v=v, c=c)
    _, wt = kernel_views(kernel)
    return reconstruct_j(ops.transpose(v, (1, 0, 2)), wt, to_j_major(c), kernel.shape[-1])


def vote_norms_j(x, kernel):
    """`|W_ij x_i|` for every pair as `[J, B, I]`, through the Gram matrices `W_ij^T W_ij`.

    `|W_ij x_i|^2 = <x_i x_i^T, W_ij^T W_ij>`: one batched matmul over I of the
    outer products `[I, B, D_in^2]` with the Gram matrices `[I, D_in^2, J]`,
    so no `[J, B, I, D_in]` tensor is formed. Exact (no epsilon), with the
    gradient 0 where a vote is 0.
    """
    num_in, num_out, d_out, d_in = kernel.shape
    # Gram matrices as a sum of D_out outer products of W's rows, [D_in, D_in, I, J]:
    # elementwise, which XLA fuses (an einsum is I*J tiny matmuls, 4x slower under XLA).
    rows = ops.transpose(kernel, (2, 3, 0, 1))                                # [D_out, D_in, I, J]
    gram = sum(rows[o][:, None] * rows[o][None] for o in range(d_out))
    gram = ops.transpose(ops.reshape(gram, (d_in * d_in, num_in, num_out)), (1, 0, 2))
    xt = ops.transpose(x, (1, 0, 2))                                          # [I, B, D_in]
    outer = ops.reshape(xt[:, :, :, None] * xt[:, :, None, :], (num_in, -1, d_in * d_in))
    # [I, B, D_in^2] x [I, D_in^2, J] -> [I, B, J] -> [J, B, I]
    sq = ops.transpose(ops.matmul(outer, gram), (2, 1, 0))
    return root(ops.maximum(sq, 0.0))


def uniform_sum_j(x, kernel, scale):
    """`scale * sum_i W_ij x_i` as `[J, B, D_out]`: eq. 3 with constant coefficients, one matmul."""
    num_in, num_out, d_out, d_in = kernel.shape
    # [B, I*D_in] x [I*D_in, J*D_out] -> [B, J, D_out] -> [J, B, D_out]
    flat = ops.reshape(ops.transpose(kernel, (0, 3, 1, 2)), (num_in * d_in, num_out * d_out))
    z = ops.reshape(ops.matmul(ops.reshape(x, (-1, num_in * d_in)), flat), (-1, num_out, d_out))
    return scale * ops.transpose(z, (1, 0, 2))


def _squared_length(z):
    return ops.sum(ops.square(z), axis=-1)


def energy(x, h, kernel, c):
    """`E(x, h) = - sum_j h_j log |z_j|^2` (eq. 7); `h [B, J]` in {0, 1}; returns `[B]`."""
    kernel, x, h, c = check_layer(kernel, x=x, h=h, c=c)
    sq = _squared_length(routed_sum(x, kernel, c))
    return -ops.sum(h * ops.log(sq + EPSILON), axis=-1)


def free_energy(x, kernel, c):
    """`F(x) = - sum_j log(1 + |z_j|^2)` (eq. 10); returns `[B]`."""
    return -ops.sum(ops.log1p(_squared_length(routed_sum(x, kernel, c))), axis=-1)


def p_on(x, kernel, c):
    """`P(h_j = 1 | x) = |z_j|^2 / (1 + |z_j|^2)` (eq. 12); returns `[B, J]`."""
    sq = _squared_length(routed_sum(x, kernel, c))
    return sq / (1.0 + sq)


def mix(x, kernel, c, steps=1):
    """Mixing by dynamic routing (Algorithm 1), `steps` times with fixed `c`.

    Returns `(x~ [B, I, D_in], z~ [B, J, D_out])`.
    """
    steps = check_integer(steps, "steps")
    kernel, x, c = check_layer(kernel, x=x, c=c)
    wr, wt = kernel_views(kernel)
    x_neg, zj = mix_j(x, wr, wt, to_j_major(c), steps)
    return x_neg, ops.transpose(zj, (1, 0, 2))


def encoder_cd_gradient(x, kernel, c, x_neg=None, c_neg=None, steps=1):
    """Closed-form CD update dW (eq. 18) averaged over the batch, `[I, J, D_out, D_in]`.

    `x_neg` defaults to the CD-`steps` reconstruction of `x` with the data's
    `c`; `c_neg` (for persistent chains) defaults to `c`. The result is the
    ascent direction on log-likelihood, `-grad_W [F(x) - F(x~)]`. Every
    array is checked against the kernel and the batch (`check_layer`).
    """
    steps = check_integer(steps, "steps")
    kernel, x, c, x_neg, c_neg = check_layer(kernel, x=x, c=c, x_neg=x_neg, c_neg=c_neg)
    wr, wt = kernel_views(kernel)
    cj = to_j_major(c)
    cj_neg = cj if c_neg is None else to_j_major(c_neg)
    zj = routed_sum_j(x, wr, cj)
    if x_neg is None:
        x_neg, zj_neg = mix_j(x, wr, wt, cj_neg, steps, zj=zj if c_neg is None else None)
    else:
        zj_neg = routed_sum_j(x_neg, wr, cj_neg)
    return cd_gradient_j(x, zj, cj, x_neg, zj_neg, cj_neg)


# The capsule decoder (section 4.1) is the same model with the roles swapped:
# visible = upper capsules x_j [B, J, D_out], U [J, I, D_in, D_out], e [B, J, I].
decoder_energy = energy
decoder_free_energy = free_energy
decoder_p_on = p_on
decoder_mix = mix
decoder_cd_gradient = encoder_cd_gradient
