#!/usr/bin/env python3
"""Code prompts for `dspec train-drafter`, made offline.

Training prompts come from the documented public functions of the Python standard library
this interpreter ships (its source files, parsed, never imported): each asks for a
function by its name and signature and what its docstring's first sentence says, in a few
phrasings. The held-out prompts are written here apart, in the style users ask for code;
none of them is a standard-library function's, and none comes from HumanEval or MBPP.

Usage: scripts/code-prompts.py OUT_DIR [--limit N] [--seed S]
Writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl ({"prompt": ...} lines, for --data and
--eval) and OUT_DIR/eval.txt (the same held-out prompts, one a line, for `dspec bench`).
"""

import argparse
import ast
import json
import random
import re
import sysconfig
from pathlib import Path

HELD_OUT = [
    "Write a Python function that merges two sorted lists into one sorted list without using sort().",
    "Write a Python function that checks whether a string of brackets ()[]{} is balanced.",
    "Write a Python function that returns the longest common prefix of a list of strings.",
    "Write a Python function that converts a Roman numeral string to an integer.",
    "Write a Python function that rotates a square matrix (a list of lists) 90 degrees clockwise.",
    "Write a Python function that groups a list of words into lists of anagrams.",
    "Write a Python function that computes the edit distance between two strings with dynamic programming.",
    "Write a Python function that flattens an arbitrarily nested list of integers.",
    "Write a Python class implementing a least-recently-used cache with get and put methods.",
    "Write a Python function that parses a query string like 'a=1&b=2' into a dictionary.",
    "Write a Python function that returns all prime numbers below n using the sieve of Eratosthenes.",
    "Write a Python function that performs binary search on a sorted list and returns the index or -1.",
    "Write a Python function that counts word frequencies in a text file and returns the ten most common.",
    "Write a Python function that validates an IPv4 address given as a string.",
    "Write a Python function that converts a snake_case identifier to camelCase.",
    "Write a Python function that finds the shortest path in an unweighted graph given as an adjacency dict.",
]

# (phrasing, whether its verb reads in the third person)
PHRASINGS = [
    ("Write a Python function `{name}({args})` that {what}", True),
    ("Implement `{name}({args})` in Python. It should {what}", False),
    ("Write `{name}({args})` in Python, with a docstring: it {what}", True),
    ("Write a Python function named {name} that {what} Explain how it works briefly.", True),
    ("In Python, write a method `{owner}.{name}({args})` that {what}", True),
]


# Verbs a docstring's first sentence may open with (in either person): sentences that
# open otherwise ("This is…", "Called when…") do not read as a request.
VERBS = set("""
return get set create make build write read convert compute calculate check test find
parse remove delete add open close send receive encode decode format print copy move load
save split join run start stop update register generate produce wait raise handle process
apply initialize construct append insert extract replace search match compare translate
escape unescape quote unquote normalize validate lock release acquire flush reset clear
emit install change determine retrieve fetch look scan collect list count sort merge wrap
fill truncate strip expand resolve walk iterate execute evaluate compile render display
show draw decompress compress pack unpack serialize deserialize accept connect bind listen
dispatch schedule cancel submit shutdown terminate kill spawn fork import export encrypt
hash sign verify tokenize guess detect transform filter map reduce select choose pick
""".split())


def opens_with_verb(sentence):
    words = sentence.split(" ")
    first = 1 if len(words) > 1 and words[0].lower().endswith("ly") else 0
    word = words[first].lower().rstrip(",")
    for base in (word, word[:-1], word[:-2]):
        if base in VERBS:
            return True
    return False


def first_sentence(doc):
    paragraph = re.split(r"\n\s*\n", doc.strip())[0]
    text = " ".join(paragraph.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return match.group(1) if match else text


def as_clause(sentence, third_person):
    """'Return the x.' -> 'returns the x.' (or 'return the x.'), to read after 'that' or
    'should'; an adverb first ('Recursively move') moves the change to the verb after it."""
    words = sentence.split(" ")
    first = 1 if len(words) > 1 and words[0].lower().endswith("ly") else 0
    verb = words[first]
    if not verb.isalpha():
        return sentence
    verb = verb.lower()
    if third_person and not verb.endswith(("s", "ed")):
        verb += "es" if verb.endswith(("sh", "ch", "x")) else "s"
    if not third_person and verb in ("does", "goes"):
        verb = verb[:-2]
    elif not third_person and verb.endswith("s") and not verb.endswith("ss"):
        verb = verb[:-2] if verb.endswith(("shes", "ches", "xes", "sses")) else verb[:-1]
    words[first] = verb
    if first:
        words[0] = words[0].lower()
    return " ".join(words)


def functions(stdlib):
    skip = re.compile(r"(^|/)(test|tests|idle_test|site-packages|lib2to3|turtledemo)(/|$)")
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if skip.search(rel):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for inner in node.body:
                    yield from documented(inner, node.name)
            else:
                yield from documented(node, None)


def documented(node, owner):
    """(owner, name, signature, first sentence) of a documented public function."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return
    doc = ast.get_docstring(node)
    if node.name.startswith("_") or not doc:
        return
    what = first_sentence(doc)
    if not 25 <= len(what) <= 240 or not what[0].isupper() or not opens_with_verb(what):
        return
    if owner and node.args.args and node.args.args[0].arg in ("self", "cls"):
        node.args.args = node.args.args[1:]
    args = ast.unparse(node.args)
    if len(args) <= 80:
        yield owner, node.name, args, what


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit", type=int, default=0, help="most training prompts (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(args.seed)
    seen = set()
    prompts = []
    for owner, name, signature, what in functions(stdlib):
        if (name, what) in seen:
            continue
        seen.add((name, what))
        phrasings = PHRASINGS if owner else PHRASINGS[:-1]
        phrasing, third_person = rng.choice(phrasings)
        what = as_clause(what, third_person)
        prompts.append(phrasing.format(owner=owner, name=name, args=signature, what=what))
    rng.shuffle(prompts)
    if args.limit:
        prompts = prompts[: args.limit]

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "train.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    with open(args.out / "eval.jsonl", "w") as f:
        for p in HELD_OUT:
            f.write(json.dumps({"prompt": p}) + "\n")
    (args.out / "eval.txt").write_text("".join(p + "\n" for p in HELD_OUT))
    print(f"{len(prompts)} training prompts from {stdlib}, {len(HELD_OUT)} held out, in {args.out}")


if __name__ == "__main__":
    main()
