"""Refit the answer calibration of a `kb eval --answers` database with the code checked out (issue 31), so that a
change to the fit can be measured on a store that was ingested before it: a refresh refits only when the corpus or
what its scopes may read changed.

    KB_HOME=/tmp/kb-h-<set> python -m bench.refit_answers OUT/<set>
    KB_HOME=/tmp/kb-h-<set> kb eval --answers OUT/<set> --json > after.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.answers.calibration import calibrate, current
from pipelines.evaluation.evaluate import dataset_name, evaluation_settings
from pipelines.retrieval.responses import query_embedder
from pipelines.settings import load_settings
from pipelines.storage.database import connect


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", type=Path, help="the answer set folder `kb eval --answers` was given")
    dataset = parser.parse_args().dataset
    if not (dataset / "corpus.jsonl").is_file():
        parser.error(f"{dataset}: no corpus.jsonl; give the folder `kb eval --answers` was given")
    name = dataset_name(dataset)
    settings = evaluation_settings(load_settings(), f"kb_eval_answers_{name}", None)  # as kb eval names it
    with connect(settings) as conn:
        embedder = query_embedder(conn, settings)
        calibrate(conn, settings, embedder, force=True)
        fitted = current(conn, embedder.model_key, [])
    print(f"kb_eval_answers_{name}: answers at {fitted.answer_at}, left-out ceiling {fitted.left_out_ceiling},"
          f" weights {[round(w, 3) for w in fitted.weights]}")


if __name__ == "__main__":
    main()
