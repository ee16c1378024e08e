"""Loads items.jsonl, beside this file, as the jserve_mc task's test split (no hub, whatever the working directory)."""

from pathlib import Path

import datasets


def load_items(**kwargs) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("items.jsonl"))})
