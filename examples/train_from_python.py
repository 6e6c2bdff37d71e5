"""Train the digits recipe from Python and print its summary: vitrain as a library, no command line.

python examples/train_from_python.py                      # the whole recipe (about a minute on 2 CPU cores)
python examples/train_from_python.py train.epochs=2       # any section.key=value overrides
"""

import json
import sys

import vitrain


def main() -> None:
    # A shipped recipe by name (or a YAML path, a dict of sections, a vitrain.Config), then overrides.
    cfg = vitrain.load_config("digits", ["log.progress=false", *sys.argv[1:]])
    print(f"training {cfg.name}: {cfg.model.depth} blocks of width {cfg.model.width}, {cfg.train.epochs} epochs")
    summary = vitrain.train(cfg)  # returns summary.json's fields
    print(json.dumps({key: summary[key] for key in ("val_top1", "val_top5", "steps", "images_per_s", "checkpoint")}))


# Loader worker processes (data.loader_workers) start from a fork server that imports this script: the run starts
# only where the script is run, not where it is imported.
if __name__ == "__main__":
    main()
