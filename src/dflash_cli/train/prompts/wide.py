"""The `wide` training prompt set: longer, more natural requests than `mix`.

`mix` (mix.py) leans on short formulaic tasks (solve for x, summarise a sentence, translate a
phrase) whose replies a drafter learns quickly, while people ask for multi-step word problems, advice
about their own situation, explanations of everyday things and short creative pieces, whose replies
are longer and freer. On those a drafter trained on `mix` drafted far worse than on unseen `mix` prompts
(docs/training.md). `wide` draws the same 40/30/30% math/code/chat mix from such forms: word problems of
two to four steps in everyday settings, functions with precise requirements in 14 languages, bugs in small
snippets, "what does this print", explanations of 90 everyday phenomena and 40 mechanisms, 40 personal
situations, scenes, dialogues, poems and letters. The bench prompts (dflash_cli/prompts/*.jsonl) are
never generated here; a test keeps the two apart.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from dflash_cli.train.prompts.draw import NAMES, draw_distinct

WIDE_ASKS = ["Go through it step by step.", "Walk me through the solution.", "Explain each step.",
             "Work through it carefully.", "Show your reasoning.", "Solve it step by step and check the answer.",
             "Explain how you get there.", "Show the steps.", "Reason it out step by step.", ""]
GOODS = [("notebooks", "box"), ("pencils", "pack"), ("eggs", "carton"), ("apples", "crate"), ("cans", "case"),
         ("cupcakes", "tray"), ("bottles", "crate"), ("tiles", "box"), ("seed packets", "bag"), ("candles", "box")]
GROUPS = ["classes", "teams", "tables", "families", "shelves", "volunteers", "cabins", "groups"]
COINS = [("nickels", 5), ("dimes", 10), ("quarters", 25)]


def _word_problem(r: random.Random) -> str:
    n1, n2, n3 = r.sample(NAMES, 3)
    goods, unit = r.choice(GOODS)
    a, b, c, d = r.randint(12, 90), r.randint(3, 30), r.randint(2, 9), r.randint(2, 12)
    rate1, rate2 = r.randint(4, 25), r.randint(3, 20)
    pay, h1, h2 = r.randint(9, 30), r.randint(2, 9), r.randint(2, 9)
    (c1, v1), (c2, v2) = r.sample(COINS, 2)
    k1, k2 = r.randint(5, 30), r.randint(5, 30)
    temp, step, t0 = r.randint(-12, 15), r.randint(1, 5), r.randint(5, 9)
    bill, tip = r.randint(30, 240), r.choice([10, 12, 15, 18, 20])
    forms: list[Callable[[], str]] = [
        lambda: f"A train leaves the station with {a + 40} passengers. At the first stop {b} get off and {c + 5} "
                f"get on; at the second stop a third of the passengers get off. How many are still on the train?",
        lambda: f"{n1} is {c} years older than {n2}, and {n2} is twice as old as {n3}. If {n3} is {d + 3}, "
                f"how old is {n1}?",
        lambda: f"One pipe fills a tank at {rate1} liters per minute and a second pipe at {rate2} liters per minute. "
                f"How long do both pipes together take to fill a {(rate1 + rate2) * (b + 5)}-liter tank?",
        lambda: f"{n1} earns ${pay} an hour and works {h1} hours on Monday and {h2} hours on Tuesday. "
                f"After paying ${c * 5} for lunch, how much of the money is left?",
        lambda: f"A shop had {a * 10} {goods}. It received {c} deliveries of {b * 5} {goods} each and sold "
                f"{a * 3}. How many {goods} does it have now?",
        lambda: f"A piggy bank holds {c1} and {c2} worth ${(k1 * v1 + k2 * v2) / 100:.2f} in total, "
                f"{k1 + k2} coins in all. How many of each coin are there?",
        lambda: f"At {t0} a.m. the temperature was {temp} degrees, and it rose by {step} degrees every hour. "
                f"What was the temperature at {t0 + d % 5 + 2} a.m.?",
        lambda: f"{d % 4 + 3} friends share a dinner bill of ${bill} and add a {tip}% tip. How much does each of "
                f"them pay?",
        lambda: f"A school buys {c + 3} {unit}es of {goods} with {b + 6} in each and shares them equally among "
                f"{c} {r.choice(GROUPS)}. How many does each get, and how many are left over?",
        lambda: f"A parking garage has {c + 2} floors with {b + 20} spaces on each. If {a + 30} cars are parked, "
                f"how many spaces are free?",
        lambda: f"A ribbon {c + 4} meters long is cut into pieces of {r.choice([30, 40, 45, 70, 80])} centimeters. "
                f"How many whole pieces are there, and how much ribbon is left?",
        lambda: f"{n1} collected {a} bottles on Monday, {b} on Tuesday and three times Tuesday's number on "
                f"Wednesday. How many bottles did {n1} collect in the three days?",
        lambda: f"{n1} saves ${c + 2} a week for {b} weeks, then spends ${a} on a jacket. How much is left?",
        lambda: f"A square field has a perimeter of {4 * (b + 4)} meters. What is its area?",
        lambda: f"A cinema sold {a * 4} tickets. Adults paid ${c + 8} and children ${c + 3}; there were {a} "
                f"children. How much money did the cinema take?",
        lambda: f"A cyclist rides {rate1} kilometers per hour for {h1} hours, then {rate2} kilometers per hour for "
                f"{d} more hours. How far does she ride, and what is her average speed?",
        lambda: f"{n1} and {n2} paint a fence together. {n1} alone would take {c + 2} hours and {n2} alone "
                f"{c + 4} hours. How long do they take together?",
        lambda: f"A recipe for {d + 2} people uses {c + 1} eggs and {b * 10} grams of flour. How much of each is "
                f"needed for {3 * (d + 2)} people?",
        lambda: f"A phone costs ${bill * 3}. It is discounted by {tip}% and then a tax of 8% is added. What is "
                f"the final price?",
        lambda: f"In a club of {a + b} members, {c * 10}% play chess and half of the rest play cards. How many "
                f"members play cards?",
        lambda: f"A bus ticket costs ${c + 1}.{r.choice(['25', '50', '75'])}. {n1} buys {d} tickets with a $50 "
                f"bill. How much change does {n1} get?",
        lambda: f"A farmer plants {c + 4} rows of {b + 10} trees. A storm knocks down {d} trees in every row. "
                f"How many trees are still standing?",
        lambda: f"{n1} runs {c + 1} laps of a {r.choice([200, 250, 400])}-meter track every morning for "
                f"{d} days. How many kilometers is that in total?",
        lambda: f"The sum of three consecutive numbers is {3 * (a + 1)}. What are the numbers?",
        lambda: f"A rectangle's length is {c} centimeters more than its width, and its perimeter is "
                f"{4 * (b + 2) + 2 * c} centimeters. What are its length, width and area?",
        lambda: f"{n1} reads {b + 5} pages on weekdays and {2 * (b + 5)} pages on Saturdays and Sundays. How many "
                f"pages does {n1} read in {d % 3 + 2} weeks?",
        lambda: f"A water bottle is {r.choice(['half', 'a quarter', 'three quarters'])} full and holds "
                f"{r.choice([600, 800, 1000, 1200, 1500])} milliliters when full. {n1} drinks {b * 10} milliliters. "
                f"How much water is left?",
        lambda: f"A printer prints {rate1 + 10} pages a minute. How long does it take to print {c + 2} copies of a "
                f"{a}-page report?",
        lambda: f"{n1} has twice as many stamps as {n2}, and {n2} has {b} fewer than {n3}. Together they have "
                f"{4 * (b + 20) - b} stamps. How many does each of them have?",
        lambda: f"A store sells {goods} at {d + 1} for ${c + 2}. How much do {(d + 1) * (b % 6 + 2)} of them cost?",
    ]
    ask = r.choice(WIDE_ASKS)
    return (r.choice(forms)() + (" " + ask if ask else "")).strip()


WIDE_LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Kotlin",
              "C#", "Ruby", "Swift", "PHP", "Bash"]
TASKS = ["returns the product of the odd numbers in a list", "counts the uppercase letters in a string",
         "returns the last n elements of a list", "checks whether a number is a perfect square",
         "returns the longest common prefix of a list of strings", "converts a string to title case",
         "returns the difference between the largest and smallest value in a list",
         "checks whether a string contains only digits", "returns a list of the squares of the first n numbers",
         "finds the first repeated character in a string", "converts minutes into hours and minutes",
         "computes the average of the positive numbers in a list, ignoring the rest",
         "returns the number of days between two dates", "interleaves two lists of equal length",
         "removes all vowels from a string", "returns the digits of a number as a list",
         "checks whether a list contains any duplicates", "returns the k largest values of a list",
         "counts the words that start with a capital letter", "converts a Roman numeral to an integer",
         "returns the sum of a list, skipping None values",
         "checks whether two lists have the same elements in any order",
         "pads a number with leading zeros to a given width", "returns the middle character or characters of a string",
         "finds all pairs in a list that add up to a target", "truncates a string to n characters and adds ...",
         "counts the lines of a text that contain a given word", "returns the running maximum of a list",
         "checks whether a sentence is a pangram", "swaps the keys and values of a dictionary"]
RETURNS = ["", " It should return 0 for an empty input.", " Handle the empty case.", " Include a short example.",
           " Explain how it works.", " Add two test cases.", " Keep it short."]
BUGGY = [("Python", "def last(xs): return xs[len(xs)]", "should return the last element but raises an error"),
         ("Python", "def total(xs): s = 0; for x in xs: s = x; return s",
          "should add up a list but returns the wrong sum"),
         ("Python", "def is_even(n): return n % 2 == 1", "should tell whether a number is even but gets it backwards"),
         ("Python", "def count_a(s): return s.count('A')", "should count the letter a in any case but misses some"),
         ("JavaScript", "function sum(a) { let s; for (const x of a) s += x; return s; }", "returns NaN"),
         ("JavaScript", "const items = [3, 1, 10]; items.sort();", "sorts the numbers in a surprising order"),
         ("Java", "for (int i = 0; i <= arr.length; i++) total += arr[i];", "throws an exception"),
         ("C", "char *s = \"hello\"; s[0] = 'H';", "crashes when it runs"),
         ("Python", "names = []; names = names.append('Ana')", "leaves names set to None"),
         ("Python", "def add_item(item, bag=[]): bag.append(item); return bag", "keeps items from earlier calls"),
         ("Go", "for i := 0; i < len(s); i++ { fmt.Println(s[i]) }", "prints numbers instead of letters"),
         ("SQL", "SELECT name FROM users WHERE email = NULL;", "never returns any row")]
PRINTS = [("Python", "print([1, 2, 3] * 2)"), ("Python", "print('5' + '3', 5 + 3)"),
          ("JavaScript", "console.log([] + {})"),
          ("Python", "print(7 // 2, 7 % 2, -7 // 2)"), ("JavaScript", "console.log(typeof null)"),
          ("Python", "print(bool(''), bool(' '), bool([]))"), ("JavaScript", "console.log('2' * '3', '2' + 3)"),
          ("Python", "a = [1, 2]; b = a; b.append(3); print(a)"), ("Python", "print(round(2.5), round(3.5))"),
          ("JavaScript", "console.log(1 < 2 < 3, 3 > 2 > 1)"), ("Python", "print('abc'[::-1], 'abc'[1:])"),
          ("C", "printf(\"%d\", 7 / 2);")]
COMMANDS = ["ls -la | grep '^d'", "du -sh * | sort -h", "tar -czf backup.tar.gz notes/", "grep -rn 'TODO' src/",
            "ps aux | grep python", "chmod +x run.sh", "head -n 20 app.log", "find . -type f -size +10M",
            "wc -w essay.txt", "sort names.txt | uniq -c", "git log --oneline -5", "curl -I https://example.com"]
PY_FEATURES = ["a context manager that times a block of code", "a decorator that retries a function three times",
               "a generator that yields the lines of a file that are not empty", "a dataclass for a book with a title,"
               " an author and a year", "a class with a property that checks its value",
               "an enum of the days of the week",
               "a function with keyword-only arguments", "a small command-line script using argparse"]
CODE_TOPICS = ["git merge and git rebase", "a process and a thread", "a compiler and an interpreter",
               "== and is in Python", "let and const in JavaScript", "an array and a linked list",
               "SQL's WHERE and HAVING", "a shallow copy and a deep copy", "a stack and a queue",
               "GET and POST requests", "static and dynamic typing", "a class and an object"]


def _code_task(r: random.Random) -> str:
    lang, task = r.choice(WIDE_LANGS), r.choice(TASKS)
    bug_lang, snippet, symptom = r.choice(BUGGY)
    print_lang, line = r.choice(PRINTS)
    forms: list[Callable[[], str]] = [
        lambda: f"Write a {lang} function that {task}.{r.choice(RETURNS)}",
        lambda: f"Write a {lang} function that {task}.{r.choice(RETURNS)}",
        lambda: f"This {bug_lang} code {symptom}: {snippet} What is wrong, and how do I fix it?",
        lambda: f"What does this {print_lang} print, and why? {line}",
        lambda: f"Explain what this shell command does: {r.choice(COMMANDS)}",
        lambda: f"Write {r.choice(PY_FEATURES)} in Python and explain it briefly.",
        lambda: f"Explain the difference between {r.choice(CODE_TOPICS)}, with a short example.",
        lambda: f"I need a {lang} function that {task}. Can you write it and explain the tricky part?",
        lambda: f"Write a {lang} function that {task}, then say what its time complexity is.",
        lambda: f"Review this {bug_lang} code and suggest improvements: {snippet}",
    ]
    return r.choice(forms)()


WHYS = ["do onions float in water", "does bread go stale", "do leaves change color in autumn", "do we get hiccups",
        "does ice float", "do cats knead with their paws", "does the moon look bigger near the horizon",
        "do we yawn", "does salt melt ice on roads", "do stars twinkle", "does popcorn pop", "do birds fly south",
        "do our fingers wrinkle in the bath", "does the sea taste salty", "do dogs wag their tails",
        "does coffee keep people awake", "do planes leave white trails", "does metal feel colder than wood",
        "do we dream", "does thunder come after lightning", "do apples turn brown after they are cut",
        "do some people get seasick", "do bubbles look rainbow-colored", "do we need to drink water",
        "does hot air rise", "do mosquitoes bite some people more than others", "do zebras have stripes",
        "does music give people chills", "do old books smell sweet", "do tomatoes count as fruit",
        "does a spoon in a glass of water look bent", "do we have fingerprints", "does a fridge hum",
        "do owls hunt at night", "does the wind blow", "do rivers bend", "does cheese have holes",
        "do people snore", "does our voice sound different on a recording", "do bees make honey"]
HOWS = ["a refrigerator keeps food cold", "a microwave heats food", "a compass finds north", "a rainbow forms",
        "a credit card payment works", "noise-cancelling headphones work", "a dishwasher cleans dishes",
        "a hot air balloon flies", "a lock and key work", "a thermometer measures temperature",
        "GPS knows where I am", "a touch screen senses a finger", "an elevator moves between floors",
        "a submarine dives and surfaces", "a bicycle's gears make pedaling easier", "soap removes grease",
        "a camera takes a photo", "yeast makes bread rise", "a wind turbine makes electricity",
        "the heart pumps blood", "a search engine finds web pages", "a vaccine is tested before it is used",
        "an email gets from one computer to another", "a battery stores energy", "a lighthouse guides ships",
        "a volcano erupts", "a seed grows into a plant", "a car engine turns fuel into motion",
        "a bank decides to give someone a loan", "a library sorts its books"]
THINGS_PAIRS = [("a crocodile", "an alligator"), ("a frog", "a toad"), ("baking soda", "baking powder"),
                ("a hurricane", "a tornado"), ("a rabbit", "a hare"), ("a lake", "a pond"), ("a cold", "the flu"),
                ("a moth", "a butterfly"), ("a planet", "a star"), ("an ocean", "a sea"), ("a herb", "a spice"),
                ("a cello", "a violin"), ("a city", "a town"), ("a loan", "a grant"), ("a poem", "a song"),
                ("a museum", "a gallery"), ("jam", "jelly"), ("a turtle", "a tortoise"), ("a map", "a globe"),
                ("a meteor", "a comet")]
SITUATIONS = ["My roommate never does the dishes and it is starting to annoy me.",
              "I start a new job on Monday and I don't know anyone there.",
              "My little brother is afraid of the dark.", "I keep waking up tired even after eight hours of sleep.",
              "I want to ask my boss for a raise but I'm nervous.", "My best friend is moving to another country.",
              "I have two weeks to prepare for a math exam.", "I spend too much time on my phone at night.",
              "My neighbor's dog barks all night.", "I want to cook more at home but I'm always tired after work.",
              "I said something rude to a coworker and I regret it.", "My grandmother is lonely since she retired.",
              "I have to give a toast at my sister's wedding.", "I want to read more books this year.",
              "My plants keep dying even though I water them.", "I get stressed when my email inbox fills up.",
              "I want to get back into exercise after a long break.", "My kids argue about screen time every day.",
              "I'm planning my first trip abroad alone.", "I lent a friend money and they haven't paid it back.",
              "I want to learn to swim as an adult.", "My team at work doesn't listen to my ideas.",
              "I have a long flight next week and I get bored easily.", "I feel overwhelmed by my to-do list.",
              "I want to start a small vegetable garden on my balcony.", "My teenage son doesn't talk to me much."]
ASKS_FOR_HELP = ["What should I do?", "How should I handle it?", "Any advice?", "Where do I start?",
                 "What can I do about it?", "How can I make it easier?"]
CHARACTERS = ["an old fisherman", "a shy dragon", "a lost astronaut", "a talking cat", "a young baker",
              "a retired detective", "a curious robot", "a tired mail carrier", "a forgetful wizard",
              "a girl who collects keys", "a lonely giant", "a street musician", "a nervous pilot", "a grumpy owl",
              "a clumsy knight", "a gardener who talks to her tomatoes", "a night-shift nurse", "a very old tortoise",
              "a boy who builds kites", "a ship's cook"]
SCENES = ["a busy market at dawn", "a snowy mountain village", "a quiet library at closing time",
          "a lighthouse in a storm", "a train station at midnight", "a summer fair", "an empty beach in winter",
          "a city rooftop garden", "a forest after rain", "a crowded kitchen before a holiday dinner",
          "a desert town at noon", "a bookshop on a rainy evening", "a harbor full of fishing boats",
          "an abandoned amusement park", "a bakery at four in the morning", "a space station far from Earth"]
GENRES = ["mystery", "science fiction", "fairy tale", "adventure", "ghost story", "comedy"]
OCCASIONS = [("my teacher", "thanking them at the end of the school year"),
             ("a new neighbor", "welcoming them to the street"),
             ("my landlord", "asking them to repair the heating"),
             ("a colleague", "congratulating them on a promotion"),
             ("a hotel", "asking whether they can store my luggage"),
             ("my child's school", "explaining that my child will miss two days"),
             ("a friend", "saying sorry for missing their party"),
             ("a company", "complaining that my order arrived broken")]
PLANS = ["a packing list for a weekend at the beach", "a weekly meal plan for a family of four on a budget",
         "a morning routine for someone who wants to be more productive", "a checklist for moving house",
         "a simple workout I can do at home in twenty minutes", "a reading list for someone new to science fiction",
         "a plan for a rainy day with two young kids", "a shopping list for a picnic for six people",
         "a study schedule for the week before exams", "a checklist for a first camping trip"]


TAILS = ["", "", " Keep it short.", " Use simple words.", " Give an example.", " Answer in a few sentences.",
         " Use a short list.", " Explain it like I'm twelve.", " Be specific."]
TWISTS = ["who finds a map", "who loses something important", "who makes an unlikely friend",
          "who has to keep a secret",
          "who gets a strange letter", "who must fix a mistake", "who hears music nobody else hears",
          "who wakes up somewhere new"]


def _chat_request(r: random.Random) -> str:
    """A story, scene, dialogue or poem (a third), else a question, a situation or a writing request."""
    return _story(r) if r.random() < 0.33 else _question(r)


def _story(r: random.Random) -> str:
    forms: list[Callable[[], str]] = [
        lambda: f"Write a short story about {r.choice(CHARACTERS)} {r.choice(TWISTS)}.",
        lambda: f"Write a short story about {r.choice(CHARACTERS)} in {r.choice(SCENES)}.",
        lambda: f"Write the opening paragraph of a {r.choice(GENRES)} story set in {r.choice(SCENES)}.",
        lambda: f"Describe {r.choice(SCENES)} in a few vivid sentences.",
        lambda: f"Write a short dialogue between {r.choice(CHARACTERS)} and {r.choice(CHARACTERS)}.",
        lambda: f"Write a short poem about {r.choice(CHARACTERS)} {r.choice(TWISTS)}.",
        lambda: f"Write a limerick about {r.choice(CHARACTERS)}.",
    ]
    return r.choice(forms)()


def _question(r: random.Random) -> str:
    a, b = r.choice(THINGS_PAIRS)
    whom, why = r.choice(OCCASIONS)
    forms: list[Callable[[], str]] = [
        lambda: f"Why {r.choice(WHYS)}?",
        lambda: f"Why {r.choice(WHYS)}? Explain it simply.",
        lambda: f"Explain how {r.choice(HOWS)}.",
        lambda: f"Can you explain how {r.choice(HOWS)}, in simple terms?",
        lambda: f"What is the difference between {a} and {b}?",
        lambda: f"{r.choice(SITUATIONS)} {r.choice(ASKS_FOR_HELP)}",
        lambda: f"{r.choice(SITUATIONS)} {r.choice(ASKS_FOR_HELP)}",
        lambda: f"Help me write a short message to {whom} {why}.",
        lambda: f"Make me {r.choice(PLANS)}.",
        lambda: f"How can I explain to a child how {r.choice(HOWS)}?",
    ]
    return r.choice(forms)() + r.choice(TAILS)


WIDE_GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "math": _word_problem, "code": _code_task, "chat": _chat_request}


def wide_prompts_with_categories(n: int = 12000, seed: int = 0) -> list[tuple[str, str]]:
    """(category, prompt) pairs of the `wide` set: 40% math, 30% code, 30% chat at every n, all distinct,
    `n` < m giving a prefix of m's."""
    return draw_distinct(n, seed, WIDE_GENERATORS, "wide")


def wide_prompts(n: int = 12000, seed: int = 0) -> list[str]:
    return [p for _, p in wide_prompts_with_categories(n, seed)]
