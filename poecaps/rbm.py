"""The Bernoulli restricted Boltzmann machine: the classic model of the tradition."""

import keras
from keras import ops

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.experts import EnergyModel
from poecaps.validation import check_integer, check_seed, static_shape


@keras.saving.register_keras_serializable(package="poecaps")
class BernoulliRBM(distribute.FullPrecision, keras.layers.Layer, EnergyModel):
    """Binary RBM with the same energy contract as the capsule experts.

        E(v, h) = - v^T W h - b^T v - a^T h                      (Hauser eq. 1)
        F(v)    = - b^T v - sum_j softplus(a_j + v^T W_:j)
        P(h_j = 1 | v) = sigmoid(a_j + v^T W_:j),  P(v_i = 1 | h) = sigmoid(b_i + W_i: h)

    CD-k (Hinton 2002) samples binary hidden states and uses visible
    probabilities; the update `<v h>_data - <v h>_model` (eq. 2) is
    `-grad [F(v) - F(v~)]` with `v~` held fixed.

    Args:
        num_hidden: number of hidden units (> 0).
        seed: seed of the Gibbs sampler.

    Call arguments:
        inputs: `[B, V]` visible probabilities in [0, 1].

    Returns:
        `[B, num_hidden]` hidden probabilities.
    """

    draws_random_numbers = True   # the Gibbs sampler (see EnergyModel)

    def __init__(self, num_hidden, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.num_hidden = check_integer(num_hidden, "num_hidden")
        self.seed = seed = check_seed(seed, allow_none=True)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def build(self, input_shape):
        num_visible = input_shape[-1]
        self.kernel = self.add_weight(name="kernel", shape=(num_visible, self.num_hidden),
                                      initializer=keras.initializers.RandomNormal(stddev=0.01))
        self.visible_bias = self.add_weight(name="visible_bias", shape=(num_visible,),
                                            initializer="zeros")
        self.hidden_bias = self.add_weight(name="hidden_bias", shape=(self.num_hidden,),
                                           initializer="zeros")

    def _check_units(self, x, kind):
        """Refuse, naming both sizes, an `x` whose last axis is not as wide as the `kind` ("visible" or "hidden")
        units; the layer is built for visible units first. Static shapes: unknown sizes fit any."""
        shape = static_shape(x)
        if kind == "visible" and not self.built:
            self.build(shape)
        self.require_weights()
        units = self.kernel.shape[0] if kind == "visible" else self.num_hidden
        if not shape or shape[-1] not in (units, None):
            raise InputError(f"{self.name} has {units} {kind} units. Received: {kind} units of shape {shape}")

    def _check_visible(self, v):
        self._check_units(v, "visible")

    def p_on(self, v):
        self._check_visible(v)
        return ops.sigmoid(ops.matmul(v, self.kernel) + self.hidden_bias)

    def visible_probabilities(self, h):
        self._check_units(h, "hidden")
        return ops.sigmoid(ops.matmul(h, ops.transpose(self.kernel)) + self.visible_bias)

    def free_energy(self, v):
        # A NumPy `v` on the left of `*` would turn the bias into a constant.
        v = ops.convert_to_tensor(v, self.compute_dtype)
        self._check_visible(v)
        return (-ops.sum(v * self.visible_bias, axis=-1)
                - ops.sum(ops.softplus(ops.matmul(v, self.kernel) + self.hidden_bias), axis=-1))

    def sample_hidden(self, v):
        p = self.p_on(v)
        uniform = lambda shape, seed: keras.random.uniform(shape, dtype=p.dtype, seed=seed)
        noise = distribute.per_example_draw(uniform, ops.shape(p), self.seed_generator)
        return ops.cast(noise < p, p.dtype)

    def gibbs(self, v, steps=1):
        """`steps` (>= 1) rounds of block Gibbs sampling from `v`: hidden states drawn, visible probabilities."""
        for _ in range(check_integer(steps, "steps")):
            v = self.visible_probabilities(self.sample_hidden(v))
        return v

    def reconstruct(self, v, steps=1):
        """`steps` (>= 1) mean-field rounds from `v`: hidden probabilities, then visible probabilities."""
        for _ in range(check_integer(steps, "steps")):
            v = self.visible_probabilities(self.p_on(v))
        return v

    @property
    def visible_shape(self):
        """Shape of one example's visible units, `(V,)`."""
        self.require_weights()
        return (self.kernel.shape[0],)

    def call(self, inputs):
        return self.p_on(inputs)

    def _cd_gradients(self, v, steps, chain, sparsity=None):
        negatives = self.gibbs(v if chain is None else chain, steps)
        h_pos, h_neg = self.p_on(v), self.p_on(negatives)
        n = ops.cast(ops.shape(v)[0], v.dtype)
        # Sparsity penalty cost sum_j (q_j - target)^2, q_j = mean_b h_pos: its gradient's
        # factor per example and unit is 2 cost (q_j - target) h (1 - h) / B. The
        # population term population_cost J mean_b (r_b - target)^2, r_b = mean_j h_pos,
        # has the same factor with r_b in place of q_j.
        pull = 0.0
        if sparsity is not None:
            target, cost, population_cost = sparsity
            excess = cost * (ops.mean(h_pos, axis=0) - target)
            if population_cost:
                excess = excess + population_cost * (ops.mean(h_pos, axis=1, keepdims=True) - target)
            pull = -2.0 * excess * h_pos * (1.0 - h_pos)
        grads = [
            (ops.matmul(ops.transpose(v), h_pos + pull) - ops.matmul(ops.transpose(negatives), h_neg)) / n,
            ops.mean(v, axis=0) - ops.mean(negatives, axis=0),
            ops.mean(h_pos + pull, axis=0) - ops.mean(h_neg, axis=0),
        ]
        stats = {"free_energy": self.free_energy(v), "p_on": h_pos,
                 "reconstruction": self.reconstruct(v)}
        return grads, negatives, stats

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_hidden)

    def get_config(self):
        config = super().get_config()
        config.update(num_hidden=self.num_hidden, seed=self.seed)
        return config
