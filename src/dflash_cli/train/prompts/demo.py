"""The `demo` training prompt set: math word problems, code tasks and open chat requests from templates.

The demo drafter was first trained on `demo:8000` (its README.md has each round's recipe). Variety matters
more than steps when distilling a drafter (the drafter learns the target's phrasing, and one template seen
many times teaches little), so every template mixes in random names, objects, numbers, languages and topics.
Prompts are drawn 45% math, 30% code, 25% chat, but repeats are skipped and the code and chat templates have
fewer distinct fillings than the math ones, so the set leans further to math as it grows: 60/25/15% at 6000
prompts, 63/24/13% at 8000, 78/15/7% at 30000. (Changing the templates changes `demo:N`, and with it the
recipe of the shipped drafter.) `mix` (mix.py) reuses the math generator and some of the word lists here.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from dflash_cli.train.prompts.draw import NAMES

ITEMS = ["apples", "oranges", "stickers", "marbles", "books", "pencils", "cookies", "cupcakes", "toy cars",
         "seashells", "stamps", "balloons", "candles", "eggs", "flowers", "postcards", "buttons", "crayons",
         "bottles of water", "tickets", "comic books", "plants", "bracelets", "puzzles", "socks", "muffins"]
PLACES = ["bakery", "library", "farm", "toy shop", "school", "bookstore", "garden center", "cafe", "zoo",
          "museum", "market", "gym", "cinema", "pet shop", "post office", "hardware store"]
CONTAINERS = ["boxes", "bags", "baskets", "crates", "jars", "packs", "trays", "shelves"]
UNITS_SPEED = [("kilometers", "hour"), ("miles", "hour"), ("meters", "second"), ("meters", "minute")]
ASKS = ["Solve it step by step.", "Show your work.", "Explain your reasoning.", "Show each step.",
        "Work it out step by step.", "Explain how you got the answer.", "Give the answer with a short explanation.",
        "Think step by step.", "Show the calculation.", ""]


def math_problem(r: random.Random) -> str:
    n1, n2 = r.sample(NAMES, 2)
    item, item2 = r.sample(ITEMS, 2)
    place = r.choice(PLACES)
    box = r.choice(CONTAINERS)
    a, b, c = r.randint(3, 60), r.randint(2, 40), r.randint(2, 12)
    price, price2 = r.choice([0.5, 0.75, 1.25, 1.5, 2, 2.5, 3, 4, 4.5, 5, 6, 8, 12, 15]), r.randint(2, 30)
    pct = r.choice([10, 15, 20, 25, 30, 40, 50, 60, 75])
    speed, unit = r.randint(3, 120), r.choice(UNITS_SPEED)
    hours = r.choice([1.5, 2, 2.5, 3, 4, 5, 0.5, 6])
    w, h = r.randint(3, 30), r.randint(2, 25)
    food = r.choice(["cookies", "muffins", "pancakes", "rolls", "pies", "waffles"])
    problems: list[Callable[[], str]] = [
        lambda: f"{n1} has {a} {item}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. "
                f"How many {item} does {n1} have now?",
        lambda: f"{n1} buys {c} {item} at ${price} each and {b % 9 + 1} {item2} at ${price2} each. "
                f"How much does {n1} spend in total?",
        lambda: f"A {place} has {c} {box} with {a} {item} in each. How many {item} are there altogether?",
        lambda: f"{n1} shares {a * c} {item} equally among {c} friends. How many {item} does each friend get?",
        lambda: f"A jacket at the {place} costs ${price2 * 4}. It is on sale for {pct}% off. What is the sale price?",
        lambda: f"{n1} has {c} times as many {item} as {n2}. Together they have {b * (c + 1)} {item}. "
                f"How many does each of them have?",
        lambda: f"A car travels at {speed} {unit[0]} per {unit[1]} for {hours} {unit[1]}s. How far does it go?",
        lambda: f"A rectangle is {w} cm long and {h} cm wide. What are its perimeter and its area?",
        lambda: f"{n1} is {c} years older than {n2}. In {b % 10 + 2} years the sum of their ages will be "
                f"{2 * a + c + 2 * (b % 10 + 2)}. How old are they now?",
        lambda: f"The {place} sold {a} {item} on Monday, {b} on Tuesday and twice as many on Wednesday as on "
                f"Tuesday. How many did it sell over the three days?",
        lambda: f"{n1} reads {c + 5} pages a day. The book has {(c + 5) * b} pages. How many days will it take "
                f"to finish the book?",
        lambda: f"There are {a + b} students in a class and {pct}% of them walk to school. "
                f"How many students walk to school?",
        lambda: f"Solve for x: {c}x + {a} = {c * b + a}.",
        lambda: f"Solve for x: {c}x - {b} = {a}x + {c * a}." if c != a else f"Solve for x: {a}x = {a * b}.",
        lambda: f"What is {pct}% of {a * 10}?",
        lambda: f"What is the average of {a}, {b}, {c} and {a + b}?",
        lambda: f"A recipe needs {c} cups of flour for {b} {food}. How much flour is needed for {b * 3} {food}?",
        lambda: f"{n1} saves ${c} every week. How many weeks will it take to save ${c * a} for a bike?",
        lambda: f"A tank holds {a * 10} liters of water and is {pct}% full. How many liters are needed to fill it?",
        lambda: f"A train leaves at {r.randint(1, 11)}:{r.choice(['00', '15', '30', '45'])} a.m. and the trip "
                f"takes {c} hours and {b} minutes. When does it arrive?",
        lambda: f"What is {a} times {b}, minus {c}?",
        lambda: f"What is the least common multiple of {c} and {b}?",
        lambda: f"What is the greatest common divisor of {a * c} and {b * c}?",
        lambda: f"A square garden has a side of {w} meters. How many meters of fence go around it, and what is "
                f"its area?",
        lambda: f"{n1} had ${a * 5}. {n1} spent a quarter of it on {item} and ${c} on {item2}. "
                f"How much money is left?",
        lambda: f"If {c} workers build a wall in {b} days, how long would {c * 2} workers take at the same rate?",
        lambda: f"A bag has {a} red, {b} blue and {c} green {item}. What is the probability of picking a blue one?",
        lambda: f"Convert {a * 100} centimeters to meters, and {b} kilograms to grams.",
        lambda: f"What is {a}/{c} as a decimal, rounded to two places?",
        lambda: f"A phone plan costs ${price2} a month plus ${price} per gigabyte. {n1} used {c} gigabytes. "
                f"What is the bill?",
        lambda: f"The {place} opens at {r.randint(6, 10)} a.m. and closes at {r.randint(4, 9)} p.m. "
                f"How many hours is it open in a week if it opens every day?",
        lambda: f"A triangle has angles of {a + 20} and {b + 30} degrees. What is the third angle?",
    ]
    ask = r.choice(ASKS)
    return (r.choice(problems)() + (" " + ask if ask else "")).strip()


LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Bash",
         "SQL", "Ruby", "C#", "Kotlin"]
FUNCS = ["reverses a string", "checks whether a number is prime", "returns the factorial of n",
         "finds the largest number in a list", "counts the vowels in a string", "sums the digits of an integer",
         "removes duplicates from a list", "merges two sorted lists", "checks whether two words are anagrams",
         "returns the n-th Fibonacci number", "converts Celsius to Fahrenheit", "flattens a nested list",
         "finds the second largest value in a list", "counts the words in a sentence",
         "checks whether a year is a leap year", "returns the median of a list of numbers",
         "capitalizes the first letter of every word", "finds the most frequent element in a list",
         "computes the greatest common divisor of two numbers", "checks whether a string has balanced brackets",
         "converts a decimal number to binary", "returns all even numbers from a list",
         "splits a list into chunks of size k", "rotates a list by k positions", "computes a running average",
         "validates an email address with a simple rule", "finds the index of a value with binary search",
         "sorts a list of tuples by their second element", "returns the intersection of two lists",
         "reads a text file and counts its lines", "generates a random password of a given length",
         "transposes a matrix", "computes the power set of a small list", "checks whether a list is sorted",
         "implements bubble sort", "implements a stack with push and pop", "returns the longest word in a sentence",
         "counts how often each character appears in a string", "computes compound interest",
         "converts a list of pairs into a dictionary"]
CONCEPTS = ["recursion", "a hash map", "a linked list", "big-O notation", "a closure", "a race condition",
            "a REST API", "garbage collection", "a binary search tree", "dynamic programming", "a deadlock",
            "an interface", "inheritance", "immutability", "a generator", "unit testing", "a database index",
            "version control with git", "a pointer", "exceptions", "async and await", "a queue", "caching",
            "type hints", "a virtual environment", "regular expressions", "memoization", "a lambda function"]


def _code(r: random.Random) -> str:
    lang, lang2, func = r.choice(LANGS), r.choice(LANGS), r.choice(FUNCS)
    concept = r.choice(CONCEPTS)
    forms = [
        lambda: f"Write a {lang} function that {func}.",
        lambda: f"Write a {lang} function that {func}. Add a short docstring or comment.",
        lambda: f"Write a {lang} function that {func}, and show an example call.",
        lambda: f"How do I write a function in {lang} that {func}?",
        lambda: f"Explain {concept} in {lang} with a short example.",
        lambda: f"What is {concept}? Explain it to a beginner programmer.",
        lambda: f"Write a simple unit test for a function that {func}.",
        lambda: f"Translate this idea into {lang2} code: a function that {func}.",
        lambda: f"What are common mistakes when writing a function that {func}?",
        lambda: f"Compare how {lang} and {lang2} handle {concept}.",
        lambda: f"Write a {lang} program that asks the user for a number and prints whether it is even or odd.",
        lambda: f"Explain what this {lang} code should do: a loop that {func}.",
    ]
    return r.choice(forms)()


TOPICS = ["photosynthesis", "volcanoes", "the water cycle", "black holes", "the Roman Empire", "electricity",
          "rainbows", "the human heart", "earthquakes", "the Moon", "bees", "the internet", "climate change",
          "democracy", "the printing press", "dinosaurs", "magnets", "gravity", "the immune system", "tides",
          "sleep", "coral reefs", "the stock market", "recycling", "solar panels", "the pyramids of Egypt",
          "vitamins", "thunderstorms", "the French Revolution", "DNA", "airplanes", "penguins", "friction",
          "the seasons", "inflation", "rain forests", "the Silk Road", "glaciers", "batteries", "music",
          "chess", "coffee", "bridges", "the ocean", "clouds", "honey", "maps", "money", "trees", "robots",
          "the solar system", "plastic", "wind turbines", "language learning", "the Olympic Games", "sound"]
AUDIENCES = ["a ten-year-old", "a beginner", "a high school student", "someone who has never heard of it",
             "a busy adult", "a curious child"]
ADVICE = ["sleep better", "start running", "learn a new language", "save money", "stay focused while studying",
          "cook a healthy dinner quickly", "make new friends in a new city", "keep a plant alive",
          "prepare for a job interview", "write a good essay", "speak in public", "organize a small party",
          "stop procrastinating", "take better notes", "travel on a budget", "start a small garden",
          "read more books", "manage stress before exams", "learn to draw", "keep a tidy desk"]
STYLES = ["a haiku", "a short poem", "a limerick", "a two-sentence story", "a short story opening",
          "a short diary entry", "a friendly letter", "a product description", "a short speech"]


def _chat(r: random.Random) -> str:
    topic, topic2 = r.sample(TOPICS, 2)
    forms = [
        lambda: f"Explain {topic} to {r.choice(AUDIENCES)}.",
        lambda: f"What is {topic}?",
        lambda: f"Give me three interesting facts about {topic}.",
        lambda: f"Why is {topic} important?",
        lambda: f"How does {topic} work? Keep it short.",
        lambda: f"Write {r.choice(STYLES)} about {topic}.",
        lambda: f"What is the difference between {topic} and {topic2}?",
        lambda: f"How can I {r.choice(ADVICE)}?",
        lambda: f"Give me five tips to {r.choice(ADVICE)}.",
        lambda: f"I want to {r.choice(ADVICE)}. Where should I start?",
        lambda: f"Summarize what people should know about {topic} in a few sentences.",
        lambda: f"Write a short dialogue between two friends talking about {topic}.",
        lambda: f"What questions could a teacher ask students about {topic}?",
        lambda: f"Describe {topic} in one paragraph.",
        lambda: f"Tell me a fun story that teaches something about {topic}.",
    ]
    return r.choice(forms)()


def demo_prompts_with_categories(n: int = 6000, seed: int = 0) -> list[tuple[str, str]]:
    """(category, prompt) pairs behind `demo_prompts`."""
    # Not `draw_distinct` (draw.py), on purpose: `demo` predates it, draws 45/30/25% and, on a repeat, draws
    # the category again too, so its mix leans to math as n grows. Drawing it with `draw_distinct` would change
    # `demo:N`, and with it the recipe of the shipped drafter.
    r = random.Random(seed)
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    while len(out) < n:
        x = r.random()
        cat, p = ("math", math_problem(r)) if x < 0.45 else ("code", _code(r)) if x < 0.75 else ("chat", _chat(r))
        if p not in seen:
            seen.add(p)
            out.append((cat, p))
    return out


def demo_prompts(n: int = 6000, seed: int = 0) -> list[str]:
    """`n` distinct prompts in a fixed order for a seed; `demo_prompts(m)` is a prefix of `demo_prompts(n)`
    for m < n. The mix leans to math as n grows (module docstring)."""
    return [p for _, p in demo_prompts_with_categories(n, seed)]
