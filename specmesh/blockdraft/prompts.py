"""The self-distillation prompt set: code, chat, summarisation and reasoning prompts
written for this project, expanded from templates into about two thousand prompts
(the first 316 are the original set; later templates only add prompts, so ids and
earlier shards stay valid).

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


# --- second wave: more topics and forms (appended; ids of the first wave are unchanged)
MORE_CODE_TASKS = [
    "checks whether two strings are anagrams", "returns the second largest number in a list",
    "converts a binary string to an integer", "capitalises the first letter of every word",
    "computes the running total of a list", "finds the most common element of a list",
    "splits a list into chunks of size n", "checks whether a year is a leap year",
    "returns the intersection of two lists", "computes the median of a list of numbers",
    "counts the lines in a text file", "validates that a string looks like an email address",
    "rotates a list by k positions", "returns the prime factors of a number",
    "converts a Roman numeral to an integer", "computes the dot product of two vectors",
    "removes all whitespace from a string", "finds the longest word in a sentence",
    "merges two dictionaries, summing values for shared keys", "implements binary search on a sorted list",
]
MORE_LANGS = ["Python", "JavaScript", "Rust", "Java", "C"]
MORE_CHAT_TOPICS = [
    "drinking more water during the day", "keeping a daily journal", "starting a vegetable garden",
    "managing stress before exams", "cleaning a small apartment quickly", "buying a used bicycle",
    "hosting a dinner for friends", "learning to play the guitar", "giving a short speech at work",
    "reading more books each year", "staying safe while hiking alone", "packing light for a week of travel",
    "taking better notes in meetings", "training a puppy to sit", "fixing a slow laptop",
    "volunteering in the local community", "moving to a new apartment", "writing a cover letter",
    "learning to swim as an adult", "keeping a budget for groceries", "building a morning routine",
    "working in a team with remote colleagues", "choosing a good pair of running shoes",
    "preparing a simple presentation",
]
MORE_CHAT_FORMS = ["Explain to a friend how to get better at {t}.", "List five ideas for {t}, with one sentence each.",
                   "What would you tell a teenager about {t}?", "Write a short checklist for {t}."]
MORE_PLACES = ["a snowy mountain pass", "a fishing village at dawn", "a crowded night market", "an abandoned lighthouse",
               "a small farm in autumn", "a space station orbiting Mars", "a forest cabin", "a university campus"]
MORE_EVENTS = ["the power went out for a whole evening", "a famous musician arrived unannounced",
               "two old friends met again after twenty years", "a child found a strange map in the attic",
               "the first snow of the year fell overnight", "a robot started helping in the kitchen"]
MORE_STORY_FORMS = ["Write a short story set in {p} where {e}.", "Describe {p} on the day {e}.",
                    "Write a diary entry from someone in {p} the day {e}.", "Write a short poem about {p} where {e}."]
CONCEPTS = [
    "photosynthesis", "how a rainbow forms", "why the sky is blue", "what a database index is",
    "how vaccines work", "the water cycle", "what inflation means", "how a bicycle stays upright",
    "what machine learning is", "how the internet sends data", "why we have seasons", "what a recursive function is",
    "how bees make honey", "what compound interest is", "how a refrigerator keeps food cold", "what DNA does",
    "how an airplane wing creates lift", "what a hash table is", "why leaves change colour in autumn",
    "how a battery stores energy",
]
CONCEPT_FORMS = ["Explain {c} in simple terms.", "Explain {c} to a ten-year-old.", "Give a short summary of {c}.",
                 "What is the most important thing to know about {c}?"]
EMAIL_TASKS = ["asking a colleague to review a document by Friday", "thanking a neighbour for watering the plants",
               "apologising for missing a meeting", "inviting the team to a lunch on Thursday",
               "asking a landlord to fix a leaking tap", "telling a customer their order is delayed",
               "requesting a day off next week", "welcoming a new member to the book club"]


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


def build_prompts(n_random: int = 160, seed: int = 1234, second_wave: bool = True) -> list[dict]:
    """[{'id', 'kind', 'prompt'}], deterministic: 316 first-wave entries, then (with
    ``second_wave``) about 1,700 more from the larger template set."""
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
    if second_wave:
        out += _second_wave(seed)
    return out


def _second_wave(seed: int) -> list[dict]:
    out: list[dict] = []
    for i, task in enumerate(CODE_TASKS + MORE_CODE_TASKS):
        for j, lang in enumerate(MORE_LANGS):
            out.append({"id": f"code2-{i}-{j}", "kind": "code", "prompt": f"Write a {lang} function that {task}."})
    for i, snip in enumerate(SNIPPETS):
        for j, edit in enumerate(["Find a bug or weakness in this code and show a fixed version",
                                  "Write two unit tests for this code", "Rewrite this code in JavaScript"]):
            out.append({"id": f"edit2-{i}-{j}", "kind": "code", "prompt": f"{edit}:\n\n{snip}"})
    topics = CHAT_TOPICS + MORE_CHAT_TOPICS
    for i, t in enumerate(topics):
        for j, form in enumerate(CHAT_FORMS + MORE_CHAT_FORMS):
            if i < len(CHAT_TOPICS) and j < len(CHAT_FORMS):
                continue  # first wave
            out.append({"id": f"chat2-{i}-{j}", "kind": "chat", "prompt": form.format(t=t)})
    places, events = PLACES + MORE_PLACES, EVENTS + MORE_EVENTS
    for i, pl in enumerate(places):
        for j, e in enumerate(events):
            for k, form in enumerate(MORE_STORY_FORMS):
                if (k + i + j) % 2:  # half of the grid, alternating forms
                    continue
                out.append({"id": f"story2-{i}-{j}-{k}", "kind": "chat", "prompt": form.format(p=pl, e=e)})
    for i, c in enumerate(CONCEPTS):
        for j, form in enumerate(CONCEPT_FORMS):
            out.append({"id": f"explain-{i}-{j}", "kind": "chat", "prompt": form.format(c=c)})
    for i, task in enumerate(EMAIL_TASKS):
        for j, tone in enumerate(["short", "polite", "friendly"]):
            out.append({"id": f"email-{i}-{j}", "kind": "chat", "prompt": f"Write a {tone} email {task}."})
    rng = random.Random(seed + 1)
    for i in range(400):
        if i % 2 == 0:
            out.append({"id": f"sum2-{i}", "kind": "summarise",
                        "prompt": "Summarise this passage in two sentences, quoting one phrase:\n\n" + _passage(rng)})
        else:
            out.append({"id": f"reason2-{i}", "kind": "reasoning", "prompt": _reasoning(rng)})
    return out


def split(prompt_id: str, heldout_fraction: float = 0.1) -> str:
    h = int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_fraction else "train"
