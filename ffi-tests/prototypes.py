#!/usr/bin/env python3
"""Normalised list of the NCCL function prototypes in preprocessed C.

Usage: prototypes.py [FILE]   (FILE, or stdin: the output of `gcc -E -P -x c` on nccl.h;
                               prototypes.sh runs the preprocessor and then this)

Output format (stable: the Rust side compares its exports against it):
  - one line per declared function whose name starts with "nccl" or "pnccl":
        RET NAME(TYPE1 NAME1, TYPE2 NAME2, ...)
  - tokens are separated by one space, except that "*" is joined to the token before it
    ("const char** out", "void* buff"), and "(", ")", "[", "]" and "," take no space
    before them; "," is followed by one space;
  - attributes (__attribute__((...)), __declspec(...)) and storage classes (extern) are
    dropped; qualifiers (const, volatile) are kept where they are written;
  - an empty parameter list is printed as written: "()" (in C, parameters unspecified; NVIDIA
    declares ncclGroupStart, ncclGroupEnd and ncclResetDebugInit so) or "(void)". A caller
    comparing with a C++ or Rust signature should read "()" as "(void)";
  - lines are sorted by byte value, duplicates (repeated declarations) printed once;
  - nothing else is printed. Exit status 1 if a declaration of an nccl name cannot be
    parsed, or if none is found.
"""

import re
import sys

TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|[A-Za-z_]\w*|\d\w*|\.\.\.|\S')
NAME = re.compile(r'p?nccl\w*$')
DROPPED_WORDS = {"extern", "__extension__", "__inline", "inline"}
CALLED_WORDS = {"__attribute__", "__attribute", "__declspec", "__asm__", "__asm", "asm"}


def strip_calls(tokens):
    """Drop `__attribute__((...))`-style groups and storage-class words."""
    out, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        if t in CALLED_WORDS and i + 1 < len(tokens) and tokens[i + 1] == "(":
            depth, i = 0, i + 1
            while i < len(tokens):
                depth += {"(": 1, ")": -1}.get(tokens[i], 0)
                i += 1
                if depth == 0:
                    break
            continue
        if t not in DROPPED_WORDS:
            out.append(t)
        i += 1
    return out


def join(tokens):
    """Tokens back to text with the spacing rules of the module docstring."""
    text = ""
    for t in tokens:
        if not text:
            text = t
        elif t in ("*", ")", "]", ",", "(", "["):
            text += t
        elif text.endswith(("(", "[")):
            text += t
        else:
            text += " " + t
    return text.replace(",", ", ")


def statements(tokens):
    """Split at top-level ';', keeping only what follows the last top-level '}'."""
    depth, current = 0, []
    for t in tokens:
        if t in ("{", "(", "["):
            depth += 1
        elif t in ("}", ")", "]"):
            depth -= 1
            if depth == 0 and t == "}":
                current = []  # a body ended: what came before is no prototype
                continue
        if t == ";" and depth == 0:
            yield current
            current = []
        else:
            current.append(t)


def split_params(tokens):
    """Parameter token lists, split at top-level commas."""
    params, depth, current = [], 0, []
    for t in tokens:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(t, 0)
        if t == "," and depth == 0:
            params.append(current)
            current = []
        else:
            current.append(t)
    params.append(current)
    return params


def prototype(stmt):
    """'RET NAME(PARAMS)' for a function declaration of an nccl name, else None."""
    toks = strip_calls(stmt)
    if not toks or toks[0] == "typedef" or toks[-1] != ")":
        return None
    depth = 0
    for i in range(len(toks) - 1, -1, -1):  # find the '(' matching the final ')'
        depth += {")": 1, "(": -1}.get(toks[i], 0)
        if depth == 0:
            break
    if i < 2 or not NAME.match(toks[i - 1]):
        return None
    ret, name, inner = toks[:i - 1], toks[i - 1], toks[i + 1:-1]
    if any(t in ("(", ")", "=") for t in ret):
        raise ValueError("cannot parse declaration of %s: %s" % (name, join(toks)))
    params = [join(p) for p in split_params(inner)] if inner else []
    if any(not p for p in params):
        raise ValueError("empty parameter in declaration of %s: %s" % (name, join(toks)))
    return "%s %s(%s)" % (join(ret), name, ", ".join(params))


def main():
    src = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    src = "\n".join(l for l in src.splitlines() if not l.lstrip().startswith("#"))
    lines = set()
    try:
        for stmt in statements(TOKEN.findall(src)):
            p = prototype(stmt)
            if p:
                lines.add(p)
    except ValueError as e:
        print("prototypes.py: %s" % e, file=sys.stderr)
        return 1
    if not lines:
        print("prototypes.py: no nccl prototypes found", file=sys.stderr)
        return 1
    sys.stdout.write("".join(l + "\n" for l in sorted(lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
