"""The prompts the shipped MTP head of the default model was trained on (docs/methods.md#mtp).

Writes a JSONL of prompts for ``specdec train-mtp``: code-edit prompts built from standard-library
modules that the benchmarks do *not* use (so that the code-edit benchmark stays held out), with
several instructions, and chat prompts from templates (explanations, stories, tips,
comparisons, small programs). The target answers them itself while training collects.

    python training/mtp_corpus.py > mtp_prompts.jsonl
    python training/mtp_corpus.py --text-dir mtp_text    # the source files read as text
    python training/mtp_corpus.py --self-instruct 4000 > mtp_self.jsonl  # user turns the target writes

``--self-instruct N`` asks the target for user messages (Magpie's method: its chat template up
to the user turn, sampled): questions and tasks as varied as the model's own instruction
data, unlike the templates' few forms (:func:`self_instruct`).

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
# The chat topics: none of them is a topic of specdec.workloads.CHAT_PROMPTS (the benchmark's
# chat prompts stay held out).
CONCEPTS = ("a hash table", "recursion", "photosynthesis", "inflation", "a black hole", "machine learning",
            "the internet", "gravity", "a binary search", "democracy", "climate change",
            "a linked list", "compound interest", "encryption", "evolution",
            "the stock market", "a compiler", "electricity", "the water cycle", "DNA", "a database index",
            "object-oriented programming", "the greenhouse effect", "supply and demand", "a neural network",
            "version control", "the speed of light", "a volcano", "an earthquake", "the moon's phases",
            "tides", "a rainbow", "magnetism", "friction", "sound waves", "the human heart", "digestion",
            "sleep", "memory in the brain", "a solar panel", "a wind turbine", "nuclear energy", "a battery",
            "a microwave oven", "an airplane's wings", "a bicycle's gears", "a cloud", "snowflakes",
            "the seasons", "a food chain", "bees and pollination", "coral reefs", "the rainforest",
            "deserts", "a tornado", "a hurricane", "the printing press", "the Roman Empire",
            "the Industrial Revolution", "the Renaissance", "ancient Egypt", "a constitution", "taxes",
            "a budget", "a credit score", "a mortgage", "unemployment", "globalization", "a startup",
            "marketing", "a spreadsheet", "a web browser", "a search engine", "cloud computing",
            "a password manager", "a firewall", "a sorting algorithm", "Big O notation", "a graph in computer science",
            "a queue", "a stack", "a regular expression", "an HTTP request", "JSON", "SQL", "unit testing",
            "a virtual machine", "a GPU", "caching", "multithreading", "garbage collection", "a pointer",
            "an interpreter", "open source software", "blockchain", "artificial intelligence", "a chatbot",
            "a smartphone camera", "GPS", "Wi-Fi", "Bluetooth", "a 3D printer", "a telescope", "a microscope",
            "the periodic table", "an atom", "a chemical reaction", "acids and bases", "osmosis", "a cell",
            "bacteria", "antibiotics", "exercise", "meditation", "nutrition", "habits", "procrastination",
            "teamwork", "leadership", "negotiation", "critical thinking", "public speaking", "a good resume",
            "time management", "music theory", "a symphony orchestra", "impressionist painting",
            "photography", "chess", "the Olympic Games", "soccer", "a marathon", "yoga")
SUBJECTS = ("a dragon who learns to bake bread", "a robot who wants to be a gardener", "a lost kitten in a big city",
            "two friends on a sailing trip", "a wizard who forgot his spells", "a girl who can talk to birds",
            "an astronaut alone on Mars", "a detective solving a mystery at a bakery", "a tree that can walk",
            "a shy ghost in an old library", "a knight afraid of the dark", "a village without music",
            "a fox who opens a bookshop", "a pirate who is afraid of water", "a train that never stops",
            "an old man and his dog", "a painter who loses her colors", "a city under the sea",
            "a snowman who wants to see summer", "a young inventor", "a talking teapot", "a brave mouse",
            "a family of owls", "a haunted bicycle", "a queen who cannot sleep", "a forgotten toy",
            "a festival in the desert", "a musician in the rain", "a bridge between two kingdoms",
            "a cat who becomes mayor", "the last bus of the night", "a garden on a rooftop",
            "a letter that arrives fifty years late", "a turtle racing a rabbit again", "a kite that flies away",
            "a storm at a farm", "a girl who collects stones", "a time traveler at a market",
            "an elephant who paints", "a camping trip in the woods")
ACTIVITIES = ("learning a new language", "staying productive at home", "writing clean code", "sleeping better",
              "saving money", "running a first marathon", "studying for exams", "cooking healthy meals",
              "giving a presentation", "starting a vegetable garden", "learning to play the guitar",
              "making new friends in a new city", "reducing stress", "traveling on a budget", "keeping a journal",
              "learning to program", "preparing for a job interview", "drinking more water",
              "reading more books", "taking better photos", "training a puppy", "working from home",
              "staying safe online", "planning a birthday party", "moving to a new apartment",
              "learning to swim", "writing a novel", "being a good listener", "organizing a closet",
              "hiking in the mountains")
PAIRS = (("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "a bacterium"), ("TCP", "UDP"),
         ("RAM", "storage"), ("a process", "a thread"), ("speed", "velocity"), ("HTML", "CSS"),
         ("a stack", "a queue"), ("mitosis", "meiosis"), ("a lake", "a pond"), ("a crocodile", "an alligator"),
         ("a frog", "a toad"), ("a democracy", "a monarchy"), ("a loan", "a grant"), ("a noun", "a verb"),
         ("Python", "JavaScript"), ("a compiler", "an interpreter"), ("AC", "DC current"), ("a moth", "a butterfly"),
         ("a hurricane", "a typhoon"), ("baking soda", "baking powder"), ("a simile", "a metaphor"),
         ("a CPU", "a GPU"), ("a library", "a framework"), ("mass", "weight"), ("an ocean", "a sea"),
         ("a poem", "a song"), ("stocks", "bonds"), ("a fruit", "a vegetable"))
TASKS = ("reverses a string", "checks whether a number is prime", "counts the words in a text",
         "merges two sorted lists", "finds the largest element of a list", "computes the factorial of n",
         "removes duplicates from a list", "checks whether a string is a palindrome",
         "converts Celsius to Fahrenheit", "returns the n-th Fibonacci number", "flattens a nested list",
         "sorts a list of dictionaries by a key", "counts the vowels in a string", "reads a CSV file into a list",
         "computes the average of a list of numbers", "finds the second largest number in a list",
         "checks whether two strings are anagrams", "capitalizes every word of a sentence",
         "returns the common elements of two lists", "converts a number to binary",
         "validates an email address", "computes the greatest common divisor of two numbers",
         "groups words by their first letter", "finds the longest word in a sentence",
         "rotates a list by k positions", "checks whether a year is a leap year", "sums the digits of a number",
         "counts how often each character appears", "transposes a matrix", "generates a random password")
CHAT_TEMPLATES = (
    ("Explain {} in simple terms.", CONCEPTS), ("Write a short paragraph about {}.", CONCEPTS),
    ("What are the main ideas behind {}?", CONCEPTS), ("How does {} work?", CONCEPTS),
    ("Tell me three interesting facts about {}.", CONCEPTS), ("Why is {} important?", CONCEPTS),
    ("Explain {} to a ten-year-old.", CONCEPTS),
    ("Write a short poem about {}.", SUBJECTS), ("Write a short story about {}.", SUBJECTS),
    ("Write the opening of a story about {}.", SUBJECTS),
    ("Give five tips for {}.", ACTIVITIES), ("How do I get started with {}?", ACTIVITIES),
    ("What are common mistakes when {}?", ACTIVITIES), ("Write a short plan for {}.", ACTIVITIES),
    ("Write a Python function that {}.", TASKS), ("Show me how to write a function that {} in Python.", TASKS),
)


def prompts() -> list[str]:
    code = [f"{instruction}\n\n```python\n{source}\n```"
            for source in stdlib_functions(modules=TRAIN_MODULES) for instruction in INSTRUCTIONS]
    chat = [template.format(item) for template, items in CHAT_TEMPLATES for item in items]
    chat += [f"What is the difference between {a} and {b}?" for a, b in PAIRS]
    chat += [f"Compare {a} and {b}." for a, b in PAIRS]
    return code + chat


def write_texts(directory: str) -> None:
    """One ``<module>.py.txt`` per :data:`TEXT_MODULES` in ``directory``."""
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name in TEXT_MODULES:
        (out / f"{name}.py.txt").write_text(inspect.getsource(importlib.import_module(name)))


#: Words of the benchmark's chat prompts (specdec.workloads.CHAT_PROMPTS): a self-instructed
#: prompt that names one is dropped, so the benchmark's prompts stay held out.
HELD_OUT_WORDS = ("refrigerator", "lighthouse", "seagull", "prime number", "attic", "comet", "asteroid",
                  "sea at night", "sky is blue", "sky blue", "baker", "moon", "vaccine", "immune",
                  "mountain village", "operating system", "clock")


def self_instruct(count: int, llm=None, seed: int = 0, batch: int = 256) -> list[str]:
    """``count`` distinct user messages written by the target: its chat template cut where the
    user's turn begins, sampled (temperature 1, top-p 0.95, min-p 0.05) up to the end of the
    turn. Unfinished ones, very short or long ones, repeats (the same first 48 characters) and
    any naming a topic of the benchmark's chat prompts are dropped. ``llm``: a loaded
    :class:`specdec.LLM` (default: the default model)."""
    import specdec

    llm = llm or specdec.LLM()
    marker = "\x00USER\x00"
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    prefix, end = rendered[: rendered.index(marker)], rendered[rendered.index(marker) + len(marker):].split("\n")[0]
    kept: dict[str, str] = {}
    round_ = 0
    while len(kept) < count and round_ < 4 * count // batch + 4:
        params = [specdec.SamplingParams(max_tokens=96, temperature=1.0, top_p=0.95, min_p=0.05,
                                         seed=seed * 1_000_003 + round_ * batch + i, stop=(end,))
                  for i in range(batch)]
        for output in llm.generate([prefix] * batch, params):
            text = output.text.strip()
            key = " ".join(text.lower().split())[:48]
            if (output.finish_reason == "stop" and 16 <= len(text) <= 600 and key not in kept
                    and not any(word in text.lower() for word in HELD_OUT_WORDS)):
                kept[key] = text
        round_ += 1
    return list(kept.values())[:count]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--text-dir":
        write_texts(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--self-instruct":
        for prompt in self_instruct(int(sys.argv[2])):
            sys.stdout.write(json.dumps({"prompt": prompt}) + "\n")
    else:
        for prompt in prompts():
            sys.stdout.write(json.dumps({"prompt": prompt}) + "\n")
