"""Small real data files shipped in the package (see SOURCES.md beside this file)."""

from __future__ import annotations

import csv
import json
import pathlib

DATA_DIR = pathlib.Path(__file__).parent
WIKITEXT2_VALID = DATA_DIR / "wikitext-2" / "valid.txt"
WIKITEXT2_TEST = DATA_DIR / "wikitext-2" / "test.txt"
CHATGPT_PROMPTS = DATA_DIR / "chatgpt-prompts" / "prompts.csv"
ALPACA = DATA_DIR / "alpaca" / "alpaca_en_demo.json"

# Corpora addressable by name (jpinfer.profile(model, "wikitext2-valid")): file and text fields.
BUNDLED_CORPORA: dict[str, tuple[pathlib.Path, tuple[str, ...]]] = {
    "wikitext2-valid": (WIKITEXT2_VALID, ()),
    "wikitext2-test": (WIKITEXT2_TEST, ()),
    "chatgpt-prompts": (CHATGPT_PROMPTS, ("prompt",)),
}


def chatgpt_prompts() -> list[str]:
    """The 166 prompts of the bundled ChatGPT prompts CSV, in file order."""
    with CHATGPT_PROMPTS.open(newline="", encoding="utf-8") as f:
        return [row["prompt"] for row in csv.DictReader(f)]


def alpaca_prompts() -> list[str]:
    """The 999 instructions of the bundled Alpaca sample, each followed by its input when it has one."""
    records = json.loads(ALPACA.read_text(encoding="utf-8"))
    return [r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "") for r in records]
