"""The prompts the shipped MTP head of the default model was trained on (docs/methods.md#mtp).

Writes a JSONL of prompts for ``specdec train-mtp``: code-edit prompts built from standard-library
modules that the benchmarks do *not* use (so that the code-edit benchmark stays held out), with
several instructions, and chat prompts from templates (explanations, stories, tips,
comparisons, small programs). The target answers them itself while training collects.

    python training/mtp_corpus.py > mtp_prompts.jsonl
    python training/mtp_corpus.py --text-dir mtp_text    # the source files read as text

Training reads standard-library source as text too (:data:`TEXT_MODULES`, also disjoint from the
benchmark's): cheap data (a prefill, no generation) with the target's own argmax as labels.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

from specdec.workloads import stdlib_functions

# Disjoint from specdec.workloads._SOURCE_MODULES (the benchmark's code-edit prompts).
TRAIN_MODULES = ("json.encoder", "csv", "functools", "copy", "pprint", "reprlib", "operator", "keyword",
                 "tokenize", "quopri", "uu", "netrc", "ntpath", "genericpath", "random", "locale", "gettext",
                 "ipaddress", "fractions", "zipfile", "tarfile", "configparser", "argparse", "optparse")
TEXT_MODULES = ("functools", "csv", "argparse", "configparser", "random", "fractions", "json.decoder",
                "json.encoder", "dataclasses", "pprint", "tokenize", "copy", "ipaddress", "zipfile", "gettext",
                "locale")
INSTRUCTIONS = ("Add type hints to this function and return the full code.",
                "Add a docstring to this function and return the full code.",
                "Rename the variables of this function to clearer names and return the full code.",
                "Explain what this function does, step by step.")
CONCEPTS = ("a hash table", "recursion", "photosynthesis", "inflation", "a black hole", "machine learning",
            "the internet", "gravity", "a binary search", "democracy", "vaccines", "climate change",
            "a linked list", "compound interest", "the immune system", "an API", "encryption", "evolution",
            "the stock market", "a compiler", "electricity", "the water cycle", "DNA", "a database index",
            "object-oriented programming", "the greenhouse effect", "supply and demand", "a neural network",
            "version control", "the speed of light")
SUBJECTS = ("a dragon who learns to bake bread", "a robot who wants to be a gardener", "a lost kitten in a big city",
            "two friends on a sailing trip", "a wizard who forgot his spells", "a girl who can talk to birds",
            "an astronaut alone on Mars", "a detective solving a mystery at a bakery", "a tree that can walk",
            "a shy ghost in an old library", "a knight afraid of the dark", "a village without music")
ACTIVITIES = ("learning a new language", "staying productive at home", "writing clean code", "sleeping better",
              "saving money", "running a first marathon", "studying for exams", "cooking healthy meals",
              "giving a presentation", "starting a vegetable garden")
PAIRS = (("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "a bacterium"), ("TCP", "UDP"),
         ("RAM", "storage"), ("a process", "a thread"), ("speed", "velocity"), ("HTML", "CSS"),
         ("a stack", "a queue"), ("mitosis", "meiosis"))
TASKS = ("reverses a string", "checks whether a number is prime", "counts the words in a text",
         "merges two sorted lists", "finds the largest element of a list", "computes the factorial of n",
         "removes duplicates from a list", "checks whether a string is a palindrome",
         "converts Celsius to Fahrenheit", "returns the n-th Fibonacci number", "flattens a nested list",
         "sorts a list of dictionaries by a key")


def prompts() -> list[str]:
    code = [f"{instruction}\n\n```python\n{source}\n```"
            for source in stdlib_functions(modules=TRAIN_MODULES) for instruction in INSTRUCTIONS]
    chat = [f"Explain {c} in simple terms." for c in CONCEPTS]
    chat += [f"Write a short paragraph about {c}." for c in CONCEPTS]
    chat += [f"What are the main ideas behind {c}?" for c in CONCEPTS]
    chat += [f"Write a short poem about {s}." for s in SUBJECTS]
    chat += [f"Write a short story about {s}." for s in SUBJECTS]
    chat += [f"Give five tips for {a}." for a in ACTIVITIES]
    chat += [f"What is the difference between {a} and {b}?" for a, b in PAIRS]
    chat += [f"Write a Python function that {t}." for t in TASKS]
    return code + chat


def write_texts(directory: str) -> None:
    """One ``<module>.py.txt`` per :data:`TEXT_MODULES` in ``directory``."""
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name in TEXT_MODULES:
        (out / f"{name}.py.txt").write_text(inspect.getsource(importlib.import_module(name)))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--text-dir":
        write_texts(sys.argv[2])
    else:
        for prompt in prompts():
            sys.stdout.write(json.dumps({"prompt": prompt}) + "\n")
