"""The shell half of ``mrl from-verl``: a verl launch script's Hydra overrides, with the variables the script
assigns before its launch line expanded (``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``$((arithmetic))``,
arrays ``NAME=( ... )`` used as ``"${NAME[@]}"``). Pure text work, standard library only.

Bounded, because a script is input: every expansion is linear in its text (patterns matched at a position, never
on a slice of the rest), and what a script can make it do is capped, each cap refused in one line naming it:

* the script: :data:`MAX_SCRIPT_CHARS` characters (verl's own scripts are a few KiB);
* one expanded value or line: :data:`MAX_EXPANDED_CHARS` (``A=$A$A`` repeated doubles it every line);
* ``${A:-${B:-...}}`` nesting: :data:`MAX_NESTING` levels;
* ``$((...))``: :data:`MAX_TERMS` operators (each one a level of the parsed tree), results within bash's 64-bit
  integers.

What the script leaves open is reported: an unclosed ``${`` / ``$((`` is a note (its text kept as written), an
unbalanced quote in an assignment or the launch line an error naming the quote and where it opens.
"""
from __future__ import annotations

import ast
import operator
import re
import shlex

MAX_SCRIPT_CHARS = 1 << 20
MAX_EXPANDED_CHARS = 1 << 16
MAX_NESTING = 32
MAX_TERMS = 256  # well under Python's recursion limit: the evaluator recurses once per operator
_INT64 = 1 << 63


class ScriptError(ValueError):
    """A script mrl from-verl refuses to expand (a cap reached, an unbalanced quote): one line, what and where."""


_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_ENTRY = re.compile(r"(?:^|\s)(?:-m\s+)?(verl\.trainer\.main_\w+|recipe\.[\w.]+|verl/trainer/main_\w+\.py)(?=\s|$)")
_NAME = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")
_ARRAY_START = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=\((.*)$")
_ARRAY_USE = re.compile(r"\"?\$\{([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]\}\"?")


def _short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def logical_lines(text: str) -> list[str]:
    """Lines with backslash-newline continuations joined and full-line comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


class _Out:
    """The expansion being built, refused once it passes MAX_EXPANDED_CHARS."""

    def __init__(self, what: str) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.what = what

    def add(self, s: str) -> None:
        self.size += len(s)
        if self.size > MAX_EXPANDED_CHARS:
            raise ScriptError(f"expanding {self.what} gives more than {MAX_EXPANDED_CHARS} characters (a runaway "
                              "value, or a variable that doubles itself, e.g. A=$A$A); verl overrides are short "
                              "values: write the value out")
        self.parts.append(s)


def expand(text: str, env: dict[str, str], undefined: set[str], notes: list[str] | None = None,
           _depth: int = 0) -> str:
    """Shell expansion of $NAME, ${NAME}, ${NAME:-default} and $((arithmetic)) outside single quotes; names the
    script does not define are left as written (and collected in ``undefined``); an unclosed ``${`` or ``$((``
    stays as written, with a line in ``notes``."""
    if _depth > MAX_NESTING:
        raise ScriptError(f"${{...:-${{...}}}} defaults nested more than {MAX_NESTING} deep (in {_short(text)}); "
                          "verl scripts nest one or two: write the value out")
    out, i, quote = _Out(_short(text)), 0, ""
    while i < len(text):
        c = text[i]
        if c == "'" and quote != '"':
            quote = "" if quote == "'" else "'"
        elif c == '"' and quote != "'":
            quote = "" if quote == '"' else '"'
        if c != "$" or quote == "'":
            j = i + 1  # copy the run up to the next character that matters in one piece
            while j < len(text) and text[j] not in "$'\"":
                j += 1
            out.add(text[i:j])
            i = j
            continue
        if text.startswith("$((", i):
            end = _closing(text, i + 1, "(", ")")
            if end is None:
                _unclosed(text, i, "$((", "))", notes)
                out.add(text[i:])
                break
            inner = expand(text[i + 3:end - 1], env, undefined, notes, _depth + 1)
            bare = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: env.get(m.group(0), m.group(0)), inner)  # $(( a + b ))
            out.add(_arith(bare, text[i:end + 1]))
            i = end + 1
            continue
        if text.startswith("${", i):
            end = _closing(text, i + 1, "{", "}")
            if end is None:
                _unclosed(text, i, "${", "}", notes)
                out.add(text[i:])
                break
            body = text[i + 2:end]
            name, _, default = body.partition(":-")
            if name in env:
                out.add(env[name])
            elif ":-" in body:
                out.add(expand(default.strip('"'), env, undefined, notes, _depth + 1))
            else:
                undefined.add(name)
                out.add(text[i:end + 1])
            i = end + 1
            continue
        m = _NAME.match(text, i)
        if m is None:
            # "$@" / "$*" (the script's own arguments) expand to nothing here; a lone "$" stays
            special = text[i:i + 2] in ("$@", "$*")
            out.add("" if special else c)
            i += 2 if special else 1
            continue
        if m.group(1) in env:
            out.add(env[m.group(1)])
        else:
            undefined.add(m.group(1))
            out.add(m.group(0))
        i = m.end()
    return "".join(out.parts)


def _unclosed(text: str, i: int, open_: str, close: str, notes: list[str] | None) -> None:
    if notes is not None:
        notes.append(f"{_short(text[i:])} opens {open_} without its {close}: kept as written (not expanded); check "
                     "that line of the script")


def _closing(text: str, start: int, open_: str, close: str) -> int | None:
    """Index of the bracket closing the one at ``start``; None when the text ends first."""
    depth = 0
    for j in range(start, len(text)):
        depth += text[j] == open_
        depth -= text[j] == close
        if depth == 0:
            return j
    return None


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _arith(expr: str, original: str) -> str:
    """Integer arithmetic of $((...)) (+ - * / %), else the text unchanged. At most MAX_TERMS operators and
    parentheses (the parser and the evaluator recurse once per level), every value within 64-bit integers."""
    levels = sum(expr.count(ch) for ch in "+-*/%(")
    if levels > MAX_TERMS:
        raise ScriptError(f"{_short(original)} has {levels} operators, more than {MAX_TERMS}: write the number out")

    def ev(n: ast.AST) -> int:
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
            v = n.value
        elif isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            v = _OPS[type(n.op)](ev(n.left), ev(n.right))
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub | ast.UAdd):
            v = -ev(n.operand) if isinstance(n.op, ast.USub) else ev(n.operand)
        else:
            raise ValueError(expr)
        if not -_INT64 <= v < _INT64:
            raise ScriptError(f"{_short(original)} overflows bash's 64-bit integers: write the number out")
        return v

    try:
        return str(ev(ast.parse(expr.strip(), mode="eval").body))
    except ScriptError:
        raise
    except (ValueError, SyntaxError, ZeroDivisionError):
        return original


def unclosed_quote(text: str) -> tuple[str, int] | None:
    """(quote, index) of a quote the text opens and never closes, as the shell reads it (backslash escapes
    outside single quotes, comments outside quotes); None when balanced."""
    quote, at, i = "", -1, 0
    while i < len(text):
        c = text[i]
        if c == "\\" and quote != "'":
            i += 2
            continue
        if not quote and c == "#" and (i == 0 or text[i - 1].isspace()):
            break
        if c in "'\"" and (not quote or quote == c):
            quote, at = ("", -1) if quote else (c, i)
        i += 1
    return (quote, at) if quote else None


def _words(value: str, what: str) -> list[str]:
    """shlex's words of ``value``; an unbalanced quote is named with where it opens (the shell would not run it)."""
    bad = unclosed_quote(value)
    if bad is not None:
        q, at = bad
        raise ScriptError(f"{what}: the {q} quote at {_short(value[max(at - 20, 0):at + 20])} is never closed "
                          f"(character {at + 1} of {len(value)}); close it")
    try:
        return shlex.split(value, comments=True)
    except ValueError as e:  # what unclosed_quote does not foresee (shlex's own reading)
        raise ScriptError(f"{what}: {e} in {_short(value)}") from None


def overrides_from_script(text: str) -> tuple[list[str], list[str]]:
    """(the Hydra overrides of the script's verl launch line, notes): variables and arrays (``NAME=( ... )``,
    used as ``"${NAME[@]}"``) assigned before it expanded."""
    if len(text) > MAX_SCRIPT_CHARS:
        raise ScriptError(f"the script has {len(text)} characters, more than {MAX_SCRIPT_CHARS} (verl's launch "
                          "scripts are a few thousand): not a launch script")
    env: dict[str, str] = {}
    arrays: dict[str, list[str]] = {}
    undefined: set[str] = set()
    notes: list[str] = []
    lines = logical_lines(text)
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        i += 1
        entry = _ENTRY.search(stripped)
        if entry:
            rest = _ARRAY_USE.sub(lambda m: shlex.join(arrays.get(m.group(1), [])), stripped[entry.end():])
            args = _words(expand(rest, env, undefined, notes), "the verl launch line")
            notes += [f"${name} is not defined in the script; the value keeps it as written" for name in sorted(undefined)]
            return [a for a in args if "=" in a and not a.startswith("-")], notes
        arr = _ARRAY_START.match(stripped)
        if arr:
            body = [arr.group(2)]
            while ")" not in body[-1].split("#")[0] and i < len(lines):
                body.append(lines[i].strip())
                i += 1
            joined = "\n".join(b.split(" #")[0] for b in body if not b.startswith("#")).rsplit(")", 1)[0]
            arrays[arr.group(1)] = [w for line in joined.splitlines()
                                    for w in _words(expand(line, env, undefined, notes), f"array {arr.group(1)}")]
            continue
        m = _ASSIGN.match(stripped)
        if m:
            env[m.group(1)] = " ".join(_words(expand(m.group(2), env, undefined, notes), f"{m.group(1)}=..."))
    raise ValueError("no verl launch line found (python3 -m verl.trainer.main_ppo ... or a recipe's main module)")
