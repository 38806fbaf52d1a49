"""The `mix` training prompt set: a stable 40/30/30% mix of math, code and chat, from wider templates than `demo`.

`mix:12000` (default 12000) keeps a stable mix at every size: each prompt's category is drawn first (40% math,
30% code, 30% chat) and that category's generator is then drawn from until it gives a new prompt. Math reuses the
`demo` math forms plus 27 more (fractions, unit rates, sequences, algebra, multi-step problems): 59 forms. Code
has 30 forms (functions in 22 languages, debugging, refactoring, small classes, shell one-liners, SQL over 10
named tables, regexes, data structures, complexity and "what does this do" on 15 generated snippets, idioms,
tests); chat has 30 (how-to, comparisons, pros and cons, emails and messages to 16 recipients, recipes, travel,
explanations of 96 topics, rewriting, summarising and continuing a sentence, definitions, synonyms,
brainstorming, review sentiment, translations). Measured math/code/chat: 39.1/30.5/30.4% at 3000,
39.9/30.3/29.8% at 12000, 39.5/30.4/30.1% at 30000, all distinct; at 30000 the code prompts start with 118
distinct first-three-word openings and the chat prompts with 257. `demo` (demo.py) and its templates are left
as they are: this set takes its math generator and some of its word lists.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from dflash_cli.train.prompts.demo import (
    ADVICE,
    ASKS,
    AUDIENCES,
    CONCEPTS,
    FUNCS,
    ITEMS,
    PLACES,
    STYLES,
    TOPICS,
    math_problem,
)
from dflash_cli.train.prompts.draw import NAMES, draw_distinct

FRACTIONS = [(1, 2), (1, 3), (2, 3), (1, 4), (3, 4), (1, 5), (2, 5), (3, 5), (1, 6), (5, 6), (1, 8), (3, 8)]
JOBS = ["paints", "types", "knits", "plants", "packs", "bakes", "washes", "prints", "sorts", "folds"]


def _math_more(r: random.Random) -> str:
    """Extra math forms used only by `mix`: multi-step word problems, fractions, unit rates, algebra, sequences."""
    n1, n2 = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    place = r.choice(PLACES)
    a, b, c = r.randint(3, 60), r.randint(2, 40), r.randint(2, 12)
    (p, q), (s, t) = r.sample(FRACTIONS, 2)
    d = r.randint(2, 9)
    job = r.choice(JOBS)
    problems: list[Callable[[], str]] = [
        lambda: f"What is {p}/{q} + {s}/{t}? Give the answer as a fraction in lowest terms.",
        lambda: f"What is {p}/{q} of {a * q}?",
        lambda: f"Which is larger, {p}/{q} or {s}/{t}? Explain why.",
        lambda: f"What is {p}/{q} times {s}/{t}?",
        lambda: f"{n1} ate {p}/{q} of a pizza and {n2} ate {s}/{t} of another pizza of the same size. "
                f"Who ate more, and by how much?",
        lambda: f"{c} {item} cost ${c * d}. How much do {c + b} {item} cost?",
        lambda: f"{n1} {job} {a} {item} in {c} hours. How many per hour is that, to one decimal place?",
        lambda: f"Store A sells {c} {item} for ${c * d + 1} and store B sells {c + 2} for ${(c + 2) * d}. "
                f"Which is the better deal per item?",
        lambda: f"What is the next number in the sequence {a}, {a + c}, {a + 2 * c}, {a + 3 * c}, ...?",
        lambda: f"What is the next number in the sequence {d}, {d * 2}, {d * 4}, {d * 8}, ...?",
        lambda: f"What is the {b}th term of the sequence that starts at {a} and goes up by {c} each time?",
        lambda: f"What is the sum of the whole numbers from 1 to {a + b}?",
        lambda: f"Solve for x: x/{c} + {b} = {a + b}.",
        lambda: f"Solve for x: {d}(x + {c}) = {d * (a + c)}.",
        lambda: f"Solve the system: x + y = {a + b} and x - y = {a - b}.",
        lambda: f"Simplify: {c}x + {b} - {d}x + {a}.",
        lambda: f"{n1} had {a + b + c} {item}. {n1} gave {a} to {n2}, bought {b * 2} more at the {place} and then "
                f"split the rest equally into {d} bags. How many {item} went in each bag, and how many were left over?",
        lambda: f"A {place} sells {item} for ${d} each. On Monday it sold {a}, on Tuesday {b} fewer than on "
                f"Monday, and on Wednesday double Tuesday. What was the total revenue?",
        lambda: f"{n1} walks {c} km to the {place} at {d} km per hour and takes the bus back in {b} minutes. "
                f"How long is the whole trip in minutes?",
        lambda: f"{n1} earns ${a + 10} an hour and works {c} hours a day, {d % 5 + 2} days a week. "
                f"How much is that in a week, and in four weeks?",
        lambda: f"A shirt costs ${a + 20}. The price rises by {b % 30 + 5}% and then falls by {c + 5}%. "
                f"What is the final price?",
        lambda: f"Round {a * 137 + b}.{c}{d} to the nearest hundred and to the nearest whole number.",
        lambda: f"What is {a}% of {b * 20}, plus {c}% of {d * 50}?",
        lambda: f"The ratio of red to blue {item} in a box is {c}:{d}. There are {c * b} red ones. "
                f"How many blue ones are there?",
        lambda: f"A circle has a radius of {c} cm. What are its circumference and its area? Use 3.14 for pi.",
        lambda: f"What is {a} squared minus {b} squared?",
        lambda: f"What is {b * d} divided by {d}, plus {c} times {a}?",
    ]
    ask = r.choice(ASKS)
    return (r.choice(problems)() + (" " + ask if ask else "")).strip()


MIX_LANGS = ["Python", "Python", "Python", "JavaScript", "JavaScript", "TypeScript", "Java", "C", "C++", "Go",
             "Rust", "Ruby", "C#", "Kotlin", "Swift", "PHP", "Scala", "Lua", "R", "Haskell", "Dart", "Julia"]
MIX_FUNCS = FUNCS + [
    "checks whether a string is a palindrome", "returns the sum of the squares of a list",
    "counts the negative numbers in a list", "finds the smallest number in a list",
    "joins a list of words with commas", "returns the last n items of a list",
    "converts minutes to hours and minutes", "checks whether a number is a perfect square",
    "returns the product of all numbers in a list", "removes all spaces from a string",
    "checks whether all items in a list are unique", "returns the first non-repeating character in a string",
    "counts the uppercase letters in a string", "converts a string to title case",
    "finds the missing number in a list from 1 to n", "swaps the keys and values of a dictionary",
    "groups words by their first letter", "returns the difference between the largest and smallest value",
    "reverses the order of words in a sentence", "checks whether a number is a power of two",
    "returns the number of days between two dates", "truncates a string to a given length with an ellipsis",
    "converts a Roman numeral to an integer", "converts an integer to a Roman numeral",
    "finds all pairs in a list that add up to a target", "computes the dot product of two vectors",
    "counts the lines in a string that contain a given word", "pads a number with leading zeros",
    "returns the n largest values from a list", "checks whether a string contains only digits",
    "computes the area of a circle from its radius", "converts kilometers to miles",
    "finds the longest common prefix of a list of strings", "zips two lists into a list of pairs",
    "returns every second element of a list", "shuffles a list in place",
    "removes empty strings from a list", "computes the average word length in a sentence",
]
BUGS = ["returns the wrong answer for an empty list", "crashes on negative numbers",
        "is off by one at the end", "is very slow for large inputs", "never stops for some inputs",
        "returns None instead of a value", "changes the list that was passed in", "fails on strings with spaces",
        "gives a wrong result for the number zero", "raises an index error on the last item"]
CLASSES = [("BankAccount", "a balance", "deposit and withdraw money without going below zero"),
           ("Rectangle", "a width and a height", "return the area and the perimeter"),
           ("Student", "a name and a list of grades", "return the average grade"),
           ("Book", "a title, an author and a page count", "print a one-line description"),
           ("Counter", "a count starting at zero", "increment, decrement and reset it"),
           ("Temperature", "a value in Celsius", "convert it to Fahrenheit and Kelvin"),
           ("TodoList", "a list of tasks", "add, remove and list tasks"),
           ("ShoppingCart", "a list of items with prices", "add items and compute the total"),
           ("Stopwatch", "a start time", "start, stop and report the elapsed seconds"),
           ("Point", "x and y coordinates", "compute the distance to another point"),
           ("Inventory", "a dictionary of item counts", "add stock and remove stock"),
           ("Playlist", "a list of song titles", "add songs, remove songs and shuffle them"),
           ("Circle", "a radius", "return the area and the circumference"),
           ("Library", "a list of books", "lend a book and return a book"),
           ("Timer", "a number of seconds", "count down and say when it is done"),
           ("Queue", "a list of items", "enqueue, dequeue and check whether it is empty"),
           ("Matrix", "a list of rows", "add two matrices of the same size"),
           ("Employee", "a name and a salary", "give a raise by a percentage")]
FILE_EXTS = [".txt", ".log", ".csv", ".py", ".json", ".md", ".jpg", ".tmp"]
SHELL_TASKS = ["counts the lines in every {ext} file in a folder", "finds all {ext} files changed in the last day",
               "deletes all {ext} files in the current folder", "shows the 10 largest files in a folder",
               "renames every {ext} file to lowercase", "prints the lines of a file that contain the word '{word}'",
               "counts how many times '{word}' appears in a file", "shows disk usage of each subfolder",
               "lists the {ext} files sorted by size", "copies all {ext} files into a backup folder",
               "prints the first column of a CSV file", "replaces '{word}' with '{word2}' in a file",
               "shows which process is using port {port}", "prints the last {k} lines of a log file",
               "compresses a folder into a tar.gz archive", "removes duplicate lines from a file"]
WORDS = ["error", "warning", "todo", "hello", "user", "timeout", "admin", "debug", "price", "failed", "import"]
TABLES = {"customers": (["name", "city", "country", "email"], ["age", "total_spent"]),
          "orders": (["status", "customer_id", "product"], ["amount", "quantity"]),
          "employees": (["name", "department", "job_title"], ["salary", "years_employed"]),
          "products": (["name", "category", "brand"], ["price", "stock"]),
          "students": (["name", "class", "city"], ["grade", "age"]),
          "books": (["title", "author", "genre"], ["pages", "price"]),
          "movies": (["title", "director", "genre"], ["rating", "year"]),
          "flights": (["origin", "destination", "airline"], ["duration", "price"]),
          "songs": (["title", "artist", "album"], ["plays", "length_seconds"]),
          "patients": (["name", "ward", "doctor"], ["age", "days_admitted"])}
REGEX_TARGETS = ["a US zip code", "a date in the form YYYY-MM-DD", "an email address", "a hex color code",
                 "a time in 24-hour format", "a phone number like 555-123-4567", "a whole number with optional sign",
                 "a word that starts with a capital letter", "an IPv4 address", "a URL that starts with https",
                 "a price like $12.99", "a line that ends with a question mark", "a username of 3 to 16 letters "
                 "or digits", "a string of exactly {k} digits", "words that end in 'ing'", "repeated words like "
                 "'the the'", "a simple file name ending in {ext}", "a decimal number with two places"]
STRUCTS = ["a list", "an array", "a linked list", "a hash map", "a set", "a stack", "a queue", "a binary search tree",
           "a heap", "a tuple", "a dictionary", "a deque", "a graph", "a trie"]
STRUCT_OPS = ["inserting an item", "looking up an item", "deleting an item", "finding the smallest item",
              "iterating over all items", "checking whether an item is present"]
IDIOMS = ["read a file line by line", "loop over a list with indexes", "handle an error", "format a string with "
          "variables", "sort a list of records by a field", "create a dictionary or map", "check for a null value",
          "write a for loop that counts down", "define a constant", "read a command-line argument",
          "parse a JSON string", "get the current date and time", "split a string on commas",
          "filter a list with a condition", "make an HTTP GET request", "define a function with a default argument",
          "concatenate strings efficiently", "convert a string to a number", "write to a file",
          "run two tasks concurrently", "define an enum", "copy a list"]
MIX_CONCEPTS = CONCEPTS + ["a mutex", "an API key", "JSON", "a foreign key", "a compiler", "an interpreter",
                           "a thread", "a process", "a callback", "polymorphism", "encapsulation", "a decorator",
                           "a null pointer", "a stack overflow", "a hash function", "an iterator", "a constructor",
                           "static typing", "a merge conflict", "continuous integration", "a Docker container",
                           "an off-by-one error", "tail recursion", "a bit mask", "a pure function"]
VARS = ["nums", "values", "scores", "items", "data", "prices", "ages", "counts"]


def _snippet(r: random.Random) -> str:
    """A short Python snippet built from templates, for "what does this do" and complexity questions."""
    v, k, m = r.choice(VARS), r.randint(2, 9), r.randint(1, 20)
    forms = [
        f"total = 0\nfor x in {v}:\n    if x % {k} == 0:\n        total += x",
        f"result = [x * {k} for x in {v} if x > {m}]",
        f"count = sum(1 for x in {v} if x < {m})",
        f"{v}.sort(reverse=True)\ntop = {v}[:{k}]",
        f"best = None\nfor x in {v}:\n    if best is None or x > best:\n        best = x",
        f"seen = set()\nout = []\nfor x in {v}:\n    if x not in seen:\n        seen.add(x)\n        out.append(x)",
        f"pairs = [(a, b) for a in {v} for b in {v} if a + b == {m}]",
        f"i = 0\nwhile i < len({v}) and {v}[i] != {m}:\n    i += 1",
        f"d = {{}}\nfor x in {v}:\n    d[x % {k}] = d.get(x % {k}, 0) + 1",
        f"s = ''.join(str(x) for x in {v})[::-1]",
        f"evens = list(filter(lambda x: x % 2 == 0, {v}))\nprint(len(evens) * {k})",
        f"n = {m}\nsteps = 0\nwhile n > 1:\n    n //= 2\n    steps += 1",
        f"avg = sum({v}) / len({v}) if {v} else 0",
        f"for i in range(len({v}) - 1):\n    if {v}[i] > {v}[i + 1]:\n        print(i)",
        f"words = text.split()\nlongest = max(words, key=len)\nprint(longest[:{k}])",
    ]
    return r.choice(forms)


def _code_mix(r: random.Random) -> str:
    lang, lang2 = r.sample(MIX_LANGS, 2)
    func = r.choice(MIX_FUNCS)
    concept = r.choice(MIX_CONCEPTS)
    cls, attrs, meth = r.choice(CLASSES)
    table = r.choice(list(TABLES))
    texts, nums = TABLES[table]
    tcol, ncol = r.choice(texts), r.choice(nums)
    k = r.randint(2, 20)
    w, w2 = r.sample(WORDS, 2)
    ext = r.choice(FILE_EXTS)
    s1, s2 = r.sample(STRUCTS, 2)
    shell = r.choice(SHELL_TASKS).format(ext=ext, word=w, word2=w2, port=r.choice([80, 443, 3000, 5432, 8000,
                                                                                   8080, 8888]), k=k)
    regex = r.choice(REGEX_TARGETS).format(k=k % 8 + 3, ext=ext)
    snippet = _snippet(r)
    forms: list[Callable[[], str]] = [
        lambda: f"Write a {lang} function that {func}.",
        lambda: f"Write a {lang} function that {func}. Keep it short and add one comment.",
        lambda: f"Write a {lang} function that {func}, and show one example call with its output.",
        lambda: f"My {lang} function that {func} {r.choice(BUGS)}. What are the usual causes and how do I fix them?",
        lambda: f"How would you refactor a long {lang} function that {func} to make it easier to read?",
        lambda: f"Explain, step by step, how a {lang} function that {func} would work.",
        lambda: f"Write a small {lang} class called {cls} that stores {attrs} and has methods to {meth}.",
        lambda: f"Design a simple {cls} class in {lang}: what fields and methods should it have to {meth}?",
        lambda: f"Write a shell one-liner that {shell}.",
        lambda: f"In Bash, how do I write a command that {shell}? Explain each part.",
        lambda: f"Write a SQL query that lists the {tcol} and {ncol} of every row in the {table} table where "
                f"{ncol} is greater than {k * 5}.",
        lambda: f"Write a SQL query that counts the rows in the {table} table for each {tcol}.",
        lambda: f"Write a SQL query that returns the {k % 9 + 2} rows of the {table} table with the highest {ncol}.",
        lambda: f"Write a SQL query that shows the average {ncol} per {tcol} in the {table} table, sorted from "
                f"highest to lowest.",
        lambda: f"Explain what this SQL query does: SELECT {tcol}, SUM({ncol}) FROM {table} GROUP BY {tcol} "
                f"HAVING SUM({ncol}) > {k * 10};",
        lambda: f"Write a regular expression that matches {regex}, and explain how it works.",
        lambda: f"How do I use a regular expression in {lang} to check for {regex}?",
        lambda: f"When should I use {s1} instead of {s2}? Give a short example.",
        lambda: f"What is the time complexity of {r.choice(STRUCT_OPS)} in {s1}?",
        lambda: f"What does this Python code do?\n\n{snippet}",
        lambda: f"What is the time complexity of this Python code, and why?\n\n{snippet}",
        lambda: f"Rewrite this Python code to be shorter and clearer:\n\n{snippet}",
        lambda: f"Translate this Python code to {lang2}:\n\n{snippet}",
        lambda: f"What is the idiomatic way in {lang} to {r.choice(IDIOMS)}?",
        lambda: f"Show how to {r.choice(IDIOMS)} in {lang} and in {lang2}.",
        lambda: f"Explain {concept} with a short {lang} example.",
        lambda: f"Explain {concept} to {r.choice(AUDIENCES)} who is learning to program.",
        lambda: f"Give a real-world analogy for {concept} in programming.",
        lambda: f"Write two unit tests in {lang} for a function that {func}.",
        lambda: f"What edge cases should I test for a function that {func}?",
    ]
    return r.choice(forms)()


SUBJECTS = ["My neighbor", "The teacher", "Our team", "The old man", "My sister", "The new manager", "A small dog",
            "The children", "My friend", "The chef", "The bus driver", "Our landlord", "The doctor", "My cousin"]
VERBS = ["finished the project", "cooked dinner for everyone", "forgot the meeting", "fixed the broken window",
         "lost the keys", "painted the fence", "won the race", "missed the train", "planted a tree",
         "cleaned the kitchen", "wrote a long letter", "answered every question", "sold the old car",
         "found a wallet on the street", "baked bread", "canceled the trip"]
WHENS = ["yesterday", "last night", "this morning", "on Sunday", "after lunch", "before the storm",
         "at the last minute", "during the holidays", "early today", "last week"]
REVIEWS = ["The {thing} arrived late and the box was damaged.", "I love this {thing}, it works perfectly.",
           "The {thing} is okay, nothing special.", "Terrible {thing}, it broke after two days.",
           "Great value for money, the {thing} is better than I expected.",
           "The {thing} does what it says, but the instructions were confusing.",
           "I would not buy this {thing} again.", "Best {thing} I have bought this year!",
           "The {thing} looks nice but feels cheap.", "Customer service helped me quickly with my {thing}."]
THINGS = ["phone case", "blender", "backpack", "lamp", "pair of shoes", "coffee maker", "umbrella", "keyboard",
          "water bottle", "desk chair", "headphones", "jacket", "toaster", "tent", "watch"]
LANGUAGES_TO = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
PHRASES = ["Where is the train station?", "I would like a cup of coffee, please.", "How much does this cost?",
           "Good morning, how are you?", "The weather is nice today.", "I am learning a new language.",
           "Can you help me, please?", "What time is it?", "I live in a small town.", "Thank you very much.",
           "My favorite color is blue.", "We are going to the beach tomorrow.", "I do not understand.",
           "The library opens at nine.", "Do you have a table for two?", "I like to read before bed.",
           "Happy birthday!", "See you next week.", "The cat is sleeping on the sofa.", "I need a doctor."]
REWRITES = ["Rewrite this sentence to sound more formal", "Rewrite this sentence to sound friendlier",
            "Rewrite this sentence in the passive voice", "Make this sentence more exciting",
            "Rewrite this sentence for a children's book", "Rewrite this sentence as a question",
            "Correct and improve this sentence", "Rewrite this sentence as a news headline"]
RECIPIENTS = {"my manager": ["asking for a day off next Friday", "asking for feedback on my work",
                              "saying I will be late tomorrow", "asking to work from home on Monday"],
              "a coworker": ["asking for help with a report", "inviting them to lunch", "handing over my tasks"],
              "my landlord": ["reporting a broken heater", "complaining politely about a noise problem",
                              "asking to paint the living room"],
              "a teacher": ["asking a question about homework", "explaining why my child was absent"],
              "a customer": ["saying their order is delayed", "answering a question about delivery times"],
              "my neighbor": ["asking them to water my plants", "inviting them to a small party"],
              "a client": ["following up on an invoice", "sending a project update", "proposing a new deadline"],
              "a hotel": ["booking a room for two nights", "asking about late check-in", "asking for a quiet room"],
              "my team": ["announcing a new meeting time", "celebrating a finished project", "sharing next steps"],
              "a professor": ["asking for a recommendation letter", "asking for an extension on an essay"],
              "a new colleague": ["welcoming them to the team", "offering to show them around"],
              "a friend": ["inviting them to a small party", "wishing them luck with an exam",
                           "asking to borrow a tent"],
              "a plumber": ["asking for a quote to fix a leaking sink", "booking a visit next week"],
              "a restaurant": ["booking a table for six", "asking about vegetarian options"],
              "a shop": ["asking for a refund", "asking whether an item is back in stock"],
              "my dentist's office": ["asking to reschedule an appointment", "confirming an appointment"]}
GENERIC_PURPOSES = ["thanking them for their help", "apologizing for a late reply", "asking to reschedule a meeting",
                    "introducing myself", "asking about opening hours", "declining an invitation kindly",
                    "congratulating them on a promotion", "confirming an appointment"]
TONES = ["", " Keep it short.", " Keep it polite and brief.", " Make it friendly.", " Make it formal."]
DISHES = ["pancakes", "tomato soup", "fried rice", "banana bread", "guacamole", "vegetable curry", "omelette",
          "lemonade", "chocolate chip cookies", "lentil soup", "a simple salad", "spaghetti with tomato sauce",
          "hummus", "chicken stir-fry", "oatmeal", "roasted vegetables", "a fruit smoothie", "garlic bread",
          "mashed potatoes", "scrambled eggs", "a grilled cheese sandwich", "apple crumble", "bean chili"]
INGREDIENTS = ["eggs", "butter", "milk", "sugar", "an oven", "flour", "garlic", "meat", "salt"]
CITIES = ["Paris", "Tokyo", "Rome", "New York", "Barcelona", "Cairo", "Sydney", "Lisbon", "Istanbul", "Prague",
          "Mexico City", "Bangkok", "Vienna", "Cape Town", "Vancouver", "Kyoto", "Amsterdam", "Buenos Aires",
          "Seoul", "Edinburgh", "Marrakesh", "Dublin", "Athens", "Berlin"]
MIX_TOPICS = TOPICS + ["the Great Wall of China", "the Renaissance", "the Industrial Revolution", "vaccines",
                       "earthworms", "the Moon landing", "evolution", "photosynthesis in algae", "the Vikings",
                       "the heart rate", "hydration", "protein", "blood types", "the brain", "atoms",
                       "light", "the Sun", "Mars", "comets", "the Amazon River", "deserts", "the Ice Age",
                       "ancient Greece", "the telephone", "the steam engine", "antibiotics", "allergies",
                       "stretching", "calories", "the metric system", "the Cold War", "castles", "volcanic islands",
                       "migrating birds", "mushrooms", "whales", "salt", "bread", "the alphabet", "calendars"]
CHOICES = ["working from home", "living in a big city", "owning a car", "buying a used phone", "learning to code",
           "renting instead of buying a home", "studying abroad", "getting a dog", "taking a gap year",
           "using a tablet for school", "electric cars", "online classes", "shopping at farmers markets",
           "cycling to work", "having a part-time job as a student", "social media", "reading e-books",
           "traveling by train", "waking up early", "freelancing", "a four-day work week", "solar power at home"]
PAIRS = [("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "movies"), ("summer", "winter"),
         ("running", "swimming"), ("Python", "JavaScript"), ("a laptop", "a desktop"), ("rice", "pasta"),
         ("the beach", "the mountains"), ("saving", "investing"), ("paper books", "e-books"),
         ("a city", "the countryside"), ("baking", "frying"), ("yoga", "weight lifting"), ("email", "phone calls"),
         ("renting", "buying"), ("a crocodile", "an alligator"), ("weather", "climate"), ("a virus", "bacteria"),
         ("a lake", "a sea"), ("butter", "margarine"), ("a frog", "a toad"), ("a moth", "a butterfly")]
DEFINE_WORDS = ["serendipity", "resilient", "ambiguous", "nostalgia", "meticulous", "empathy", "procrastinate",
                "benevolent", "candid", "diligent", "ephemeral", "frugal", "gregarious", "inevitable", "lucid",
                "mundane", "obsolete", "pragmatic", "quaint", "reluctant", "skeptical", "tedious", "vivid",
                "whimsical", "zealous", "humble", "curious", "generous", "sustainable", "innovation"]
BRAINSTORM = ["a birthday party for a seven-year-old", "a school science fair project", "a rainy weekend at home",
              "a name for a small bakery", "a short story about a lost robot", "a team-building activity",
              "a gift for a friend who loves cooking", "a blog about gardening", "healthy snacks for work",
              "a family day out", "a podcast about history", "a fundraiser for a local library",
              "a theme for a costume party", "ways to reuse glass jars", "a mobile app for students",
              "a board game night", "a slogan for a bike shop", "things to do in a small town",
              "a New Year's resolution", "a classroom reading challenge"]


def _chat_mix(r: random.Random) -> str:
    topic, topic2 = r.sample(MIX_TOPICS, 2)
    city = r.choice(CITIES)
    a, b = r.choice(PAIRS)
    sentence = f"{r.choice(SUBJECTS)} {r.choice(VERBS)} {r.choice(WHENS)}."
    review = r.choice(REVIEWS).format(thing=r.choice(THINGS))
    k = r.randint(3, 7)
    recipient = r.choice(list(RECIPIENTS))
    purpose = r.choice(RECIPIENTS[recipient] + GENERIC_PURPOSES[:4] if recipient != "a customer" else
                       RECIPIENTS[recipient] + GENERIC_PURPOSES[:2])
    forms: list[Callable[[], str]] = [
        lambda: f"How do I {r.choice(ADVICE)}? Give me {k} steps.",
        lambda: f"What is the best way to {r.choice(ADVICE)} if I only have {k * 5} minutes a day?",
        lambda: f"Compare {a} and {b}. Which would you pick and why?",
        lambda: f"What are the main differences between {a} and {b}?",
        lambda: f"List the pros and cons of {r.choice(CHOICES)}.",
        lambda: f"Is {r.choice(CHOICES)} a good idea? Give {k % 3 + 2} reasons for and against.",
        lambda: f"Write a short email to {recipient} {purpose}.{r.choice(TONES)}",
        lambda: f"Write a text message to {recipient} {purpose}.",
        lambda: f"Give me a simple recipe for {r.choice(DISHES)} for {k % 5 + 2} people.",
        lambda: f"How can I make {r.choice(DISHES)} without {r.choice(INGREDIENTS)}?",
        lambda: f"What should I know before visiting {city} for the first time?",
        lambda: f"Plan a {k % 4 + 2}-day trip to {city} on a small budget.",
        lambda: f"What food should I try in {city}?",
        lambda: f"Explain {topic} to {r.choice(AUDIENCES)} in a few sentences.",
        lambda: f"Give me {k} surprising facts about {topic}.",
        lambda: f"How are {topic} and {topic2} connected, if at all?",
        lambda: f"Write {r.choice(STYLES)} about {topic}.",
        lambda: f"{r.choice(REWRITES)}: \"{sentence}\"",
        lambda: f"Summarize this in a few words: \"{sentence}\"",
        lambda: f"Continue this story in three sentences: \"{sentence}\"",
        lambda: f"What does the word \"{r.choice(DEFINE_WORDS)}\" mean? Use it in a sentence.",
        lambda: f"Give me {k % 3 + 2} synonyms for \"{r.choice(DEFINE_WORDS)}\" and explain the small differences.",
        lambda: f"Brainstorm {k} ideas for {r.choice(BRAINSTORM)}.",
        lambda: f"Is this review positive, negative or neutral? \"{review}\"",
        lambda: f"Write a short, polite reply from the seller to this review: \"{review}\"",
        lambda: f"Translate into {r.choice(LANGUAGES_TO)}: \"{r.choice(PHRASES)}\"",
        lambda: f"How do you say \"{r.choice(PHRASES)}\" in {r.choice(LANGUAGES_TO)}? Explain the words.",
        lambda: f"Why do people disagree about {r.choice(CHOICES)}?",
        lambda: f"What are {k % 3 + 2} common myths about {topic}?",
        lambda: f"Write a quiz with {k % 3 + 3} questions about {topic}, with answers.",
    ]
    return r.choice(forms)()


def mix_prompts_with_categories(n: int = 12000, seed: int = 0) -> list[tuple[str, str]]:
    """(category, prompt) pairs behind `mix_prompts` (`draw_distinct` over the mix generators)."""
    gens: dict[str, Callable[[random.Random], str]] = {
        "math": lambda g: math_problem(g) if g.random() < 0.6 else _math_more(g), "code": _code_mix, "chat": _chat_mix}
    return draw_distinct(n, seed, gens, "mix")


def mix_prompts(n: int = 12000, seed: int = 0) -> list[str]:
    """`n` distinct prompts, about 40% math, 30% code, 30% chat at every n, in a fixed order for a seed;
    `mix_prompts(m)` is a prefix of `mix_prompts(n)` for m < n (module docstring)."""
    return [p for _, p in mix_prompts_with_categories(n, seed)]
