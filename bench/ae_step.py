"""One training step of the conv autoencoder front end: poecaps against a plain Keras reference.

Batch 128, 28x28x1 images, filters [9,9,1,128] and [9,9,128,128] stride 2
(Hauser section 4.1). The reference is the same network written with stock
Keras layers (Conv2D / Conv2DTranspose with their own, untied decoder
filters: the same convolutions, twice the filters to update). Before
timing, it is given poecaps' weights, its decoder filters set to the
encoder's, and must reproduce the reconstructions and the loss (dropout
off) to 1e-5, or the run stops. Last line: RESULT images_per_s=<n> vs_reference=<ratio>
matmul_fraction=<f>, with matmul_fraction = achieved FLOP/s of the
convolutions / dense-matmul FLOP/s measured in the same run.
"""

import argparse

import keras
import numpy as np
from common import (
    best_seconds,
    count,
    cpu_allocator,
    dense_matmul_flops_per_s,
    machine,
    require_same_function,
)

from poecaps.layers import ConvAutoencoder
from poecaps.trainers.autoencoder import AutoencoderTrainer

# The largest difference from poecaps that the reference check accepts (see `reference_disagreement`).
TOLERANCE = 1e-5


def reference_model(shape, filters=128, kernel=9):
    inputs = keras.Input(shape)
    x = keras.layers.Conv2D(filters, kernel, activation="leaky_relu")(inputs)
    x = keras.layers.Dropout(0.1)(x)
    x = keras.layers.Conv2D(filters, kernel, strides=2, activation="leaky_relu")(x)
    x = keras.layers.Dropout(0.1)(x)
    x = keras.layers.Conv2DTranspose(filters, kernel, strides=2, output_padding=1,
                                     activation="leaky_relu")(x)
    outputs = keras.layers.Conv2DTranspose(shape[-1], kernel, activation="sigmoid")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    return model


def reference_disagreement(reference, autoencoder, images, seed):
    """How far the reference is from `autoencoder` given its weights, decoder filters tied (0 up to float32 sums).

    The autoencoder's biases are first drawn from N(0, 0.1), so that they
    enter the check. Returns the larger of max |x_ref - x| (reconstructions
    in (0, 1), dropout off) and |loss_ref - loss| / |loss| (binary
    cross-entropy): float32 convolutions summed in another order, ~1e-6.
    """
    autoencoder(images[:1])
    for k, bias in enumerate([autoencoder.bias1, autoencoder.bias2, autoencoder.decoder_bias2,
                              autoencoder.decoder_bias1]):
        bias.assign(keras.random.normal(bias.shape, stddev=0.1, seed=seed + k))
    conv1, conv2, deconv2, deconv1 = [layer for layer in reference.layers if layer.weights]
    pairs = [(conv1, autoencoder.kernel1, autoencoder.bias1), (conv2, autoencoder.kernel2, autoencoder.bias2),
             (deconv2, autoencoder.kernel2, autoencoder.decoder_bias2),
             (deconv1, autoencoder.kernel1, autoencoder.decoder_bias1)]
    for layer, kernel, bias in pairs:
        layer.kernel.assign(kernel)
        layer.bias.assign(bias)
    flat = lambda x: np.reshape(x, (len(images), -1))
    reconstructions = np.asarray(autoencoder(images, training=False))
    ref_reconstructions = np.asarray(reference(images, training=False))
    loss = float(np.mean(keras.losses.binary_crossentropy(flat(images), flat(reconstructions))))
    ref_loss = float(reference.evaluate(images, images, batch_size=len(images), verbose=0))
    return max(np.abs(ref_reconstructions - reconstructions).max(), abs(ref_loss - loss) / abs(loss))


def conv_flops(h, w, c, filters, kernel, strides):
    """Training FLOPs per image: forward + two backward passes of the four convolutions."""
    h1, w1 = h - kernel + 1, w - kernel + 1
    h2, w2 = (h1 - kernel) // strides + 1, (w1 - kernel) // strides + 1
    forward = 2 * kernel * kernel * (h1 * w1 * c * filters + h2 * w2 * filters * filters)
    return 3 * 2 * forward  # encoder + tied decoder, forward + backward


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=count(), default=128)
    p.add_argument("--seed", type=count(0), default=0)
    p.add_argument("--repeats", type=count(), default=3)
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)
    images = np.random.default_rng(args.seed).uniform(size=(args.batch, 28, 28, 1)).astype("float32")
    matmul = dense_matmul_flops_per_s()
    flops = args.batch * conv_flops(28, 28, 1, 128, 9, 2)
    results = {}
    for jit in (False, True):
        trainer = AutoencoderTrainer(ConvAutoencoder(seed=args.seed))
        trainer.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=jit)
        trainer.make_train_function()
        trainer(images[:1])
        step = lambda t=trainer: t.train_on_batch(images)
        results[jit] = best_seconds(step, warmup=2, repeats=args.repeats)
        print(f"poecaps   jit_compile={jit!s:5}: {results[jit] * 1e3:7.1f} ms/step  "
              f"{args.batch / results[jit]:6.1f} images/s  {flops / results[jit] / 1e9:5.1f} GFLOP/s",
              flush=True)
    seconds = results[False]  # XLA is slower for these convolutions on CPU; the default is off
    reference = reference_model((28, 28, 1))
    difference = reference_disagreement(reference, ConvAutoencoder(seed=args.seed), images, args.seed)
    require_same_function(difference, TOLERANCE, "ConvAutoencoder")
    ref_seconds = best_seconds(lambda: reference.train_on_batch(images, images), warmup=2,
                               repeats=args.repeats)
    print(f"reference (stock Keras layers): {ref_seconds * 1e3:7.1f} ms/step  "
          f"{args.batch / ref_seconds:6.1f} images/s")
    print(f"machine: {machine()}")
    print(f"dense matmul: {matmul / 1e9:.1f} GFLOP/s; convolutions: {flops / 1e9:.1f} GFLOP/step; "
          f"CPU allocator: {cpu_allocator()}")
    print(f"RESULT images_per_s={args.batch / seconds:.1f} vs_reference={ref_seconds / seconds:.2f} "
          f"matmul_fraction={flops / seconds / matmul:.3f}")


if __name__ == "__main__":
    main()
