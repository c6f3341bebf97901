"""Training prompts: a builtin offline set, or the user's own file.

The builtin set is generated here from our own templates and word lists
(Apache-2.0, this repository) plus Python standard-library function signatures
and docstrings (PSF licence, read from the running interpreter).  It never reads
a benchmark set, so it is disjoint from HumanEval, MT-Bench, GSM8K, MATH-500 and
AIME by construction; `tests/test_prompts.py` also checks for overlap.
`builtin:N` draws another set from seed N (new numbers, names and pairings; the
fixed families repeat and are skipped by `make-data` as already done).

`edits` (or `edits:N`): what agents ask most, a whole function read back and rewritten
with one small change, on the pure-Python functions of the standard library.
`revisions` (or `revisions:N`): a paragraph of prose handed back with one small change
asked, on the prose of the Python docs and the standard library's module docstrings.
"""

import ast
import importlib
import inspect
import json
import random
import re
import textwrap
from pathlib import Path

BOXED = "Please reason step by step, and put your final answer within \\boxed{}."

NAMES = [
    "Ava",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Goran",
    "Hana",
    "Ivan",
    "Jia",
    "Kofi",
    "Lena",
    "Mateo",
    "Nora",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Uma",
    "Viktor",
    "Wen",
    "Yusuf",
]
ITEMS = [
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "books",
    "cookies",
    "stamps",
    "shells",
    "cards",
    "eggs",
    "bottles",
    "tickets",
    "coins",
    "flowers",
    "candles",
    "buttons",
]
TOPICS = [
    "photosynthesis",
    "the water cycle",
    "how vaccines work",
    "plate tectonics",
    "the French Revolution",
    "inflation",
    "supply and demand",
    "black holes",
    "the immune system",
    "machine learning",
    "the internet",
    "electric cars",
    "climate change",
    "the Roman Empire",
    "DNA replication",
    "compound interest",
    "the stock market",
    "volcanoes",
    "rainbows",
    "how airplanes fly",
    "recycling",
    "the solar system",
    "antibiotics",
    "the printing press",
    "renewable energy",
    "sleep",
    "memory",
    "coffee",
    "bees and pollination",
    "ocean tides",
    "earthquakes",
    "magnets",
    "the moon landing",
    "democracy",
    "the Renaissance",
    "music theory",
    "chess openings",
    "nutrition",
    "exercise",
    "meditation",
    "time zones",
    "GPS",
    "encryption",
    "databases",
    "operating systems",
    "compilers",
    "version control",
    "unit testing",
    "public speaking",
    "budgeting",
    "gardening",
    "composting",
    "bread baking",
    "photography",
    "the history of jazz",
    "the Silk Road",
    "glaciers",
    "deserts",
    "rainforests",
    "coral reefs",
    "bird migration",
]
STYLES = [
    "Explain {t} in simple terms.",
    "What are the main ideas behind {t}?",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t} for a ten-year-old.",
    "What are common misconceptions about {t}?",
    "Summarize the history of {t} in a few sentences.",
    "List the pros and cons of {t}.",
    "How would you teach {t} to a beginner?",
]
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
    "reverses the words in a sentence",
    "counts the vowels in a string",
    "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number",
    "flattens a nested list",
    "removes duplicates from a list while keeping order",
    "merges two sorted lists",
    "computes the factorial of n",
    "finds the largest element of a list",
    "converts Celsius to Fahrenheit",
    "counts word frequencies in a text",
    "checks whether two strings are anagrams",
    "returns the greatest common divisor of two numbers",
    "transposes a matrix given as a list of lists",
    "computes the average of a list of numbers",
    "checks whether a year is a leap year",
    "returns all prime numbers below n",
    "capitalizes the first letter of every word",
    "rotates a list by k positions",
    "finds the second smallest number in a list",
    "sums the digits of an integer",
    "converts a binary string to an integer",
    "groups a list of words by their first letter",
    "returns the longest word in a sentence",
    "implements binary search on a sorted list",
    "checks whether brackets in a string are balanced",
    "chunks a list into pieces of size n",
    "computes the running total of a list",
    "counts the lines in a text file",
    "validates a simple email address",
    "converts a dictionary to a list of key-value tuples sorted by value",
]
STUB_MODULES = [
    "string",
    "textwrap",
    "statistics",
    "bisect",
    "heapq",
    "fnmatch",
    "difflib",
    "calendar",
    "shlex",
    "html",
    "base64",
    "colorsys",
    "random",
    "posixpath",
    "json",
    "re",
    "urllib.parse",
    "copy",
    "glob",
    "shutil",
    "datetime",
    "fractions",
    "ipaddress",
    "csv",
    "uuid",
    "secrets",
    "pprint",
    "graphlib",
    "tokenize",
    "quopri",
    "mimetypes",
    "tempfile",
    "filecmp",
    "platform",
    "dataclasses",
    "inspect",
    "ast",
    "traceback",
    "linecache",
    "getopt",
    "optparse",
    "gettext",
    "email.utils",
    "zipfile",
]
STUB_FRAMES = [
    "Complete the following Python function:\n```python\n{stub}```",
    "Implement this function in Python (do not import {module}), then show one example call.\n```python\n{stub}```",
    "Here is a Python function signature with its docstring. Write the body.\n```python\n{stub}```",
]
STDLIB_MODULES = [
    "string",
    "textwrap",
    "itertools",
    "functools",
    "statistics",
    "math",
    "bisect",
    "heapq",
    "fnmatch",
    "difflib",
    "calendar",
    "shlex",
    "html",
    "base64",
    "colorsys",
    "operator",
    "random",
]


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


def _word_problem(rng: random.Random) -> str:
    """Multi-step arithmetic stories."""
    n1, n2 = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c, d = rng.randint(4, 40), rng.randint(2, 25), rng.randint(2, 12), rng.randint(1, 9)
    pct = rng.choice([10, 20, 25, 30, 40, 50])
    templates = [
        f"{n1} earns ${a} per hour and works {b} hours a week. Rent is ${c * 40} a week and food is ${c * 12}. "
        f"How much does {n1} save in {d + 1} weeks?",
        f"A shop sold {a} {item} on Saturday and twice as many on Sunday, at ${c} each. "
        f"How much money did the shop make over the weekend?",
        f"{n1} is {a} years old. {n2} is {d} years older than twice {n1}'s age. How old will {n2} be in {b} years?",
        f"A farm has {a} chickens and {b} cows. How many legs are there on the farm?",
        f"{n1} ran {b} km on Monday and {pct}% more on Tuesday than on Monday. How far did {n1} run on the two days?",
        f"A recipe uses {d + 1} eggs for every {c} pancakes. How many eggs are needed for {c * b} pancakes?",
        f"{n1} bought {a} notebooks at ${c} each and {b} pens at ${d} each, with {pct}% off the total. "
        f"How much did {n1} pay?",
        f"A tank holds {a * 10} liters. Water flows in at {c + d} liters per minute and leaks out at {d} liters "
        f"per minute. How many minutes does it take to fill the empty tank?",
        f"{n1} has {a} {item}, {n2} has {b} fewer than three times as many. They put them together and give away "
        f"{pct}% of the total. How many {item} are left?",
        f"A class of {a + 10} students went on a trip. Each bus holds {c + 8} students and costs ${b * 10}. "
        f"How much did the buses cost?",
    ]
    return rng.choice(templates) + (" " + BOXED if rng.random() < 0.5 else "")


def _competition(rng: random.Random) -> str:
    """Short contest-style questions."""
    a, b, c = rng.randint(2, 30), rng.randint(2, 12), rng.randint(3, 17)
    n = rng.randint(20, 500)
    templates = [
        f"How many positive divisors does {n} have?",
        f"What is the remainder when {a}^{b} is divided by {c}?",
        f"Compute the sum of the first {a} positive odd integers.",
        f"Find all real x such that x^2 - {a + b}x + {a * b} = 0.",
        f"What is the greatest common divisor of {a * c} and {b * c}?",
        f"How many integers between 1 and {n} are divisible by {b} or {c}?",
        f"If f(x) = {b}x + {a}, what is f(f({c}))?",
        f"Count the seatings of {min(a, 9)} guests on one bench when two particular guests insist on adjacent seats.",
        f"What is the sum of the interior angles of a polygon with {c} sides, in degrees?",
        f"A circle has circumference {2 * a}\\pi. What is its area?",
    ]
    return rng.choice(templates) + " " + BOXED


def _stub_functions():
    """(module name, name, function) of the public functions STUB_MODULES define themselves, in order."""
    for module_name in STUB_MODULES:
        module = importlib.import_module(module_name)
        for name, fn in sorted(vars(module).items()):
            if not name.startswith("_") and inspect.isfunction(fn) and fn.__module__ == module.__name__:
                yield module_name, name, fn


def _code_stubs(rng: random.Random) -> list[str]:
    """Function signatures with their docstrings, to be completed."""
    stubs = []
    for module_name, name, fn in _stub_functions():
        doc = (inspect.getdoc(fn) or "").strip().split("\n\n")[0]
        signature = str(inspect.signature(fn))
        if not 20 <= len(doc) <= 400 or '"""' in doc or "\\" in doc or " at 0x" in signature:
            continue
        stub = f"def {name}{signature}:\n" + textwrap.indent(f'"""{doc}\n"""', "    ") + "\n"
        stubs.append(rng.choice(STUB_FRAMES).format(stub=stub, module=module_name))
    return stubs


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
                tasks.append(
                    f"Write a Python function `{name}` that does this: {sentence}. "
                    "Do not import the {module_name} module.".replace("{module_name}", module_name)
                )
    return tasks


# none of them is a task of the copy-heavy benchmark set (type hints, a rename to `x_value`, typos, JSON)
EDITS = [
    "Give the parameter `{arg}` a more descriptive name",
    "Replace the docstring with a one-line summary",
    "Add a docstring that explains each parameter",
    "Add a comment above each loop saying what it does",
    "Raise a ValueError with a clear message when `{arg}` is None",
    "Add logging of the arguments at debug level (import logging at the top)",
    "Rename the function to `{name}_v2`",
    "Make every string literal use double quotes",
    "Return early instead of nesting the main branch, where it applies",
    "Wrap the body in a try block that re-raises errors with the function's name added",
]
EDIT_FRAMES = [
    "Here is a function from our codebase:\n```python\n{source}```\n{edit}. Answer with the whole new function "
    "in one ```python block and nothing else.",
    "{edit} in this function, and show me the complete updated code.\n```python\n{source}```",
    "I read this file back:\n```python\n{source}```\nPlease rewrite it: {edit}. Keep everything else as it is.",
]


def _edit_sources() -> list[tuple[str, str, list[str]]]:
    """(name, source, parameter names) of the short pure-Python functions of STUB_MODULES (none
    of the copy-heavy benchmark set's modules) that share no 8-word span with a benchmark
    prompt (docstrings list digits as some do)."""
    from .corpus import benchmark_shingles, shingles

    banned, found = benchmark_shingles(), []
    for _, name, fn in _stub_functions():
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError):
            continue
        if 4 <= source.count("\n") <= 40 and len(source) <= 1500 and not shingles(source) & banned:
            found.append((name, source, list(inspect.signature(fn).parameters)))
    return found


def edit_prompts(seed: int = 0) -> list[str]:
    """Each short standard-library function with one small change asked of it (`seed` draws
    the change and the wording)."""
    rng = random.Random(seed)
    prompts = []
    for name, source, args in _edit_sources():
        edit = rng.choice(EDITS).format(arg=rng.choice(args) if args else "x", name=name)
        prompts.append(rng.choice(EDIT_FRAMES).format(source=source, edit=edit))
    rng.shuffle(prompts)
    return prompts


# none of them is an ask of bench/agent_session.py's writing sessions (measured there, never trained on)
REVISIONS = [
    "Make the tone more formal",
    "Make it friendlier for someone new to programming",
    "Shorten the longest sentence",
    "Turn the first sentence into a question",
    "Use the active voice wherever you can",
    "Replace the word '{word}' with a synonym",
    "Add a short example sentence after the first sentence",
    "Fix the punctuation and keep the wording",
    "Start with a sentence that says what the paragraph is about",
    "Remove the last sentence",
]
REVISION_FRAMES = [
    "Here is a paragraph I wrote:\n\n{text}\n\n{ask}. Return the whole paragraph.",
    "{ask} in this text, and give me the full revised version:\n\n{text}",
    "Please edit my draft. {ask}. Keep everything else as it is.\n\n{text}",
]


def _prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of `text` that are plain prose (no code, no markup lines) of 40-120 words,
    each on one line."""
    found = []
    for paragraph in text.split("\n\n"):
        lines = textwrap.dedent(paragraph).strip("\n").split("\n")
        joined = " ".join(line.strip() for line in lines)
        if (
            any(line.startswith(" ") for line in lines)
            or ">>>" in joined
            or "::" in joined
            or not joined[:1].isupper()
            or not joined.endswith(".")
        ):
            continue
        if 40 <= len(joined.split()) <= 120:
            found.append(joined)
    return found


def _revision_texts() -> list[str]:
    """Prose paragraphs of the Python docs' topics and the standard library's module docstrings
    (not of the copy-heavy set's modules) that share no 8-word span with a benchmark prompt, each
    once, in a fixed order."""
    import pydoc_data.topics

    from ..bench.prompt_sets import COPY_MODULES, DOC_MODULES
    from .corpus import benchmark_shingles, shingles, stdlib_files

    texts = [p for topic in pydoc_data.topics.topics.values() for p in _prose_paragraphs(topic)]
    for path in stdlib_files():
        if path.stem in COPY_MODULES + DOC_MODULES:
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        texts += _prose_paragraphs(doc or "")
    banned = benchmark_shingles()
    return [text for text in dict.fromkeys(texts) if not shingles(text) & banned]


def revision_prompts(seed: int = 0) -> list[str]:
    """Each prose paragraph with one small change asked of it (`seed` draws the change and the wording)."""
    rng = random.Random(seed)
    prompts = []
    for text in _revision_texts():
        words = re.findall(r"[a-z]{6,}", text)
        ask = rng.choice(REVISIONS).format(word=rng.choice(words) if words else "which")
        prompts.append(rng.choice(REVISION_FRAMES).format(text=text, ask=ask))
    rng.shuffle(prompts)
    return prompts


def builtin_prompts(seed: int = 0) -> list[str]:
    """A deterministic, shuffled list of several hundred diverse prompts."""
    rng = random.Random(seed)
    prompts = [rng.choice(STYLES).format(t=t) for t in TOPICS for _ in range(2)]
    prompts += [f"Write a Python function that {task}." for task in CODE_TASKS]
    prompts += [f"Write a Python function that {task}, with a docstring and an example." for task in CODE_TASKS]
    prompts += _stdlib_tasks()
    prompts += [_math(rng) for _ in range(260)]
    prompts += [_word_problem(rng) for _ in range(200)]
    prompts += [_competition(rng) for _ in range(100)]
    prompts += _code_stubs(rng)
    for _ in range(140):
        prompts.append(
            rng.choice(WRITING).format(
                n=rng.choice(NAMES), i=rng.choice(ITEMS), t=rng.choice(TOPICS), p=rng.choice(PLACES), d=rng.choice(DAYS)
            )
        )
    prompts = list(dict.fromkeys(prompts))  # drop exact repeats, keep order
    rng.shuffle(prompts)
    return prompts


GENERATED = {"builtin": builtin_prompts, "edits": edit_prompts, "revisions": revision_prompts}


def read_prompts(source: str) -> list[str]:
    """'builtin', 'edits' or 'revisions' (or 'builtin:SEED', ...), a .txt file (one prompt per
    line) or .jsonl ({"prompt": ...} per line)."""
    kind, _, seed = source.partition(":")
    if kind in GENERATED:
        if seed and not seed.isdigit():
            raise ValueError(f"{source!r}: the {kind} seed must be a number, as in {kind}:1")
        return GENERATED[kind](int(seed or 0))
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"no prompts file at {source}; pass a .txt/.jsonl file, 'builtin', 'edits' or 'revisions'"
        )
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        try:
            prompts = [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f'{path}: every line must be a JSON object with a "prompt" field') from None
    else:
        prompts = lines
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
