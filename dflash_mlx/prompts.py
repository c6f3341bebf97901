"""Training prompts: a builtin offline set, or the user's own file.

The builtin set is generated here from our own templates and word lists
(Apache-2.0, this repository) plus the first sentence of Python standard-library
docstrings (PSF licence, read from the running interpreter).  It never reads a
benchmark set, so it is disjoint from HumanEval, MT-Bench, GSM8K, MATH-500 and
AIME by construction; `bench/` also checks for overlap.
"""

import inspect
import json
import random
from pathlib import Path

BOXED = "Please reason step by step, and put your final answer within \\boxed{}."

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Viktor", "Wen", "Yusuf"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "eggs",
         "bottles", "tickets", "coins", "flowers", "candles", "buttons"]
TOPICS = [
    "photosynthesis", "the water cycle", "how vaccines work", "plate tectonics", "the French Revolution",
    "inflation", "supply and demand", "black holes", "the immune system", "machine learning",
    "the internet", "electric cars", "climate change", "the Roman Empire", "DNA replication",
    "compound interest", "the stock market", "volcanoes", "rainbows", "how airplanes fly",
    "recycling", "the solar system", "antibiotics", "the printing press", "renewable energy",
    "sleep", "memory", "coffee", "bees and pollination", "ocean tides", "earthquakes", "magnets",
    "the moon landing", "democracy", "the Renaissance", "music theory", "chess openings",
    "nutrition", "exercise", "meditation", "time zones", "GPS", "encryption", "databases",
    "operating systems", "compilers", "version control", "unit testing", "public speaking",
    "budgeting", "gardening", "composting", "bread baking", "photography", "the history of jazz",
    "the Silk Road", "glaciers", "deserts", "rainforests", "coral reefs", "bird migration",
]
STYLES = ["Explain {t} in simple terms.", "What are the main ideas behind {t}?",
          "Give me three interesting facts about {t}.", "Write a short paragraph about {t} for a ten-year-old.",
          "What are common misconceptions about {t}?", "Summarize the history of {t} in a few sentences.",
          "List the pros and cons of {t}.", "How would you teach {t} to a beginner?"]
WRITING = [
    "Write a short email to {n} asking to move our meeting to {d}.",
    "Write a polite note to {n} thanking them for the {i}.",
    "Write a four-line poem about {t}.",
    "Write a short story about {n} who finds a box of {i}.",
    "Give me a packing list for a weekend trip to the {p}.",
    "Suggest five names for a small shop that sells {i}.",
    "Write a tweet announcing a workshop on {t}.",
    "Draft a to-do list for planning a birthday party for {n}.",
    "Describe a calm morning at the {p} in a few sentences.",
    "Write a product description for handmade {i}.",
]
PLACES = ["beach", "mountains", "city", "countryside", "lake", "forest", "desert", "island"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "next week"]
CODE_TASKS = [
    "reverses the words in a sentence", "counts the vowels in a string", "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number", "flattens a nested list", "removes duplicates from a list while keeping order",
    "merges two sorted lists", "computes the factorial of n", "finds the largest element of a list",
    "converts Celsius to Fahrenheit", "counts word frequencies in a text", "checks whether two strings are anagrams",
    "returns the greatest common divisor of two numbers", "transposes a matrix given as a list of lists",
    "computes the average of a list of numbers", "checks whether a year is a leap year",
    "returns all prime numbers below n", "capitalizes the first letter of every word", "rotates a list by k positions",
    "finds the second smallest number in a list", "sums the digits of an integer", "converts a binary string to an integer",
    "groups a list of words by their first letter", "returns the longest word in a sentence",
    "implements binary search on a sorted list", "checks whether brackets in a string are balanced",
    "chunks a list into pieces of size n", "computes the running total of a list", "counts the lines in a text file",
    "validates a simple email address", "converts a dictionary to a list of key-value tuples sorted by value",
]
STDLIB_MODULES = ["string", "textwrap", "itertools", "functools", "statistics", "math", "bisect", "heapq",
                  "fnmatch", "difflib", "calendar", "shlex", "html", "base64", "colorsys", "operator", "random"]


def _math(rng: random.Random) -> str:
    n1, n2 = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 9)
    templates = [
        f"{n1} has {a} {item}. {n2} gives {n1} {b} more, then {n1} shares them equally among {c} friends. "
        f"How many {item} does each friend get, and how many are left over?",
        f"A box holds {c} {item}. {n1} fills {a} boxes and {n2} fills {b} boxes. How many {item} do they have together?",
        f"{n1} buys {a} {item} at ${c} each and pays with a ${(a * c // 50 + 1) * 50} bill. How much change does {n1} get?",
        f"What is {a * c} divided by {c}, plus {b} times {c}?",
        f"A train travels {a * 10} km in {c} hours. At the same speed, how far does it go in {c + b % 5 + 1} hours?",
        f"{n1} reads {b} pages a day. How many days does {n1} need to finish a {a * 10}-page book?",
        f"The sum of two numbers is {a + b} and their difference is {abs(a - b)}. What are the numbers?",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"What is {a}% of {b * 20}?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    ]
    question = rng.choice(templates)
    return question + (" " + BOXED if rng.random() < 0.6 else "")


def _stdlib_tasks() -> list[str]:
    tasks = []
    for module_name in STDLIB_MODULES:
        module = __import__(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
                continue
            doc = (inspect.getdoc(obj) or "").strip().split("\n\n")[0].replace("\n", " ")
            sentence = doc.split(". ")[0].rstrip(".")
            if 20 <= len(sentence) <= 160 and "(" not in sentence[:1]:
                tasks.append(f"Write a Python function `{name}` that does this: {sentence}. "
                             "Do not import the {module_name} module.".replace("{module_name}", module_name))
    return tasks


def builtin_prompts(seed: int = 0) -> list[str]:
    """A deterministic, shuffled list of several hundred diverse prompts."""
    rng = random.Random(seed)
    prompts = [rng.choice(STYLES).format(t=t) for t in TOPICS for _ in range(2)]
    prompts += [f"Write a Python function that {task}." for task in CODE_TASKS]
    prompts += [f"Write a Python function that {task}, with a docstring and an example." for task in CODE_TASKS]
    prompts += _stdlib_tasks()
    prompts += [_math(rng) for _ in range(260)]
    for _ in range(140):
        prompts.append(rng.choice(WRITING).format(n=rng.choice(NAMES), i=rng.choice(ITEMS), t=rng.choice(TOPICS),
                                                  p=rng.choice(PLACES), d=rng.choice(DAYS)))
    prompts = list(dict.fromkeys(prompts))  # drop exact repeats, keep order
    rng.shuffle(prompts)
    return prompts


def read_prompts(source: str) -> list[str]:
    """'builtin', a .txt file (one prompt per line) or .jsonl ({"prompt": ...} per line)."""
    if source == "builtin":
        return builtin_prompts()
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"no prompts file at {source}; pass a .txt/.jsonl file or 'builtin'")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        try:
            prompts = [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}: every line must be a JSON object with a \"prompt\" field") from None
    else:
        prompts = lines
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
