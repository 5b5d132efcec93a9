"""Fully connected capsule layer: votes by one einsum, routing delegated."""

import keras
from keras import ops

from poecaps import routing as routing_lib


@keras.saving.register_keras_serializable(package="poecaps")
class CapsuleDense(keras.layers.Layer):
    """Maps `I` capsules of `D_in` dimensions to `J` capsules of `D_out` dimensions.

    Votes are `u_{j|i} = W_ij x_i` (Sabour eq. 2, Hauser eq. 3) with
    `W [I, J, D_out, D_in]`; a routing procedure (any object behind
    `poecaps.routing`'s interface) turns them into upper capsules. For
    routings that offer `route_linear` the votes are never materialised.

    Args:
        num_capsules: J, number of upper capsules (> 0).
        capsule_dim: D_out, dimension of each upper capsule (> 0).
        routing: routing name, config dict or `Routing` instance.
        kernel_initializer: initializer of W; Hauser uses N(0, 0.01).
        kernel_regularizer: optional regularizer of W.

    Call arguments:
        inputs: `[B, I, D_in]` lower capsules.
        activations: `[B, I]` or None.

    Returns:
        `[B, J, D_out]` upper capsule poses; `route()` returns the whole
        `RoutingResult`.

    Example:
    >>> layer = CapsuleDense(10, 16, routing="dynamic")
    >>> layer(keras.random.normal((2, 32, 8))).shape
    (2, 10, 16)
    """

    def __init__(self, num_capsules, capsule_dim, routing="dynamic",
                 kernel_initializer=None, kernel_regularizer=None, **kwargs):
        super().__init__(**kwargs)
        for name, value in (("num_capsules", num_capsules), ("capsule_dim", capsule_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")
        self.num_capsules = num_capsules
        self.capsule_dim = capsule_dim
        self.routing = routing_lib.get(routing)
        self.kernel_initializer = keras.initializers.get(
            kernel_initializer or keras.initializers.RandomNormal(stddev=0.01))
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)

    def build(self, input_shape):
        if len(input_shape) != 3:
            raise ValueError(
                f"CapsuleDense expects inputs of shape [batch, num_in, in_dim]. "
                f"Received: input_shape={input_shape}")
        _, num_in, in_dim = input_shape
        self.kernel = self.add_weight(
            name="kernel", shape=(num_in, self.num_capsules, self.capsule_dim, in_dim),
            initializer=self.kernel_initializer, regularizer=self.kernel_regularizer)

    def votes(self, inputs):
        # [B, I, D_in] x [I, J, D_out, D_in] -> [B, I, J, D_out]
        return ops.einsum("bie,ijoe->bijo", inputs, self.kernel)

    def route(self, inputs, activations=None, training=None):
        if hasattr(self.routing, "route_linear"):
            return self.routing.route_linear(inputs, self.kernel, activations)
        return self.routing(self.votes(inputs), activations, training=training)

    def call(self, inputs, activations=None, training=None):
        return self.route(inputs, activations, training).poses

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_capsules, self.capsule_dim)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_capsules=self.num_capsules,
            capsule_dim=self.capsule_dim,
            routing=keras.saving.serialize_keras_object(self.routing),
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            kernel_regularizer=keras.regularizers.serialize(self.kernel_regularizer),
        )
        return config
