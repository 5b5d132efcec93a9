"""Do the library's eager iterative loops repeat bit for bit in a new process?

Usage: python docs/studies/repeatability_audit.py [--seed 0]

Runs, on seeded random inputs, the three loops that are not compiled:
`GenerativeCapsules.infer` (MAP-EM, 64 x 1,152 children of 8 dimensions,
10 parents of 16), `SparseInferenceRouting.infer` (10 iterations on votes
64 x 1,152 x 10 x 16) and `ProbabilisticCapsuleAutoencoder.mean_bound`
(8 draws on 200 images of 40 x 40, untrained weights), and prints a hash
of each output's bytes. Run it in several processes (and under
`taskset -c 0` for one thread) and compare the lines: equal hashes mean
equal bits. `refine`'s loop, which did not repeat when eager, is compiled
by XLA (docs/probabilistic_capsules.md).
"""

import argparse
import hashlib

import keras
import numpy as np
import tensorflow as tf

from poecaps.models import GenerativeCapsules
from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder
from poecaps.models.probabilistic_capsules import ProbabilisticCapsules
from poecaps.routing.sparse_inference import SparseInferenceRouting


def _hash(*arrays):
    return hashlib.sha1(b"".join(np.asarray(a).tobytes() for a in arrays)).hexdigest()[:12]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    layer = GenerativeCapsules(num_parents=10, parent_dim=16, child_dim=8, seed=args.seed + 1)
    found = layer.infer(tf.constant(rng.normal(size=(64, 1152, 8)).astype("float32")))
    print(f"GenerativeCapsules.infer {_hash(found.poses, found.coefficients)}")
    v, trace = SparseInferenceRouting(iterations=10).infer(
        tf.constant(rng.normal(size=(64, 1152, 10, 16)).astype("float32")))
    print(f"SparseInferenceRouting.infer {_hash(v, trace)}")
    model = ProbabilisticCapsuleAutoencoder(ProbabilisticCapsules(image_size=(40, 40), seed=args.seed), seed=args.seed)
    images = tf.constant(rng.uniform(size=(200, 40, 40, 1)).astype("float32"))
    bound = model.mean_bound(images, model.variational_parameters(images), draws=8, seed=args.seed + 1)
    print(f"ProbabilisticCapsuleAutoencoder.mean_bound {_hash(bound)}")


if __name__ == "__main__":
    main()
