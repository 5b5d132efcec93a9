"""How far float32 EM's outputs move between the eager path and XLA's, loop and unrolled.

Usage: python docs/studies/generative_loop_paths.py [--seed 0]

On the batch and layer of `generative_loop_timing.py` (32 x 1,152 children,
10 parents of 16, 10 iterations), prints the max absolute differences of
poses, coefficients and bound between: the loop and the unrolled inference
run eagerly; each compiled by XLA against the eager one; and the two
compiled ones. A pose step is kept only if the bound does not fall, so a
rounding difference at that test sends two paths apart by a whole step.
"""

import argparse
import os
import sys

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generative_loop_timing as timing

from poecaps.models import GenerativeCapsules


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)
    x = tf.constant(timing._children(args.seed))
    layer = GenerativeCapsules(10, 16, 8, kappa=5.0, sigma=0.25, seed=args.seed)
    layer.build(x.shape)
    loop = GenerativeCapsules.infer

    def run(infer, jit):
        GenerativeCapsules.infer = infer

        def f(c):
            found = layer.infer(c, iterations=10)
            return found.poses, found.coefficients, layer.log_joint(c, found.poses, found.coefficients)

        return [t.numpy() for t in (tf.function(f, jit_compile=True)(x) if jit else f(x))]

    eager, xla = run(loop, False), run(loop, True)
    unrolled_eager, unrolled_xla = run(timing._unrolled_infer, False), run(timing._unrolled_infer, True)
    differ = lambda a, b: ", ".join(f"{name} {float(np.max(np.abs(p - q))):.3g}"
                                    for name, p, q in zip(("poses", "coefficients", "bound"), a, b))
    print("eager, loop vs unrolled:", differ(eager, unrolled_eager))
    print("XLA loop vs eager:", differ(xla, eager))
    print("XLA unrolled vs eager:", differ(unrolled_xla, eager))
    print("XLA loop vs XLA unrolled:", differ(xla, unrolled_xla))
    print(f"mean |bound|: {float(np.mean(np.abs(eager[2]))):.1f}")


if __name__ == "__main__":
    main()
