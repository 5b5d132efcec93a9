"""Run directories, saved components and the whole capsule path.

A run directory holds `config.json`, `state.json` (finished stages and the settings of each),
`checkpoints/` (mid-stage backups), `logs/` (TensorBoard),
`metrics.jsonl`, `models/` (one file per trained component) and PNG figures.
"""

import json
import os
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from poecaps import experts, layers, rbm  # noqa: F401  (registers the serializable classes)
from poecaps.capsules import capsules_to_code, primary_capsules, squash, unsquash, with_length


def save_layer(layer, path):
    """Save a built layer's config, input shape and weights in one `.npz`, atomically."""
    config = json.dumps(keras.saving.serialize_keras_object(layer))
    arrays = {f"w{k}": w for k, w in enumerate(layer.get_weights())}
    tmp = path + ".tmp.npz"
    np.savez(tmp, config=np.array(config), input_shape=np.array(layer._build_shape), **arrays)
    os.replace(tmp, path)


def load_layer(path):
    """Load a layer saved by `save_layer`."""
    with np.load(path) as stored:
        layer = keras.saving.deserialize_keras_object(json.loads(str(stored["config"])))
        shape = tuple(int(d) for d in stored["input_shape"])
        if not layer.built:
            layer.build((None, *shape))
        layer._build_shape = shape
        count = len([k for k in stored.files if k.startswith("w")])
        layer.set_weights([stored[f"w{k}"] for k in range(count)])
    return layer


def build_layer(layer, input_shape):
    """Build `layer` for `input_shape` (without batch) and remember the shape for saving."""
    layer.build((None, *input_shape))
    layer._build_shape = tuple(input_shape)
    return layer


def batched(fn, array, batch_size=256):
    """Apply `fn` to `array` in batches and concatenate the NumPy results.

    `fn` runs as one traced graph (`tf.function`), not op by op: the capsule
    layers' contractions loop over the upper capsules (`poecaps.energy`),
    which eagerly costs one Python step per capsule, 576 for the decoder
    (8 s a batch of 256 against 0.4 s traced). A bound method's graph is kept
    between calls (`traced`).
    """
    graph = traced(fn)
    return np.concatenate([ops.convert_to_numpy(graph(array[k:k + batch_size]))
                           for k in range(0, len(array), batch_size)])


# owner -> {function: (the owner's attributes when traced, graph)}. The owner
# and every attribute that allows it are held weakly (`_Snapshot`), so a kept
# graph keeps neither its owner nor an old layer or array alive.
_GRAPHS = weakref.WeakKeyDictionary()


class _Snapshot:
    """Which objects an owner's attributes are bound to, without keeping them alive."""

    def __init__(self, owner):
        self.refs = [_ref(value) for value in getattr(owner, "__dict__", {}).values()]

    def matches(self, owner):
        values = list(getattr(owner, "__dict__", {}).values())
        return len(values) == len(self.refs) and all(ref() is value for ref, value in zip(self.refs, values))


def _ref(value):
    try:
        return weakref.ref(value)
    except TypeError:  # numbers, strings, None, lists...: compared by identity as well
        return lambda: value


def traced(fn):
    """`fn` as a `tf.function` of one argument, kept across calls when `fn` is a bound method.

    A graph reads variables as they are when it runs, but takes every other
    object (a layer, a NumPy mean) as it was when traced. So a kept graph is
    traced again once any attribute of the method's owner has been rebound
    since (`pipeline.decoder = other` retraces; arrays changed in place, or
    the attributes of the owner's layers rebound, are not seen). Functions
    that are not bound methods are traced anew each call.
    Tracing the decoder path costs about 1.5 s, and `evaluate.py` decodes
    through it several times.
    """
    owner, func = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
    if owner is None or func is None:
        return tf.function(fn, reduce_retracing=True)
    try:
        kept = _GRAPHS.setdefault(owner, {})
    except TypeError:  # not weakly referenceable or not hashable
        return tf.function(fn, reduce_retracing=True)
    old = kept.get(func)
    if old is not None and old[0].matches(owner):
        return old[1]
    ref = weakref.ref(owner)
    graph = tf.function(lambda x: func(ref(), x), reduce_retracing=True)
    kept[func] = (_Snapshot(owner), graph)
    return graph


# Arrays a run keeps next to the layers, saved as `<name>.npy` under `models/`.
ARRAYS = ("mean_directions", "code_mean", "pose_moments", "longest_pose_moments", "winning_axes")


class CapsulePipeline:
    """The whole capsule path: image -> lower capsules -> upper capsules -> image.

    Args:
        autoencoder: trained `ConvAutoencoder` (the front end).
        encoder: trained `CapsuleExperts` (lower -> upper).
        decoder: trained `CapsuleExperts` (upper -> lower), or None.
        capsule_dim: dimension of the lower capsules.
        mean_directions: `[J, D]` mean training direction of each upper
            capsule (for restricted-domain sampling), or None.
        code_mean: `[H, W, C]` mean training code subtracted before the
            capsules are formed (the centering trick of Montavon and Mueller,
            2012), or None for the paper's uncentered capsules.
        pose_moments: `[J, D, D]` second moment of each upper capsule's
            unsquashed training poses (for the sampler's fitted domain), or None.
        longest_pose_moments: `[J, D, D]` the same on the training images
            where the capsule is the longest
            (`poecaps.metrics.longest_pose_second_moments`), or None.
        winning_axes: `[J, D]` each upper capsule's principal axis signed
            toward the side its winning training poses visit
            (`poecaps.metrics.winning_side_axes`; the sampler's `half="winning"`),
            or None.
    """

    def __init__(self, autoencoder, encoder=None, decoder=None, capsule_dim=8,
                 mean_directions=None, code_mean=None, pose_moments=None, longest_pose_moments=None,
                 winning_axes=None):
        self.autoencoder = autoencoder
        self.encoder = encoder
        self.decoder = decoder
        self.capsule_dim = capsule_dim
        self.mean_directions = mean_directions
        self.code_mean = code_mean
        self.pose_moments = pose_moments
        self.longest_pose_moments = longest_pose_moments
        self.winning_axes = winning_axes

    @property
    def num_upper(self):
        return self.encoder.num_capsules

    @property
    def upper_dim(self):
        return self.encoder.capsule_dim

    def lower_capsules(self, images):
        return self.capsules_from_code(self.autoencoder.encode(images))

    def capsules_from_code(self, code):
        if self.code_mean is not None:
            code = code - self.code_mean
        return squash(primary_capsules(code, self.capsule_dim))

    def upper_capsules(self, lower):
        return self.encoder(lower)

    def decode_lower(self, lower):
        code = capsules_to_code(unsquash(lower), self.autoencoder.code_shape)
        if self.code_mean is not None:
            code = code + self.code_mean
        return self.autoencoder.decode(code)

    @property
    def decoder_reads_length(self):
        """True when the decoder was trained on `with_length(x)` (`--decoder-length`)."""
        return self.decoder._build_shape[-1] == self.upper_dim + 1

    def decode_upper(self, upper):
        if self.decoder_reads_length:
            upper = with_length(upper)
        return self.decode_lower(self.decoder(upper))

    def reconstruct(self, images):
        return self.decode_upper(self.upper_capsules(self.lower_capsules(images)))

    def save(self, directory):
        os.makedirs(directory, exist_ok=True)
        for name in ("autoencoder", "encoder", "decoder"):
            if getattr(self, name) is not None:
                save_layer(getattr(self, name), os.path.join(directory, f"{name}.npz"))
        for name in ARRAYS:
            if getattr(self, name) is not None:
                np.save(os.path.join(directory, f"{name}.npy"), getattr(self, name))

    @classmethod
    def load(cls, directory, capsule_dim=8):
        def maybe(name):
            path = os.path.join(directory, f"{name}.npz")
            return load_layer(path) if os.path.exists(path) else None

        autoencoder = maybe("autoencoder")
        if autoencoder is None:
            raise FileNotFoundError(f"No trained autoencoder in {directory}; run the 'autoencoder' stage.")
        def array(name):
            path = os.path.join(directory, f"{name}.npy")
            return np.load(path) if os.path.exists(path) else None

        return cls(autoencoder, maybe("encoder"), maybe("decoder"), capsule_dim,
                   **{name: array(name) for name in ARRAYS})


class RunDir:
    """Paths and small JSON files of one run directory."""

    def __init__(self, path):
        self.path = path
        self.models = os.path.join(path, "models")
        self.checkpoints = os.path.join(path, "checkpoints")
        self.logs = os.path.join(path, "logs")
        for directory in (path, self.models, self.checkpoints, self.logs):
            os.makedirs(directory, exist_ok=True)

    def file(self, name):
        return os.path.join(self.path, name)

    def read_json(self, name, default=None):
        path = self.file(name)
        if not os.path.exists(path):
            return default
        with open(path) as handle:
            return json.load(handle)

    def write_json(self, name, obj):
        tmp = self.file(name + ".tmp")
        with open(tmp, "w") as handle:
            json.dump(obj, handle, indent=2, sort_keys=True)
        os.replace(tmp, self.file(name))

    def append_metrics(self, record):
        with open(self.file("metrics.jsonl"), "a") as handle:
            handle.write(json.dumps(record) + "\n")
