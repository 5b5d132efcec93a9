"""Evaluate a layer-wise run: reconstruction, linear probes, groups by capsule, sample specialisation.

The same figures are computed for the capsule path and for the Bernoulli
RBM trained on the same data and budget. A reference classifier (a small
CNN trained once per run on the real images) names the sampled images.
"""

import dataclasses
import os

import keras
import numpy as np

from poecaps import metrics, partition
from poecaps.errors import InputError
from poecaps.experiments import figures
from poecaps.experiments.configs import DOMAINS, EvaluationConfig, LayerwiseConfig
from poecaps.experiments.progress import phase
from poecaps.experiments.runs import RunDir, load_images, read_settings
from poecaps.experiments.settings import config_or_default
from poecaps.experiments.trained import load_pipeline, load_rbm, training_capsules
from poecaps.graphs import batched
from poecaps.samplers import CapsuleSampler, RBMSampler


def _flat(images):
    """`[N, ...]` images as `[N, V]` rows."""
    return images.reshape(len(images), -1)


def _phase(what):
    """Report a step of the evaluation and its time (on stdout, as Keras' epochs; the commands send both to
    stderr, their stdout being the JSON)."""
    return phase("evaluate", what)


def _classifier(run, train, train_labels, test, test_labels, config):
    path = os.path.join(run.models, "reference_classifier.keras")
    if os.path.exists(path):
        model = keras.saving.load_model(path)
    else:
        model = metrics.reference_classifier(train.shape[1:], int(train_labels.max()) + 1, config.seed)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model.fit(train, train_labels, epochs=config.classifier_epochs, batch_size=128, verbose=2)
        model.save(path)
    accuracy = float(np.mean(_predict(model, test) == test_labels))
    return model, accuracy


def _predict(classifier, images):
    return np.argmax(classifier.predict(images, batch_size=512, verbose=0), axis=-1)


def _specialisation(classifier, images, classes):
    rows, cols = images.shape[:2]
    predicted = _predict(classifier, images.reshape(rows * cols, *images.shape[2:]))
    return metrics.specialisation(predicted.reshape(rows, cols), classes)


def _paper_sampler_draws(pipeline, classifier, classes, config):
    """The paper's N(0, I) grid, `config.draws` draws of `config.rows` per capsule in each domain.

    Draw k uses `CapsuleSampler(seed=config.seed + k)`. `samples_<domain>`
    is draw 0; `samples_<domain>_draws` lists every draw's classes and
    purity, since one draw can cover a class more or less by chance.
    """
    found = {}
    seeds = [config.seed + k for k in range(config.draws)]
    for domain in DOMAINS:
        drawn = [_specialisation(classifier, CapsuleSampler(pipeline, seed=s).sample(config.rows, domain)["images"],
                                 classes) for s in seeds]
        found[f"samples_{domain}"] = drawn[0]
        found[f"samples_{domain}_draws"] = {"sampler_seeds": seeds,
                                            "classes_covered": [d["classes_covered"] for d in drawn],
                                            "mean_purity": [d["mean_purity"] for d in drawn]}
        print(f"[evaluate] N(0, I), {domain} domain, {config.draws} draws: classes "
              f"{found[f'samples_{domain}_draws']['classes_covered']}, mean purity "
              f"{[round(d['mean_purity'], 3) for d in drawn]}", flush=True)
    return found


def _result_grid(run, classifier, classes):
    """The classes and purity of the run's own grid, `samples.npz` (None if there is none)."""
    path = run.file("samples.npz")
    if not os.path.exists(path):
        print("[evaluate] no samples.npz: the result grid is left out (scripts/sample.py, api.sample draw it)",
              flush=True)
        return None
    try:
        with np.load(path) as stored:
            images, domain, seed = stored["images"], str(stored["domain"]), int(stored["seed"])
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"{path} is unreadable ({error}); draw the grid again with scripts/sample.py.") from None
    found = {"domain": domain, "seed": seed, "rows": int(images.shape[0]),
             **_specialisation(classifier, images, classes)}
    print(f"[evaluate] the result grid (samples.npz, {domain} domain, {images.shape[0]} rows): "
          f"{found['classes_covered']} class{'' if found['classes_covered'] == 1 else 'es'}, "
          f"mean purity {found['mean_purity']:.3f}", flush=True)
    return found


def rbm_likelihood(rbm, train, test, seed, max_units=22):
    """The RBM's mean log-likelihood of the test images, each binarised once, beside independent pixels' (nats).

    The RBM is a distribution over binary images, so each test image is
    drawn once, every pixel on with its grey value as probability
    (`partition.binarise(test, seed)`). `log Z` is exact over the smaller
    layer's states up to `max_units` units, else estimated by AIS (100
    chains, 10,000 temperatures, from the training images' base-rate
    model; its standard error is reported). The comparison is the
    independent-pixel model fitted to the training images
    (`partition.base_rate_bias`), whose `log Z` is closed-form.
    """
    v = partition.binarise(_flat(test), seed)
    base = partition.base_rate_bias(_flat(train))
    log_z, std_error, method = partition.log_partition(rbm, max_units, base_visible_bias=base, seed=seed)
    return {"test_log_likelihood": float(partition.log_likelihood(rbm, v, log_z).mean()),
            "independent_pixels_test_log_likelihood": float(partition.independent_log_likelihood(base, v).mean()),
            "log_partition": log_z, "log_partition_method": method, "log_partition_std_error": std_error,
            "binarisation_seed": seed}


def _rbm_figures(rbm, train, train_labels, test, test_labels, classifier, classes, run, config):
    """The baseline's figures: reconstruction, probe on P(on), samples' specialisation, log-likelihood."""
    hidden_train, hidden_test = batched(rbm.p_on, _flat(train)), batched(rbm.p_on, _flat(test))
    rbm_images = RBMSampler(rbm, train.shape[1:], seed=config.seed).sample(config.rows)["images"]
    figures.image_grid(rbm_images[:4], run.file("rbm_samples.png"),
                       title="Bernoulli RBM: one column per hidden unit")
    likelihood = rbm_likelihood(rbm, train, test, config.seed)
    print(f"[evaluate] Bernoulli RBM: test log-likelihood {likelihood['test_log_likelihood']:.2f} nats "
          f"(log Z {likelihood['log_partition_method']}), independent pixels "
          f"{likelihood['independent_pixels_test_log_likelihood']:.2f}", flush=True)
    return {
        "hidden_units": rbm.num_hidden,
        "reconstruction_mse": metrics.mse(
            test, batched(rbm.reconstruct, _flat(test)).reshape(test.shape)),
        "probe_accuracy_hidden": metrics.linear_probe(
            hidden_train, train_labels, hidden_test, test_labels),
        "samples_full": _specialisation(classifier, rbm_images, classes),
        "probability_selectivity": metrics.class_selectivity(hidden_test, test_labels, classes),
        "likelihood": likelihood,
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
    centroids, _ = metrics.kmeans(_flat(train), k, seed=seed)
    return {"clusters": metrics.cluster_purity(metrics.nearest_centroid(_flat(test), centroids),
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


def _capsule_figures(pipeline, run, train, train_labels, test, test_labels, classifier, classes, config):
    """Everything `eval.json` says about the capsule path (`poecaps`)."""
    with _phase(f"capsules of {len(train)} training and {len(test)} test images, reconstructions"):
        train_upper = training_capsules(run, pipeline, train)
        test_code = batched(pipeline.autoencoder.encode, test)
        test_upper = batched(pipeline.upper_capsules, batched(pipeline.capsules_from_code, test_code))
        reconstruction = pipeline.decode(test_upper)
    test_lengths, train_lengths = np.linalg.norm(test_upper, axis=-1), np.linalg.norm(train_upper, axis=-1)
    with _phase("linear probes"):
        probes = (metrics.linear_probe(train_upper, train_labels, test_upper, test_labels),
                  metrics.linear_probe(train_lengths, train_labels, test_lengths, test_labels))
    found = {
        "reconstruction_mse": metrics.mse(test, reconstruction),
        "probe_accuracy_vectors": probes[0],
        "probe_accuracy_lengths": probes[1],
        "mean_p_on_test": float(np.mean(test_lengths)),
        "length_selectivity": metrics.class_selectivity(test_lengths, test_labels, classes),
        # Does the whole capsule code keep the class? The reference classifier on
        # test images reconstructed through the capsule path.
        "reconstruction_class_accuracy": float(np.mean(_predict(classifier, reconstruction) == test_labels)),
        "longest_capsule_clusters": metrics.longest_capsule_clusters(test_lengths, test_labels, classes),
        "training_images_longest": np.bincount(np.argmax(train_lengths, axis=1),
                                               minlength=pipeline.num_upper).tolist(),
    }
    # The groups split by the side of each capsule's principal axis that the
    # pose lies on (P(on) cannot tell the sides apart).
    axes = metrics.principal_axes(metrics.longest_pose_second_moments(train_upper)[0],
                                  metrics.mean_directions(train_upper))
    found["longest_capsule_side_clusters"] = metrics.longest_capsule_side_clusters(
        test_upper, test_labels, classes, axes)
    share = metrics.principal_share(metrics.pose_second_moments(train_upper))
    found["pose_principal_share"] = {"per_capsule": [float(v) for v in share], "mean": float(share.mean())}
    if config.diagnostics:
        found.update(_diagnostics(pipeline, test, test_code, test_upper, test_lengths, test_labels, classifier,
                                  classes, axes))
    with _phase(f"samples, {config.draws} draws of {config.rows} per capsule in each domain"):
        found.update(_paper_sampler_draws(pipeline, classifier, classes, config))
    shown = np.linspace(0, len(test) - 1, 12).astype(int)  # spread over classes
    figures.image_grid(np.stack([test[shown], reconstruction[shown]]), run.file("reconstructions.png"),
                       title="test images (top) and their reconstructions through the capsule path",
                       row_labels=["data", "capsules"])
    return found


def _diagnostics(pipeline, test, test_code, test_upper, test_lengths, test_labels, classifier, classes, axes):
    """The study's diagnostic figures (opt-in: `EvaluationConfig.diagnostics`).

    What one capsule can show at best (a Figure 2 sample has one capsule on):
    each test image's code cut to its longest capsule, decoded and labelled,
    and the groups by longest capsule labelled by that decoding; and the
    front end's own reconstruction error.
    """
    with _phase("one-capsule decodings and the autoencoder alone"):
        one_capsule = _predict(classifier, pipeline.decode(metrics.keep_longest(test_upper)))
        autoencoder_only = batched(pipeline.autoencoder.decode, test_code)
    return {"autoencoder_only_mse": metrics.mse(test, autoencoder_only),
            "one_capsule_reconstruction_class_accuracy": float(np.mean(one_capsule == test_labels)),
            "one_capsule_decoded_clusters": metrics.longest_capsule_clusters(test_lengths, one_capsule, classes),
            "one_capsule_decoded_side_clusters": metrics.longest_capsule_side_clusters(
                test_upper, one_capsule, classes, axes)}


def evaluate_run(run_dir, config=None):
    """Compute and write `run_dir/eval.json`; returns the dict (`config`: an `EvaluationConfig`)."""
    config = config_or_default(config, EvaluationConfig)
    run = RunDir(run_dir, create=False)
    train_config = read_settings(run, LayerwiseConfig)
    pipeline = load_pipeline(run, train_config)
    train, train_labels, _ = load_images(train_config, "train")
    test, test_labels, _ = load_images(train_config, "test")
    run.record_environment("evaluate")                  # once the images have loaded: a failed call leaves no line
    classes = int(max(train_labels.max(), test_labels.max())) + 1
    with _phase("reference classifier"):
        classifier, classifier_accuracy = _classifier(run, train, train_labels, test, test_labels, config)
    result = {"dataset": train_config.dataset, "train_images": len(train), "test_images": len(test),
              "evaluation": dataclasses.asdict(config), "reference_classifier_test_accuracy": classifier_accuracy}
    grid = _result_grid(run, classifier, classes)
    if grid is not None:
        result["result_grid"] = grid
    result["poecaps"] = _capsule_figures(pipeline, run, train, train_labels, test, test_labels, classifier,
                                         classes, config)
    if config.diagnostics:
        with _phase(f"pixel k-means reference ({pipeline.num_upper} clusters)"):
            result["pixel_kmeans"] = _kmeans_reference(train, test, test_labels, classifier, classes,
                                                       pipeline.num_upper, config.seed)
    result["class_mean_reference"] = _class_mean_reference(train, train_labels, classifier, classes)
    rbm = load_rbm(run)
    if rbm is None:
        print("[evaluate] no trained Bernoulli RBM (models/rbm.keras): its figures are left out", flush=True)
    else:
        with _phase("Bernoulli RBM"):
            result["rbm"] = _rbm_figures(rbm, train, train_labels, test, test_labels, classifier, classes,
                                         run, config)
    run.write_json("eval.json", result)
    return result
