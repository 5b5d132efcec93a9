"""The whole products-of-expert-capsules path: image -> lower capsules -> upper capsules -> image."""

import os

import keras
import numpy as np

from poecaps import experts, layers, rbm  # noqa: F401  (registers the serializable classes)
from poecaps.capsules import (
    capsules_to_code,
    check_code_shape,
    primary_capsules,
    squash,
    unsquash,
    with_length,
)
from poecaps.errors import InputError
from poecaps.graphs import batched
from poecaps.models.saving import load_component, save_component
from poecaps.validation import check_array, check_integer, shape_fits

# The trained components, each saved as `<name>.keras` (Keras' own format).
COMPONENTS = ("autoencoder", "encoder", "decoder")
# Statistics of the training data kept beside them, each saved as `<name>.npy`.
ARRAYS = ("code_mean", "mean_directions", "winning_axes")


def decoder_kernel_from_encoder(encoder, reads_length=False):
    """The decoder's `U [J, I, D_in, D_out]` that starts as `encoder`'s own down pass.

    Algorithm 1 reconstructs the lower capsules as `z~_i = sum_j c_ij W_ij^T x_j`;
    the decoder computes `sum_j e_ji U_ji x_j` with `e` summing to one over the
    J upper capsules. At uniform coefficients `e = 1/J` and `c = 1/J` over
    parents or `1/I` over children, so `U_ji = (c / e) W_ij^T`: the plain
    transpose for parents, scaled by `J/I` for children (whose W are `I/J`
    times larger for the same model; tests/test_energy.py).

    With `reads_length` the decoder reads `with_length(x) = (x, |x|)/sqrt(2)`:
    the pose columns are scaled by sqrt(2) and the length column starts at 0,
    so the starting decoder computes the same as without it.
    """
    num_in, num_out = encoder.kernel.shape[:2]
    scale = encoder.routing.uniform_coefficient(num_in, num_out) * num_out
    kernel = scale * keras.ops.transpose(encoder.kernel, (1, 0, 3, 2))
    if not reads_length:
        return kernel
    return keras.ops.concatenate([kernel * np.sqrt(2.0), keras.ops.zeros_like(kernel[..., :1])], axis=-1)


class _Statistic:
    """A statistic of the training data kept beside the components: None, or finite numbers of the shape
    `shape(pipeline)` gives (None: any shape of `rank` axes), stored as float32 NumPy. Checked whenever it is
    set, in the constructor or after."""

    def __init__(self, shape, rank, described):
        self.shape, self.rank, self.described = shape, rank, described

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, pipeline, owner=None):
        return self if pipeline is None else pipeline.__dict__.get(self.name)

    def __set__(self, pipeline, value):
        if value is not None:
            value = check_array(value, self.name)
            shape = self.shape(pipeline)
            if value.ndim != self.rank or (shape is not None and value.shape != tuple(shape)):
                wanted = self.described if shape is None else "[" + ", ".join(map(str, shape)) + "]"
                raise InputError(f"{self.name} must have shape {wanted} ({self.described}). Received: shape "
                                 f"{value.shape}")
        pipeline.__dict__[self.name] = value


def _upper_shape(pipeline):
    """`(J, D)` of the upper capsules, known from the encoder; None without one."""
    encoder = pipeline.encoder
    return None if encoder is None else (encoder.num_capsules, encoder.capsule_dim)


class CapsulePipeline:
    """Hauser's network (Figure 1): conv front end, capsule encoder W and capsule decoder U.

    `lower_capsules(images)` forms the 576 squashed 8-D capsules from the
    front end's code (after subtracting `code_mean`, if given: the centring
    trick of Montavon and Mueller, not in the paper); `upper_capsules` routes
    them up with W (eq. 3-4); `decode_upper` routes upper capsules down with
    U (section 4.1), unsquashes, adds `code_mean` back and decodes to images.

    Args:
        autoencoder: trained `ConvAutoencoder` (the front end).
        encoder: trained `CapsuleExperts` (lower -> upper), or None.
        decoder: trained `CapsuleExperts` (upper -> lower), or None. If it
            was built for `D + 1` inputs it reads each upper capsule as
            `with_length(x) = (x, |x|)/sqrt(2)`.
        capsule_dim: dimension of the lower capsules.
        code_mean: `[H, W, C]` mean training code, or None.
        mean_directions: `[J, D]` mean training direction of each upper
            capsule (the sampler's `half="mean"`), or None.
        winning_axes: `[J, D]` each upper capsule's principal axis signed
            toward the side its winning training poses visit
            (`poecaps.metrics.winning_side_axes`; the sampler's
            `half="winning"`), or None.

    A component of another kind, a `capsule_dim` that is not an integer >= 1
    or does not divide the code's channels, built components that do not
    fit each other (the encoder reads, and the decoder writes, the `I`
    lower capsules of `capsule_dim` the code forms; the decoder reads the
    encoder's `J` capsules of `D` or `D + 1`), and arrays that are not
    finite numbers of the shapes above (the code's once the autoencoder is
    built, the encoder's J and D) are an `InputError`; the arrays are
    checked whenever they are set.
    """

    code_mean = _Statistic(lambda pipeline: getattr(pipeline.autoencoder, "code_shape", None), 3, "[H, W, C]")
    mean_directions = _Statistic(_upper_shape, 2, "[J, D]")
    winning_axes = _Statistic(_upper_shape, 2, "[J, D]")

    def __init__(self, autoencoder, encoder=None, decoder=None, capsule_dim=8, code_mean=None,
                 mean_directions=None, winning_axes=None):
        if not isinstance(autoencoder, layers.ConvAutoencoder):
            raise InputError(f"autoencoder must be a poecaps.layers.ConvAutoencoder. Received: "
                             f"{type(autoencoder).__name__}")
        for name, part in (("encoder", encoder), ("decoder", decoder)):
            if part is not None and not isinstance(part, experts.CapsuleExperts):
                raise InputError(f"{name} must be a poecaps.experts.CapsuleExperts, or None. Received: "
                                 f"{type(part).__name__}")
        self.autoencoder = autoencoder
        self.encoder = encoder
        self.decoder = decoder
        self.capsule_dim = check_integer(capsule_dim, "capsule_dim")
        self._check_components_fit()
        self.code_mean = code_mean
        self.mean_directions = mean_directions
        self.winning_axes = winning_axes

    def _check_components_fit(self):
        """An `InputError` naming the first mismatch among the built components (the class docstring), where it
        would be refused only at the component's first call, as a shape that layer did not expect."""
        code_shape = getattr(self.autoencoder, "code_shape", None)
        lower = (None, self.capsule_dim)
        if code_shape is not None:
            check_code_shape((None, *code_shape), self.capsule_dim)
            lower = (int(np.prod(code_shape)) // self.capsule_dim, self.capsule_dim)
        built = lambda part: part is not None and part.built and hasattr(part, "kernel")
        where = f"the autoencoder's code forms with capsule_dim={self.capsule_dim}"
        if built(self.encoder) and not shape_fits(self.encoder.visible_shape, lower):
            raise InputError(f"The encoder reads lower capsules {list(self.encoder.visible_shape)} [I, D], not the "
                             f"{list(lower)} {where}.")
        if built(self.decoder):
            written = (self.decoder.num_capsules, self.decoder.capsule_dim)
            if not shape_fits(written, lower):
                raise InputError(f"The decoder writes lower capsules {list(written)} [I, D], not the {list(lower)} "
                                 f"{where}.")
            if built(self.encoder):
                j, d = self.encoder.num_capsules, self.encoder.capsule_dim
                if tuple(self.decoder.visible_shape) not in ((j, d), (j, d + 1)):
                    raise InputError(f"The decoder reads upper capsules {list(self.decoder.visible_shape)}, not the "
                                     f"encoder's [{j}, {d}] (or [{j}, {d + 1}] with their lengths).")

    def _trained(self, name):
        """The component `name` ("encoder" or "decoder"); `InputError` if this pipeline has none."""
        component = getattr(self, name)
        if component is None:
            raise InputError(f"This capsule pipeline has no {name}; train the {name!r} stage first.")
        return component

    @property
    def num_upper(self):
        return self._trained("encoder").num_capsules

    @property
    def upper_dim(self):
        return self._trained("encoder").capsule_dim

    def lower_capsules(self, images):
        return self.capsules_from_code(self.autoencoder.encode(images))

    def capsules_from_code(self, code):
        if self.code_mean is not None:
            code = code - self.code_mean
        return squash(primary_capsules(code, self.capsule_dim))

    def upper_capsules(self, lower):
        return self._trained("encoder")(lower)

    def encode(self, images):
        """Upper capsules of images, `[B, J, D]`."""
        return self.upper_capsules(self.lower_capsules(images))

    def decode_lower(self, lower):
        code = capsules_to_code(unsquash(lower), self.autoencoder.code_shape)
        if self.code_mean is not None:
            code = code + self.code_mean
        return self.autoencoder.decode(code)

    @property
    def decoder_reads_length(self):
        """True when the decoder reads `with_length(x)` (built for one input dimension more)."""
        return self._trained("decoder").kernel.shape[-1] == self.upper_dim + 1

    def decode_capsules(self, upper):
        """Lower capsules the decoder routes down from upper capsules `[B, J, D]`."""
        if self.decoder_reads_length:
            upper = with_length(upper)
        return self.decoder(upper)

    def decode_upper(self, upper):
        return self.decode_lower(self.decode_capsules(upper))

    def decode(self, upper, batch_size=256):
        """Images of upper capsules (a NumPy array `[N, J, D]`), computed in batches.

        The capsule decoder runs under XLA in batches of 32, which suits its
        576 routed capsules; the convolutions run without XLA, which slows
        them on a CPU. Equal to `decode_upper` to rounding.
        """
        self._trained("decoder")     # named here: raised inside the traced batches it would read as a StagingError
        batch_size = check_integer(batch_size, "batch_size")       # before the capsule decoder runs, not after
        shape = np.shape(upper)
        if not shape_fits(shape, (None, self.num_upper, self.upper_dim)):
            raise InputError(f"upper capsules must be [N, {self.num_upper}, {self.upper_dim}] (J upper capsules of "
                             f"D dimensions). Received: shape={shape}")
        lower = batched(self.decode_capsules, upper, 32, jit_compile=True)
        return batched(self.decode_lower, lower, batch_size)

    def reconstruct(self, images):
        return self.decode_upper(self.encode(images))

    def save(self, directory):
        """Write every component as `<name>.keras` and every array as `<name>.npy` under `directory`."""
        os.makedirs(directory, exist_ok=True)
        for name in COMPONENTS:
            if getattr(self, name) is not None:
                save_component(getattr(self, name), os.path.join(directory, f"{name}.keras"))
        for name in ARRAYS:
            if getattr(self, name) is not None:
                np.save(os.path.join(directory, f"{name}.npy"), np.asarray(getattr(self, name), "float32"))

    @classmethod
    def load(cls, directory, capsule_dim=8):
        """The pipeline saved under `directory`; missing components and arrays are None."""
        def component(name):
            path = os.path.join(directory, f"{name}.keras")
            return load_component(path) if os.path.exists(path) else None

        def array(name):
            path = os.path.join(directory, f"{name}.npy")
            return np.load(path) if os.path.exists(path) else None

        autoencoder = component("autoencoder")
        if autoencoder is None:
            raise InputError(f"No trained autoencoder in {directory}; train the 'autoencoder' stage first.")
        return cls(autoencoder, component("encoder"), component("decoder"), capsule_dim,
                   **{name: array(name) for name in ARRAYS})
