"""Evaluation: reconstruction error, linear probes, sample specialisation."""

import keras
import numpy as np

from poecaps.capsules import unsquash
from poecaps.errors import InputError
from poecaps.validation import (
    check_array,
    check_finite,
    check_image_shape,
    check_integer,
    check_integers,
    check_labels,
    check_number,
    check_seed,
)


def mse(images, reconstructions):
    """Mean squared pixel error of reconstructions of the images' shape (NaN if a reconstruction is)."""
    images, reconstructions = np.asarray(images), np.asarray(reconstructions)
    if images.shape != reconstructions.shape or images.size == 0:
        raise InputError(f"mse needs reconstructions of the images' shape, not empty. Received shapes "
                         f"{images.shape} and {reconstructions.shape}")
    return float(np.mean(np.square(images - reconstructions)))


def linear_probe(train_features, train_labels, test_features, test_labels, max_iterations=500,
                 l2=1e-4):
    """Test accuracy of a multinomial logistic regression on frozen features (`fit_linear_probe`), over the
    classes 0 to the largest label of either set."""
    classes = int(max(np.max(train_labels), np.max(test_labels))) + 1
    return fit_linear_probe(train_features, train_labels, classes, max_iterations, l2)(test_features, test_labels)


def fit_linear_probe(train_features, train_labels, classes, max_iterations=500, l2=1e-4):
    """Fit a multinomial logistic regression on frozen features; returns `accuracy(test_features, test_labels)`.

    Features are standardised with the training statistics; the regression,
    with a small L2 penalty on the weights (not the bias), is fitted by at
    most `max_iterations` L-BFGS-B iterations from zero weights, in float64,
    over `classes` classes. The objective's products go through SciPy's
    BLAS, the one L-BFGS-B itself calls: NumPy brings its own OpenBLAS, and
    two thread pools that wait for work by spinning slow each other down on
    a small CPU. One fit serves any number of test sets.

    Features are `[N, ...]` finite numbers (flattened per example) and labels
    one integer in [0, classes) per example, `[N]`; anything else, such as a
    column of labels `[N, 1]` (which NumPy would broadcast against `[N]`
    into a wrong accuracy), is an `InputError` naming it; so are `classes` and
    `max_iterations` that are not integers >= 1 and an `l2` that is not a
    finite number >= 0.
    """
    from scipy.linalg import blas
    from scipy.optimize import minimize

    classes, max_iterations = check_integers(classes=classes, max_iterations=max_iterations)
    l2 = check_number(l2, "l2", minimum=0)
    train, labels = _probe_set(train_features, train_labels, classes, "train")
    mean, std = train.mean(0), train.std(0) + 1e-6
    train = np.asfortranarray(np.hstack([(train - mean) / std, np.ones((len(train), 1))]))   # BLAS's layout
    rows = np.arange(len(train))

    def loss_and_grad(flat):
        weights = flat.reshape(train.shape[1], classes)
        logits = blas.dgemm(1.0, train, weights)                     # [N, C]
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        total = p.sum(axis=1, keepdims=True)
        loss = (np.sum(np.log(total)) - np.sum(logits[rows, labels])) / len(train)
        p /= total
        p[rows, labels] -= 1.0                                       # softmax minus the one-hot targets
        grad = blas.dgemm(1.0 / len(train), train, p, trans_a=True)  # [F, C]
        grad[:-1] += l2 * weights[:-1]
        return loss + 0.5 * l2 * np.sum(weights[:-1] ** 2), np.ascontiguousarray(grad).ravel()

    solution = minimize(loss_and_grad, np.zeros(train.shape[1] * classes), jac=True,
                        method="L-BFGS-B", options={"maxiter": max_iterations})
    weights = solution.x.reshape(train.shape[1], classes)

    def accuracy(test_features, test_labels):
        test, test_labels = _probe_set(test_features, test_labels, classes, "test")
        if test.shape[1] != len(mean):
            raise InputError(f"test_features must have the training features' {len(mean)} values per example. "
                             f"Received: {test.shape[1]}")
        test = np.hstack([(test - mean) / std, np.ones((len(test), 1))])
        return float(np.mean(np.argmax(test @ weights, axis=1) == test_labels))

    return accuracy


def _probe_set(features, labels, classes, split):
    """`features` as float64 `[N, F]` and `labels` as `[N]` integers in [0, classes), or an `InputError`."""
    features = check_array(features, f"{split}_features", dtype="float64")
    return features.reshape(len(features), -1), check_labels(labels, classes, len(features), f"{split}_labels")


PROBE_PENALTIES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def probe_penalty(features, labels, penalties=PROBE_PENALTIES, folds=5, seed=0, max_iterations=500):
    """`linear_probe`'s L2 penalty chosen by cross-validation on the training features alone.

    The rows are permuted by `seed` and cut into `folds` contiguous parts;
    each penalty's score is its probe's mean accuracy on each part when
    fitted on the others. The best score wins, the largest penalty on a tie.

    Returns:
        dict with the chosen `penalty` and each penalty's mean fold
        `accuracy` (a list in the order of `penalties`).
    """
    features, labels = np.asarray(features), np.asarray(labels)
    if check_integer(folds, "folds", minimum=2) > len(features):
        raise InputError(f"folds must be in [2, {len(features)}] (the number of rows). Received: folds={folds}")
    if not isinstance(penalties, (tuple, list)) or len(penalties) == 0:
        raise InputError(f"penalties must be a non-empty list of numbers >= 0. Received: penalties={penalties!r}")
    penalties = [check_number(l2, f"penalties[{k}]", minimum=0) for k, l2 in enumerate(penalties)]
    seed, max_iterations = check_seed(seed), check_integer(max_iterations, "max_iterations")
    parts = np.array_split(np.random.default_rng(seed).permutation(len(features)), folds)
    accuracy = []
    for l2 in penalties:
        scores = []
        for k, held in enumerate(parts):
            kept = np.concatenate([p for j, p in enumerate(parts) if j != k])
            scores.append(linear_probe(features[kept], labels[kept], features[held], labels[held],
                                       max_iterations=max_iterations, l2=l2))
        accuracy.append(float(np.mean(scores)))
    best = max(accuracy)
    return {"penalty": float(max(l2 for l2, a in zip(penalties, accuracy) if a == best)), "accuracy": accuracy}


def reference_classifier(input_shape, classes, seed=0):
    """A small CNN that labels sampled images (trained on real ones): `input_shape` (H, W, C), `classes` >= 1."""
    input_shape, classes = check_image_shape(input_shape, "input_shape"), check_integer(classes, "classes")
    keras.utils.set_random_seed(check_seed(seed))
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.3, seed=seed),
        keras.layers.Dense(classes, activation="softmax"),
    ], name="reference_classifier")


def specialisation(predicted, classes):
    """Purity and coverage of sampled columns.

    Args:
        predicted: `[rows, J]` class labels given to the samples of each capsule.
        classes: number of classes.

    Returns:
        dict with per-capsule `purity` (share of its majority class),
        `majority` class, `mean_purity` and `classes_covered` (distinct
        majority classes over the J capsules).
    """
    predicted = np.asarray(predicted)
    if predicted.ndim != 2 or predicted.size == 0:
        raise InputError(f"specialisation needs predicted classes [rows, J], rows and J > 0. Received shape "
                         f"{predicted.shape}")
    check_labels(predicted.reshape(-1), classes, predicted.size, name="predicted")
    purity, majority = [], []
    for j in range(predicted.shape[1]):
        counts = np.bincount(predicted[:, j], minlength=classes)
        majority.append(int(np.argmax(counts)))
        purity.append(float(counts.max() / counts.sum()))
    return {"purity": purity, "majority": majority, "mean_purity": float(np.mean(purity)),
            "classes_covered": len(set(majority))}


def mean_directions(upper):
    """Each capsule's mean direction over the examples, `[J, D]` unit vectors.

    The mean of the unit poses `x_j / |x_j|`, normalised: the vector by which
    the restricted-domain sampler picks the half of a capsule's space that
    training data visited (Hauser section 4.2).
    """
    upper = np.asarray(upper, "float64")
    if upper.ndim != 3 or len(upper) == 0:
        raise InputError(f"mean_directions needs upper capsules [N, J, D], N > 0. Received shape {upper.shape}")
    check_finite(upper, "upper")
    directions = np.mean(upper / (np.linalg.norm(upper, axis=-1, keepdims=True) + 1e-12), axis=0)
    return directions / (np.linalg.norm(directions, axis=-1, keepdims=True) + 1e-12)


def pose_second_moments(upper):
    """Each upper capsule's second moment `E[z_j z_j^T]` of its unsquashed pose, `[J, D, D]`.

    `z_j = unsquash(x_j)` is the capsule's pre-activation (eq. 3), the space
    that the Figure 2 sampler draws `y ~ N(0, I)` in before squashing. The
    moment is not centred: a capsule whose poses lie on a line through the
    origin, on both sides of it, has one large eigenvalue.

    Args:
        upper: `[N, J, D]` squashed upper capsules of training data.
    """
    upper = np.asarray(upper)
    if upper.ndim != 3 or len(upper) == 0:
        raise InputError(f"pose_second_moments needs upper capsules [N, J, D]. Received shape {upper.shape}")
    check_finite(upper, "upper")
    z = np.asarray(keras.ops.convert_to_numpy(unsquash(upper.astype("float32"))), "float64")
    # [N, J, D] x [N, J, D] -> [J, D, D], the mean of z_j z_j^T over the N images
    return np.einsum("njd,nje->jde", z, z) / len(z)


def longest_pose_second_moments(upper):
    """Each upper capsule's second moment on the images where it is the longest, `[J, D, D]`.

    `M_j = E[z_j z_j^T | j = argmax_k |x_k|]`: the poses a capsule takes
    when it, more than any other, claims the image, which is what a Figure 2
    column (capsule j on, the others 0) stands for. Capsules with high P(on)
    on every image have all-data moments (`pose_second_moments`) dominated
    by images they do not describe. A capsule that is the longest on no
    image keeps its all-data moment.

    Args:
        upper: `[N, J, D]` squashed upper capsules of training data.

    Returns:
        `(moments [J, D, D], wins [J])`: `wins[j]` counts the images on
        which capsule j is the longest (0: its all-data moment is used).
    """
    moments = pose_second_moments(upper)
    upper = np.asarray(upper)
    winner = np.argmax(np.linalg.norm(upper, axis=-1), axis=1)
    wins = np.bincount(winner, minlength=upper.shape[1])
    for j in np.flatnonzero(wins):
        moments[j] = pose_second_moments(upper[winner == j, j:j + 1])[0]
    return moments, wins


def principal_share(moments):
    """Share of each capsule's second moment along its principal direction, `[J]`.

    `lambda_max(M_j) / trace(M_j)`: 1 when the poses span one line, `1/D`
    when they fill the D dimensions evenly. A draw `y ~ N(0, I_D)` puts on
    average only `1/D` of its squared length on any one direction, so a
    capsule with a share near 1 sees such draws mostly in directions its
    training data never took.
    """
    moments = np.asarray(moments, "float64")
    if moments.ndim != 3 or moments.shape[1] != moments.shape[2]:
        raise InputError(f"principal_share needs moments [J, D, D]. Received shape {moments.shape}")
    check_finite(moments, "moments")
    eigenvalues = np.linalg.eigvalsh(moments)
    return eigenvalues[:, -1] / np.maximum(np.trace(moments, axis1=1, axis2=2), 1e-30)


def class_selectivity(activity, labels, classes):
    """How much each unit prefers one class, read from its activity on labelled data.

    The paper's claim that each capsule learns specific objects, checked
    without a sampler or decoder in between: a capsule that stands for an
    object is long on images of that object and short on the others.

    Args:
        activity: `[N, J]` capsule lengths or hidden-unit probabilities.
        labels: `[N]` integer classes.
        classes: number of classes.

    Returns:
        dict with each unit's `preferred` class (highest class-mean activity),
        its `spread` (highest minus lowest class-mean activity), their
        `mean_spread`, and `classes_preferred` (distinct preferred classes).
    """
    activity, labels = np.asarray(activity), np.asarray(labels)
    if activity.ndim != 2 or len(activity) != len(labels) or 0 in activity.shape:
        raise InputError(f"class_selectivity needs activity [N, J] and labels [N], N and J > 0. "
                         f"Received shapes {activity.shape} and {labels.shape}")
    labels = check_labels(labels, classes, len(activity))     # one would be left out, or fail inside NumPy
    check_finite(activity, "activity")
    present = [c for c in range(classes) if np.any(labels == c)]
    means = np.stack([activity[labels == c].mean(axis=0) for c in present])   # [C, J]
    preferred = [present[k] for k in np.argmax(means, axis=0)]
    spread = means.max(axis=0) - means.min(axis=0)
    return {"preferred": [int(c) for c in preferred], "spread": [float(v) for v in spread],
            "mean_spread": float(spread.mean()), "classes_preferred": len(set(preferred))}


def keep_longest(upper, k=1):
    """Upper capsules `[N, J, D]` with all but each example's `k` longest set to 0.

    A real image's code cut down to what a Figure 2 sample has: its own
    longest capsule(s), the others off. Decoded, it shows what one capsule
    can say about an image at best, with a pose the data really took.
    """
    upper = np.asarray(upper)
    k = check_integer(k, "k")
    if upper.ndim != 3 or not 1 <= k <= upper.shape[1]:
        raise InputError(f"keep_longest needs upper capsules [N, J, D] and 1 <= k <= J. "
                         f"Received shape {upper.shape} and k={k}")
    check_finite(upper, "upper")
    longest = np.argsort(-np.linalg.norm(upper, axis=-1), axis=1, kind="stable")[:, :k]
    mask = np.zeros(upper.shape[:2], upper.dtype)
    np.put_along_axis(mask, longest, 1, axis=1)
    return upper * mask[..., None]


def principal_axes(moments, directions):
    """Each capsule's principal direction, on the side of its mean direction, `[J, D]`.

    The unit eigenvector `a_j` of the largest eigenvalue of `M_j`, signed so
    that `a_j . m_j >= 0` for the mean training direction `m_j`, the vector
    by which the restricted-domain sampler picks the half it draws in.
    """
    moments, directions = np.asarray(moments, "float64"), np.asarray(directions, "float64")
    if moments.ndim != 3 or directions.shape != moments.shape[:2]:
        raise InputError(f"principal_axes needs moments [J, D, D] and directions [J, D]. "
                         f"Received shapes {moments.shape} and {directions.shape}")
    check_finite(moments, "moments")
    check_finite(directions, "directions")
    axes = _principal_directions(moments)
    return axes * np.where(np.sum(axes * directions, axis=-1, keepdims=True) < 0, -1.0, 1.0)


def _principal_directions(moments):
    """Unit eigenvector of each `M_j`'s largest eigenvalue, `[J, D]` (sign arbitrary)."""
    return np.linalg.eigh(moments)[1][..., -1]


def winning_side_axes(upper, moments=None):
    """Each capsule's principal axis, signed toward the side its winning poses visit, `[J, D]`.

    Hauser (section 4.2) restricts sampling "to the half of S^15 that is
    visited during training". The design reads that half as `y . m_j >= 0`
    for the mean training direction `m_j`, which fits poses that lie on one
    side of the origin. When a capsule's poses lie along a line `+-a_j` on
    both sides (`pose_principal_share` near 1), `m_j` is a small difference
    of two large halves, and the half it picks may hold about half of the
    images the capsule wins. Here the half is `y . a_j >= 0`: `a_j` is the unit
    eigenvector of the largest eigenvalue of `M_j` (by default the second
    moment of the poses on the images where capsule j is the longest,
    `longest_pose_second_moments`), signed so that at least half of those
    images' poses have `x_j . a_j >= 0` (ties: the sign that makes the
    axis's first nonzero entry positive, for a deterministic answer). A
    capsule that wins no image is signed by all its poses.

    Args:
        upper: `[N, J, D]` squashed upper capsules of training data.
        moments: `[J, D, D]` moments to take the axes from, or None for
            `longest_pose_second_moments(upper)`.
    """
    upper = np.asarray(upper)
    if upper.ndim != 3 or len(upper) == 0:
        raise InputError(f"winning_side_axes needs upper capsules [N, J, D], N > 0. Received shape {upper.shape}")
    check_finite(upper, "upper")
    if moments is None:
        moments = longest_pose_second_moments(upper)[0]
    moments = np.asarray(moments, "float64")
    if moments.shape != (upper.shape[1], upper.shape[2], upper.shape[2]):
        raise InputError(f"winning_side_axes needs moments [J, D, D] = "
                         f"{(upper.shape[1], upper.shape[2], upper.shape[2])}. Received shape {moments.shape}")
    check_finite(moments, "moments")
    axes = _principal_directions(moments)
    first = axes[np.arange(len(axes)), np.argmax(np.abs(axes) > 1e-12, axis=-1)]
    axes = axes * np.where(first < 0, -1.0, 1.0)[:, None]
    winner = np.argmax(np.linalg.norm(upper, axis=-1), axis=1)
    for j in range(upper.shape[1]):
        poses = upper[winner == j, j] if np.any(winner == j) else upper[:, j]
        projections = poses @ axes[j]
        if np.sum(projections < 0) > np.sum(projections >= 0):
            axes[j] = -axes[j]
    return axes


def longest_capsule_side_clusters(upper, labels, classes, axes):
    """Images grouped by their longest capsule and by the side of its axis it lies on.

    The poses of a capsule lie along a line `+-a_j` on both sides of the
    origin (centred code; `pose_principal_share`), and P(on) = |x_j| cannot
    tell the sides apart, so one capsule may win one class on one side and
    another class on the other. Each capsule j gives two clusters: the
    images it wins with `x_j . a_j >= 0` (the "visited" side, the half the
    restricted-domain sampler draws in when `a_j` comes from
    `principal_axes`) and those with `x_j . a_j < 0`.

    Args:
        upper: `[N, J, D]` upper capsules.
        labels: `[N]` integer classes.
        classes: number of classes.
        axes: `[J, D]` one axis per capsule.

    Returns:
        dict: `both_sides`, the 2J clusters in `longest_capsule_clusters`'
        layout (cluster `2j` is capsule j's visited side, `2j + 1` the
        other); `visited_side`, the same figures over the J visited-side
        clusters alone; `visited_share`, the share of images on the
        visited side of their longest capsule.
    """
    upper, labels, axes = np.asarray(upper), np.asarray(labels), np.asarray(axes)
    if upper.ndim != 3 or len(upper) != len(labels) or len(labels) == 0 or axes.shape != upper.shape[1:]:
        raise InputError(f"longest_capsule_side_clusters needs upper [N, J, D], labels [N] (N > 0) and "
                         f"axes [J, D]. Received shapes {upper.shape}, {labels.shape} and {axes.shape}")
    labels = check_labels(labels, classes, len(upper))
    check_finite(upper, "upper")
    check_finite(axes, "axes")
    rows = np.arange(len(upper))
    winner = np.argmax(np.linalg.norm(upper, axis=-1), axis=1)
    other_side = np.sum(upper[rows, winner] * axes[winner], axis=-1) < 0
    both = _clusters(2 * winner + other_side, labels, classes, 2 * upper.shape[1])
    visited = _clusters(winner[~other_side], labels[~other_side], classes, upper.shape[1])
    return {"both_sides": both, "visited_side": visited, "visited_share": float(np.mean(~other_side))}


def longest_capsule_clusters(lengths, labels, classes):
    """Images grouped by their longest capsule: does each capsule win one class?

    If each capsule learns specific objects, the capsule that is longest on
    an image names the image's class, like a cluster. Each capsule's cluster
    is the images on which it is longest.

    Args:
        lengths: `[N, J]` capsule lengths.
        labels: `[N]` integer classes.
        classes: number of classes.

    Returns:
        dict with, per capsule, `size` (images it wins), `majority` (their
        most common class, None if it wins none) and `purity` (that class's
        share, None likewise); `overall_purity` (share of all images whose
        class is their cluster's majority), `mean_purity` (over the capsules
        that win any image, as `specialisation` averages over sampled
        columns) and `classes_covered` (distinct majority classes).
    """
    lengths, labels = np.asarray(lengths), np.asarray(labels)
    if lengths.ndim != 2 or len(lengths) != len(labels) or len(labels) == 0:
        raise InputError(f"longest_capsule_clusters needs lengths [N, J] and labels [N], N > 0. "
                         f"Received shapes {lengths.shape} and {labels.shape}")
    labels = check_labels(labels, classes, len(lengths))
    check_finite(lengths, "lengths")            # NumPy's argmax takes a NaN for the longest
    return _clusters(np.argmax(lengths, axis=1), labels, classes, lengths.shape[1])


def kmeans(points, k, seed=0, iterations=100):
    """Lloyd's k-means: `(centroids [k, F], assignment [N])`.

    The reference for "each capsule learns specific objects" with no
    capsules at all: `k` prototypes of the raw pixels, each image assigned to
    the nearest. Starts from `k` distinct points drawn with `seed`; stops
    when no assignment changes or after `iterations` updates. A cluster that
    loses all its points keeps its centroid. `points` are finite numbers.
    """
    points = check_array(points, "points", (None,), dtype="float64")
    k, iterations = check_integers(k=k, iterations=iterations)
    seed = check_seed(seed)
    if not 1 <= k <= len(points):
        raise InputError(f"kmeans needs points [N, F] and 1 <= k <= N. Received shape {points.shape} and k={k}")
    centroids = points[np.random.default_rng(seed).choice(len(points), k, replace=False)]
    assignment = None
    for _ in range(iterations):
        new = nearest_centroid(points, centroids)
        if assignment is not None and np.array_equal(new, assignment):
            break
        assignment = new
        counts = np.bincount(assignment, minlength=k)
        sums = np.eye(k)[assignment].T @ points
        kept = counts > 0
        centroids[kept] = sums[kept] / counts[kept, None]
    return centroids, nearest_centroid(points, centroids)


def nearest_centroid(points, centroids):
    """Index of each point's nearest centroid (squared Euclidean), `[N]`: points `[N, F]` and centroids `[K, F]`,
    finite numbers."""
    points = check_array(points, "points", (None,), dtype="float64")
    centroids = check_array(centroids, "centroids", (points.shape[1],), dtype="float64")
    distances = (np.sum(points ** 2, axis=1)[:, None] - 2 * points @ centroids.T
                 + np.sum(centroids ** 2, axis=1)[None])
    return np.argmin(distances, axis=1)


def cluster_purity(assignment, labels, classes, count):
    """`longest_capsule_clusters`' figures for any assignment of images to `count` clusters."""
    assignment, labels = np.asarray(assignment), np.asarray(labels)
    if assignment.shape != labels.shape or assignment.ndim != 1 or len(labels) == 0:
        raise InputError(f"cluster_purity needs assignment [N] and labels [N], N > 0. "
                         f"Received shapes {assignment.shape} and {labels.shape}")
    labels = check_labels(labels, classes, len(assignment))
    assignment = check_labels(assignment, count, len(assignment), name="assignment")
    return _clusters(assignment, labels, classes, count)


def _clusters(assignment, labels, classes, count):
    """Majority class and purity of each of `count` clusters (`longest_capsule_clusters`' dict)."""
    size, majority, purity, agreeing = [], [], [], 0
    for j in range(count):
        counts = np.bincount(labels[assignment == j], minlength=classes)
        size.append(int(counts.sum()))
        majority.append(int(np.argmax(counts)) if counts.sum() else None)
        purity.append(float(counts.max() / counts.sum()) if counts.sum() else None)
        agreeing += int(counts.max())
    return {"size": size, "majority": majority, "purity": purity,
            "overall_purity": agreeing / max(len(labels), 1),
            "mean_purity": float(np.mean(won)) if (won := [p for p in purity if p is not None]) else None,
            "classes_covered": len({m for m in majority if m is not None})}


def hoyer_sparsity(scores):
    """Mean Hoyer sparsity of score vectors `[..., n]`: 0 for all equal, 1 for one non-zero entry (and for none).

    `(sqrt(n) - |s|_1 / |s|_2) / (sqrt(n) - 1)` per vector; an all-zero
    vector, where the ratio is undefined, counts as 1 (nothing is on).
    """
    scores = np.asarray(scores, "float64")
    if scores.ndim < 1 or scores.shape[-1] < 2:
        raise InputError(f"hoyer_sparsity needs score vectors of at least 2 entries. Received shape {scores.shape}")
    check_array(scores.reshape(-1, scores.shape[-1]), "scores", what="scores", dtype="float64")
    n = scores.shape[-1]
    l1 = np.sum(np.abs(scores), axis=-1)
    l2 = np.sqrt(np.sum(np.square(scores), axis=-1))
    ratio = np.where(l2 > 0, l1 / np.where(l2 > 0, l2, 1.0), 1.0)
    return float(np.mean((np.sqrt(n) - ratio) / (np.sqrt(n) - 1)))
