"""Evaluate a layer-wise run: reconstruction, linear probes, sample specialisation.

The same figures are computed for the capsule path and for the Bernoulli
RBM trained on the same data and budget.
"""

import contextlib
import os
import sys
import time

import keras
import numpy as np

from poecaps import figures, metrics
from poecaps.configs import EvaluationConfig, LayerwiseConfig
from poecaps.runs import CapsulePipeline, RunDir, batched, load_layer
from samplers import CapsuleSampler, RBMSampler


@contextlib.contextmanager
def _phase(what):
    """Report a step of the evaluation and its time on stderr (stdout carries the JSON)."""
    print(f"[evaluate] {what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"[evaluate] {what}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _classifier(run, train, train_labels, test, test_labels, config):
    path = os.path.join(run.models, "reference_classifier.keras")
    if os.path.exists(path):
        model = keras.saving.load_model(path)
    else:
        model = metrics.reference_classifier(train.shape[1:], int(train_labels.max()) + 1, config.seed)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        with contextlib.redirect_stdout(sys.stderr):  # stdout is for the figures (JSON)
            model.fit(train, train_labels, epochs=config.classifier_epochs, batch_size=128, verbose=2)
        model.save(path)
    accuracy = float(model.evaluate(test, test_labels, verbose=0)[1])
    return model, accuracy


def _predict(classifier, images):
    return np.argmax(classifier.predict(images, verbose=0), axis=-1)


def _specialisation(classifier, images, classes):
    rows, cols = images.shape[:2]
    predicted = _predict(classifier, images.reshape(rows * cols, *images.shape[2:]))
    return metrics.specialisation(predicted.reshape(rows, cols), classes)


def _capsule_samples(pipeline, moments, classifier, classes, run, config):
    """Specialisation of the Figure 2 grid and of the fitted draws; writes their figures."""
    found = {}
    sampler = CapsuleSampler(pipeline, seed=config.seed)
    # The restricted domain's half: the design's (mean training direction) and,
    # for poses on a line through the origin, the side each capsule's winning
    # poses visit (`metrics.winning_side_axes`).
    domains = {"full": (False, "mean")}
    if config.restricted:
        domains.update(restricted=(True, "mean"), winning_side=(True, "winning"))
    for domain, (restricted, half) in domains.items():
        images = sampler.sample(config.rows, restricted=restricted, half=half)["images"]
        found[f"samples_{domain}"] = _specialisation(classifier, images, classes)
        # Not the paper's sampler: draws from each capsule's own pose moments,
        # on all training images (N(0, M_j)) or where it is the longest.
        for name, title in (("fitted", "N(0, M_j)"), ("fitted_longest", "N(0, M_j | j longest)")):
            images = sampler.sample(config.rows, restricted=restricted, moments=moments[name],
                                    half=half)["images"]
            found[f"samples_{name}_{domain}"] = _specialisation(classifier, images, classes)
            figures.image_grid(images[:4], run.file(f"samples_{name}_{domain}.png"),
                               title=f"One capsule drawn from {title}, {domain.replace('_', ' ')} domain "
                                     "(not the paper's N(0, I)): one column per capsule",
                               column_labels=range(images.shape[1]))
    found.update(_paper_sampler_draws(pipeline, classifier, classes, list(domains.items()), found, config))
    return found


def _paper_sampler_draws(pipeline, classifier, classes, domains, first, config):
    """The paper's N(0, I) grid drawn `config.draws` times per domain.

    Draw k uses `CapsuleSampler(seed=config.seed + k)`; draw 0 is the one
    reported as `samples_<domain>` (`first`). One draw of `rows` per capsule
    can cover a class more or less by chance, so the spread over draws says
    how far a single figure can be trusted.
    """
    found = {f"samples_{domain}_draws": {"sampler_seeds": [config.seed],
                                         "classes_covered": [first[f"samples_{domain}"]["classes_covered"]],
                                         "mean_purity": [first[f"samples_{domain}"]["mean_purity"]]}
             for domain, _ in domains}
    for k in range(1, config.draws):
        sampler = CapsuleSampler(pipeline, seed=config.seed + k)
        for domain, (restricted, half) in domains:
            images = sampler.sample(config.rows, restricted=restricted, half=half)["images"]
            drawn = _specialisation(classifier, images, classes)
            entry = found[f"samples_{domain}_draws"]
            entry["sampler_seeds"].append(config.seed + k)
            entry["classes_covered"].append(drawn["classes_covered"])
            entry["mean_purity"].append(drawn["mean_purity"])
    for domain, _ in domains:
        entry = found[f"samples_{domain}_draws"]
        print(f"[evaluate] N(0, I), {domain.replace('_', ' ')} domain, {config.draws} draws: classes "
              f"{entry['classes_covered']}, mean purity {[round(p, 3) for p in entry['mean_purity']]}",
              file=sys.stderr, flush=True)
    return found


def _rbm_figures(rbm, train, train_labels, test, test_labels, classifier, classes, run, config):
    """The baseline's figures: reconstruction, probe on P(on), samples' specialisation."""
    flat = lambda x: x.reshape(len(x), -1)
    hidden_train, hidden_test = batched(rbm.p_on, flat(train)), batched(rbm.p_on, flat(test))
    rbm_images = RBMSampler(rbm, train.shape[1:], seed=config.seed).sample(config.rows)["images"]
    figures.image_grid(rbm_images[:4], run.file("rbm_samples.png"),
                       title="Bernoulli RBM: one column per hidden unit")
    return {
        "hidden_units": rbm.num_hidden,
        "reconstruction_mse": metrics.mse(
            test, batched(rbm.reconstruct, flat(test)).reshape(test.shape)),
        "probe_accuracy_hidden": metrics.linear_probe(
            hidden_train, train_labels, hidden_test, test_labels),
        "samples_full": _specialisation(classifier, rbm_images, classes),
        "probability_selectivity": metrics.class_selectivity(hidden_test, test_labels, classes),
    }


def _named_prototypes(classifier, images):
    """The reference classifier's class for each prototype image, and how many distinct classes."""
    named = _predict(classifier, images)
    return {"named": [int(c) for c in named], "classes_covered": len(set(named.tolist()))}


def _kmeans_reference(train, test, test_labels, classifier, classes, k, seed):
    """What k pixel prototypes reach on the same figures as the J capsules.

    `clusters`: the test images grouped by their nearest centroid, as
    `longest_capsule_clusters` groups them by their longest capsule.
    `centroids`: each centroid, shown to the reference classifier as an
    image, as a capsule's sample is; `classes_covered` counts the distinct
    classes it names (the best a sampler that always drew the cluster mean
    could reach).
    """
    flat = lambda x: x.reshape(len(x), -1)
    centroids, _ = metrics.kmeans(flat(train), k, seed=seed)
    return {"clusters": metrics.cluster_purity(metrics.nearest_centroid(flat(test), centroids),
                                               test_labels, classes, k),
            "centroids": _named_prototypes(classifier, centroids.reshape(k, *train.shape[1:]).astype("float32"))}


def _class_mean_reference(train, train_labels, classifier, classes):
    """The reference classifier on each class's mean training image.

    What a sampler that drew each class's prototype would show. A guide to
    what blurred, prototype-like samples can cover, not a bound: a blurred
    sample is not a class mean, and may be named otherwise.
    """
    present = [c for c in range(classes) if np.any(train_labels == c)]
    means = np.stack([train[train_labels == c].mean(axis=0) for c in present]).astype("float32")
    named = _named_prototypes(classifier, means)
    return {"classes": present, **named,
            "named_as_itself": int(np.sum(np.asarray(named["named"]) == np.asarray(present)))}


def evaluate_run(run_dir, config=None):
    """Compute and write `run_dir/eval.json`; returns the dict (`config`: an `EvaluationConfig`)."""
    config = config or EvaluationConfig()
    from trainers.layerwise import load_images

    run = RunDir(run_dir)
    train_config = LayerwiseConfig(**run.read_json("config.json"))
    train, train_labels, _ = load_images(train_config, "train")
    test, test_labels, _ = load_images(train_config, "test")
    classes = int(max(train_labels.max(), test_labels.max())) + 1
    with _phase("reference classifier"):
        classifier, classifier_accuracy = _classifier(run, train, train_labels, test, test_labels, config)
    result = {"dataset": train_config.dataset, "train_images": len(train), "test_images": len(test),
              "reference_classifier_test_accuracy": classifier_accuracy}

    pipeline = CapsulePipeline.load(run.models, train_config.capsule_dim)
    if pipeline.encoder is None or pipeline.decoder is None:
        raise FileNotFoundError(f"{run_dir} has no trained encoder and decoder; train them first.")
    with _phase(f"capsules of {len(train)} training and {len(test)} test images, reconstructions"):
        test_lower = batched(pipeline.lower_capsules, test)
        test_upper = batched(pipeline.upper_capsules, test_lower)
        train_upper = batched(lambda x: pipeline.upper_capsules(pipeline.lower_capsules(x)), train)
        reconstruction = batched(pipeline.decode_upper, test_upper)
        autoencoder_only = batched(pipeline.autoencoder, test)
    test_lengths, train_lengths = np.linalg.norm(test_upper, axis=-1), np.linalg.norm(train_upper, axis=-1)
    with _phase("linear probes"):
        probes = (metrics.linear_probe(train_upper, train_labels, test_upper, test_labels),
                  metrics.linear_probe(train_lengths, train_labels,
                                       test_lengths, test_labels))
    capsules = {
        "reconstruction_mse": metrics.mse(test, reconstruction),
        "autoencoder_only_mse": metrics.mse(test, autoencoder_only),
        "probe_accuracy_vectors": probes[0],
        "probe_accuracy_lengths": probes[1],
        "mean_p_on_test": float(np.mean(test_lengths)),
        "length_selectivity": metrics.class_selectivity(test_lengths, test_labels, classes),
        # Does the whole capsule code keep the class? The reference classifier on
        # test images reconstructed through the capsule path.
        "reconstruction_class_accuracy": float(np.mean(
            _predict(classifier, reconstruction) == test_labels)),
    }
    # What one capsule can show at best (a Figure 2 sample has one capsule on):
    # each test image's code cut to its longest capsule, decoded and labelled;
    # the images grouped by their longest capsule, by true class and by the
    # class of that one-capsule decoding (the most any sampler of a capsule's
    # own "on" poses could show).
    with _phase("one-capsule decodings"):
        one_capsule = _predict(classifier, batched(pipeline.decode_upper, metrics.keep_longest(test_upper)))
    capsules["one_capsule_reconstruction_class_accuracy"] = float(np.mean(one_capsule == test_labels))
    capsules["longest_capsule_clusters"] = metrics.longest_capsule_clusters(test_lengths, test_labels, classes)
    capsules["one_capsule_decoded_clusters"] = metrics.longest_capsule_clusters(
        test_lengths, one_capsule, classes)
    # Runs trained before the decoder stage stored the moments: same figures from the same data.
    moments = {"fitted": pipeline.pose_moments, "fitted_longest": pipeline.longest_pose_moments}
    for name, fit, file in (("fitted", metrics.pose_second_moments, "pose_moments"),
                            ("fitted_longest", lambda u: metrics.longest_pose_second_moments(u)[0],
                             "longest_pose_moments")):
        if moments[name] is None:
            moments[name] = fit(train_upper)
            np.save(os.path.join(run.models, f"{file}.npy"), moments[name].astype("float32"))
    if pipeline.winning_axes is None:
        pipeline.winning_axes = metrics.winning_side_axes(train_upper, moments["fitted_longest"])
        np.save(os.path.join(run.models, "winning_axes.npy"), pipeline.winning_axes.astype("float32"))
    # The same groups split by the side of each capsule's principal axis that
    # the pose lies on (P(on) cannot tell the sides apart): by true class and
    # by the class of the one-capsule decoding.
    axes = metrics.principal_axes(moments["fitted_longest"], pipeline.mean_directions)
    capsules["longest_capsule_side_clusters"] = metrics.longest_capsule_side_clusters(
        test_upper, test_labels, classes, axes)
    capsules["one_capsule_decoded_side_clusters"] = metrics.longest_capsule_side_clusters(
        test_upper, one_capsule, classes, axes)
    share = metrics.principal_share(moments["fitted"])
    capsules["pose_principal_share"] = {"per_capsule": [float(v) for v in share],
                                        "mean": float(share.mean())}
    capsules["training_images_longest"] = np.bincount(
        np.argmax(train_lengths, axis=1), minlength=pipeline.num_upper).tolist()
    with _phase(f"samples, {config.rows} per capsule and sampler ({config.draws} draws of N(0, I))"):
        capsules.update(_capsule_samples(pipeline, moments, classifier, classes, run, config))
    result["poecaps"] = capsules
    shown = np.linspace(0, len(test) - 1, 12).astype(int)  # spread over classes
    figures.image_grid(np.stack([test[shown], reconstruction[shown]]), run.file("reconstructions.png"),
                       title="test images (top) and their reconstructions through the capsule path",
                       row_labels=["data", "capsules"])

    with _phase(f"pixel k-means reference ({pipeline.num_upper} clusters)"):
        result["pixel_kmeans"] = _kmeans_reference(train, test, test_labels, classifier, classes,
                                                   pipeline.num_upper, config.seed)

    result["class_mean_reference"] = _class_mean_reference(train, train_labels, classifier, classes)

    rbm_path = os.path.join(run.models, "rbm.npz")
    if os.path.exists(rbm_path):
        with _phase("Bernoulli RBM"):
            result["rbm"] = _rbm_figures(load_layer(rbm_path), train, train_labels, test, test_labels,
                                         classifier, classes, run, config)
    run.write_json("eval.json", result)
    return result
