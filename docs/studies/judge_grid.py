"""An independent judge of a sampled grid: a perceptron, not the reference CNN, labels RUN/samples.npz.

Usage: python docs/studies/judge_grid.py RUN [--seed 0] [--epochs 10]

Trains a two-hidden-layer perceptron (512, 256, ReLU, dropout 0.2; Adam) on
the run's training images, reports its test accuracy, then labels each
image of `RUN/samples.npz` and prints the grid's classes covered and mean
purity (each capsule's majority class and its share of the capsule's rows),
the same figures `evaluate.py` computes with its own classifier. Writes
`RUN/judge.json`.
"""

import argparse
import json

import keras
import numpy as np

from poecaps import metrics
from poecaps.experiments.configs import LayerwiseConfig
from poecaps.experiments.runs import RunDir, load_images, read_settings


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=10)
    args = p.parse_args()
    run = RunDir(args.run_dir, create=False)
    config = read_settings(run, LayerwiseConfig)
    train, train_labels, _ = load_images(config, "train")
    test, test_labels, _ = load_images(config, "test")
    keras.utils.set_random_seed(args.seed)
    classes = int(train_labels.max()) + 1
    judge = keras.Sequential([
        keras.Input(train.shape[1:]), keras.layers.Flatten(),
        keras.layers.Dense(512, activation="relu"), keras.layers.Dropout(0.2, seed=args.seed),
        keras.layers.Dense(256, activation="relu"), keras.layers.Dropout(0.2, seed=args.seed),
        keras.layers.Dense(classes, activation="softmax")])
    judge.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    judge.fit(train, train_labels, epochs=args.epochs, batch_size=128, verbose=2)
    accuracy = float(np.mean(np.argmax(judge.predict(test, verbose=0), -1) == test_labels))
    with np.load(run.file("samples.npz")) as stored:
        images = stored["images"]
    rows, cols = images.shape[:2]
    labels = np.argmax(judge.predict(images.reshape(rows * cols, *images.shape[2:]), verbose=0), -1)
    found = {"judge": "perceptron 512-256", "seed": args.seed, "epochs": args.epochs,
             "judge_test_accuracy": accuracy, "grid_shape": list(images.shape),
             **metrics.specialisation(labels.reshape(rows, cols), classes)}
    run.write_json("judge.json", found)
    print(json.dumps({k: found[k] for k in ("judge_test_accuracy", "classes_covered", "mean_purity")}))


if __name__ == "__main__":
    main()
