"""poecaps: products of expert capsules and capsule routing on TensorFlow and Keras 3."""

import os

# TensorFlow's default CPU allocator gives every large freed tensor back to the
# operating system (glibc unmaps blocks above 32 MB), so the next step faults
# fresh pages in for the same tensor: a third to a half of EM routing's time
# without XLA on a 2-core CPU. The BFC allocator keeps freed blocks and reuses
# them. TensorFlow reads this variable at its first CPU allocation, so it takes
# effect when poecaps is imported before any tensor exists (importing
# TensorFlow or Keras first is fine). Set TF_CPU_ALLOCATOR_USE_BFC=false to
# keep TensorFlow's default.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

__version__ = "0.2.0"
