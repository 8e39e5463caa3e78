"""The self-distillation prompt set: code, chat, summarisation and reasoning prompts
written for this project, expanded from templates into a few hundred prompts.

Each prompt has a stable id; ``split(id)`` puts about 10% of them in a held-out
set by a hash of the id, so training never sees held-out prompts. Deterministic:
the same list every time. Knows nothing about models or tokenizers.
"""

from __future__ import annotations

import hashlib
import random

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "merges two sorted lists",
    "counts the vowels in a sentence", "returns the n-th Fibonacci number", "flattens a nested list",
    "removes duplicates from a list while keeping order", "computes the factorial of n",
    "finds the largest element in a list", "converts Celsius to Fahrenheit", "checks if a word is a palindrome",
    "sums the digits of an integer", "groups words by their first letter", "computes the mean of a list",
    "returns the words of a sentence sorted by length", "parses a date string like 2024-03-01",
    "reads a CSV line into a list of fields", "counts how often each word appears in a text",
    "computes the greatest common divisor of two numbers", "transposes a matrix given as a list of lists",
]
LANGS = ["Python", "JavaScript", "Python", "Go", "Python"]
SNIPPETS = [
    "def area(r):\n    return 3.14159 * r * r\n",
    "def total(xs):\n    t = 0\n    for x in xs:\n        t += x\n    return t\n",
    "def first_even(xs):\n    for x in xs:\n        if x % 2 == 0:\n            return x\n    return None\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n\n"
    "    def pop(self):\n        return self.items.pop()\n",
    "def greet(name):\n    print('Hello, ' + name)\n",
    "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n",
]
CODE_EDITS = ["Add type hints to this function and return the full code", "Rename the variables to clearer names and "
              "return the full code", "Add a docstring and return the complete code",
              "Explain what this code does"]
CHAT_TOPICS = [
    "staying focused while working from home", "learning to cook simple meals", "starting to run in the morning",
    "keeping houseplants alive", "planning a weekend trip on a budget", "preparing for a job interview",
    "learning a new language", "sleeping better", "saving money each month", "writing a clear email",
    "making friends in a new city", "getting started with photography", "organising a small library at home",
    "reducing screen time", "choosing a first programming language", "teaching a child to ride a bike",
]
CHAT_FORMS = ["Give me three tips for {t}.", "What are common mistakes when {t}?", "How should a beginner approach {t}?",
              "Write a short friendly paragraph about {t}."]
PLACES = ["a small harbour town", "a mountain village", "a busy train station", "an old library", "a desert oasis",
          "a river market", "a quiet island", "a city rooftop garden"]
EVENTS = ["a storm closed the roads for two days", "a new bakery opened on the main street",
          "the local school won a science prize", "a festival brought thousands of visitors",
          "the old bridge was repaired after years of delay", "a lost dog found its way home across the hills"]
STORY_FORMS = ["Write a short story set in {p} where {e}.", "Describe {p} on the day {e}."]
PEOPLE = ["Mia", "Tom", "Ana", "Raj", "Lena", "Omar", "Kim", "Paul"]
ITEMS = ["apples", "books", "pencils", "marbles", "stickers", "coins"]


def _passage(rng: random.Random) -> str:
    p, e, e2 = rng.choice(PLACES), rng.choice(EVENTS), rng.choice(EVENTS)
    return (f"In {p}, people still talk about the week when {e}. Some said it changed nothing; others insisted "
            f"that \"nothing was quite the same afterwards\". A few months later {e2}, and the town council "
            f"decided to write both stories down so that \"the next generation would remember them\".")


def _reasoning(rng: random.Random) -> str:
    a, b = rng.sample(PEOPLE, 2)
    it = rng.choice(ITEMS)
    x, y, z = rng.randint(3, 30), rng.randint(2, 15), rng.randint(1, 9)
    form = rng.randrange(3)
    if form == 0:
        q = f"{a} has {x} {it}. {b} gives {a} {y} more, then {a} gives away {z}. How many {it} does {a} have?"
    elif form == 1:
        q = f"A box holds {y} {it}. {a} fills {z} boxes and has {x} {it} left over. How many {it} are there in total?"
    else:
        q = f"{a} reads {y} pages a day. The book has {x * 10} pages. How many days does {a} need to finish it?"
    return "Think step by step, then give the final answer. " + q


def build_prompts(n_random: int = 160, seed: int = 1234) -> list[dict]:
    """[{'id', 'kind', 'prompt'}], deterministic, a few hundred entries."""
    out: list[dict] = []
    for i, task in enumerate(CODE_TASKS):
        out.append({"id": f"code-{i}", "kind": "code", "prompt": f"Write a {LANGS[i % len(LANGS)]} function that {task}."})
    for i, snip in enumerate(SNIPPETS):
        for j, edit in enumerate(CODE_EDITS):
            out.append({"id": f"edit-{i}-{j}", "kind": "code", "prompt": f"{edit}:\n\n{snip}"})
    for i, t in enumerate(CHAT_TOPICS):
        for j, form in enumerate(CHAT_FORMS):
            out.append({"id": f"chat-{i}-{j}", "kind": "chat", "prompt": form.format(t=t)})
    for i, p in enumerate(PLACES):
        for j, e in enumerate(EVENTS):
            form = STORY_FORMS[(i + j) % len(STORY_FORMS)]
            out.append({"id": f"story-{i}-{j}", "kind": "chat", "prompt": form.format(p=p, e=e)})
    rng = random.Random(seed)
    for i in range(n_random):
        if i % 2 == 0:
            out.append({"id": f"sum-{i}", "kind": "summarise",
                        "prompt": "Summarise this passage in two sentences, quoting one phrase:\n\n" + _passage(rng)})
        else:
            out.append({"id": f"reason-{i}", "kind": "reasoning", "prompt": _reasoning(rng)})
    return out


def split(prompt_id: str, heldout_fraction: float = 0.1) -> str:
    h = int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_fraction else "train"
